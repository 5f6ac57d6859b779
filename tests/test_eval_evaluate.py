"""Evaluation: pass@k against brute-force enumeration over real samples, empty completions, and `feynrl-jax eval`."""

import itertools
import json

import jax
import numpy as np
import pytest

from feynrl_jax.config.base import add_data_source, base_config, data_source
from feynrl_jax.data.tokenization import render_prompt, tokenize_prompt
from feynrl_jax.eval import evaluate as evaluate_lib
from feynrl_jax.models import ModelConfig, init_params
from feynrl_jax.rollout.native_engine import NativeEngine
from feynrl_jax.rollout.rewards.scorer import RewardScorer
from feynrl_jax.rollout.types import SamplingParams


def even_length_reward(prompt, completion, example):
    """A deterministic reward that some random completions pass and some fail."""
    del prompt, example
    return float(len(completion) % 2 == 0)


def always_one_reward(prompt, completion, example):
    del prompt, completion, example
    return 1.0


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    from feynrl_jax.data.toy_tokenizer import build_toy_tokenizer

    root = tmp_path_factory.mktemp("eval")
    rows = [{"prompt": f"What is {i} plus {i + 1}?", "answer": str(2 * i + 1)} for i in range(1, 9)]
    with open(root / "test.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    tokenizer = build_toy_tokenizer([r["prompt"] + " " + r["answer"] for r in rows], vocab_size=270)
    tokenizer.save_pretrained(root / "tokenizer")
    config = ModelConfig(
        vocab_size=288, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8
    )
    prompts = [render_prompt(tokenizer, r["prompt"]) for r in rows]
    ids = [tokenize_prompt(tokenizer, r["prompt"]) for r in rows]
    return root, tokenizer, config, rows, prompts, ids


def _brute_force_pass_at_k(flags, k):
    """P(at least one correct among k draws without replacement), by enumerating every k-subset."""
    subsets = list(itertools.combinations(range(len(flags)), k))
    return sum(any(flags[i] for i in s) for s in subsets) / len(subsets)


def test_pass_at_k_matches_enumeration_over_real_samples(toy):
    _, tokenizer, config, rows, prompts, ids = toy
    engine = NativeEngine(config, init_params(config, jax.random.key(1)), num_slots=8, cache_len=64)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=5, seed=3)
    with RewardScorer({"test_eval_evaluate:even_length_reward": 1.0}, num_workers=1) as scorer:
        report = evaluate_lib.evaluate(
            engine,
            tokenizer,
            ids,
            prompts,
            rows,
            scorer,
            n=4,
            k_list=(1, 2, 4),
            sampling=sampling,
            correctness_reward="test_eval_evaluate:even_length_reward",
            batch_prompts=3,
        )
    flags = np.array([s["correct"] for s in report.samples]).reshape(len(rows), 4)
    for s in report.samples:  # the flags are the reward's verdict on the decoded text (and never on empty text)
        assert s["correct"] == (len(s["completion"]) % 2 == 0 and bool(s["completion"].strip()))
    assert 0 < flags.sum() < flags.size, "the check needs both outcomes"
    for k in (1, 2, 4):
        want = np.mean([_brute_force_pass_at_k(row, k) for row in flags])
        assert report.metrics[f"eval/pass@{k}"] == pytest.approx(want, abs=1e-12)
    np.testing.assert_array_equal(report.num_correct, flags.sum(axis=1))
    assert report.metrics["eval/num_samples"] == 32
    assert [s["prompt_index"] for s in report.samples] == [i // 4 for i in range(32)]
    lengths = [s["length"] for s in report.samples]
    assert report.metrics["eval/response_length"] == pytest.approx(np.mean(lengths))
    with pytest.raises(ValueError, match="eval.k"):
        evaluate_lib.evaluate(engine, tokenizer, ids, prompts, rows, scorer, n=2, k_list=(4,), sampling=sampling)


def test_empty_completions_are_failures_whatever_their_reward(toy):
    _, tokenizer, config, rows, prompts, ids = toy
    params = init_params(config, jax.random.key(0))
    params["final_norm"]["scale"] = params["final_norm"]["scale"] * 0.0  # all logits 0: greedy picks <pad> (id 0)
    engine = NativeEngine(config, params, num_slots=8, cache_len=64)
    sampling = SamplingParams(greedy=True, max_new_tokens=3)
    with RewardScorer({"test_eval_evaluate:always_one_reward": 1.0}, num_workers=1) as scorer:
        report = evaluate_lib.evaluate(
            engine, tokenizer, ids[:3], prompts[:3], rows[:3], scorer, n=2, k_list=(1, 2), sampling=sampling
        )
    assert all(s["completion"] == "" and s["reward"] == 1.0 for s in report.samples)
    assert report.metrics["eval/mean_reward"] == 1.0
    assert report.metrics["eval/empty_frac"] == 1.0
    assert report.metrics["eval/pass@1"] == 0.0 and report.metrics["eval/pass@2"] == 0.0
    assert report.metrics["eval/truncated_frac"] == 1.0


def test_eval_command_writes_results_json(toy, tmp_path):
    root = toy[0]
    config = base_config()
    config.paradigm = "eval"
    config.run_dir = str(tmp_path / "eval_run")
    config.model.random_init = True
    config.model.tokenizer = str(root / "tokenizer")
    arch = config.model.arch
    arch.vocab_size, arch.hidden_size, arch.intermediate_size = 288, 32, 64
    arch.num_heads, arch.num_kv_heads, arch.head_dim = 4, 2, 8
    add_data_source(config, "toy_test", data_source("jsonl", path=str(root / "test.jsonl"), split="test"))
    config.data.max_prompt_len = 40
    config.data.max_seq_len = 48
    config.eval.reward = "test_eval_evaluate:even_length_reward"
    config.eval.n_samples = 2
    config.eval.k = (1, 2)
    config.eval.max_new_tokens = 4
    config.eval.num_prompts = 5
    config.rollout.max_slots = 4
    metrics = evaluate_lib.run(config)
    with open(tmp_path / "eval_run" / evaluate_lib.RESULTS_FILE) as f:
        saved = json.load(f)
    assert saved["metrics"] == metrics
    assert len(saved["samples"]) == 10 and saved["model"] == "random_init"
    assert [s["answer"] for s in saved["samples"][::2]] == ["3", "5", "7", "9", "11"]
    assert 0.0 <= metrics["eval/pass@1"] <= metrics["eval/pass@2"] <= 1.0


def _gsm8k_eval_config(toy, tmp_path):
    """An "eval" config over the toy test file, scored by the `gsm8k` reward."""
    config = base_config()
    config.paradigm = "eval"
    config.run_dir = str(tmp_path / "eval_run")
    add_data_source(config, "toy_test", data_source("jsonl", path=str(toy[0] / "test.jsonl"), split="test"))
    config.data.max_prompt_len = 40
    config.data.max_seq_len = 48
    config.eval.reward = "gsm8k"
    return config


def test_eval_reward_kwargs_reach_the_evaluators_reward(toy, tmp_path):
    """`eval.reward_kwargs` is read by every evaluator (SFT, DPO, RL, `feynrl-jax eval`), not by RL alone."""
    tokenizer, model_config = toy[1], toy[2]
    config = _gsm8k_eval_config(toy, tmp_path)
    config.eval.num_prompts = 1
    completion = "so the answer is 3"  # no "####" marker: only `fallback_last_number` grades its last number
    scores = {}
    for fallback in (False, True):
        with config.eval.reward_kwargs.unlocked():
            config.eval.reward_kwargs.fallback_last_number = fallback
        evaluator = evaluate_lib.evaluator_from_config(config, model_config, None, tokenizer)
        try:
            rewards, _, _ = evaluator.scorer.score(["q"], [completion], [{"answer": "3"}])
        finally:
            evaluator.close()
        scores[fallback] = float(rewards[0])
    assert scores == {False: 0.0, True: 1.0}


def test_eval_command_evaluates_a_peft_adapter_on_its_base(toy, tmp_path):
    """`model.lora.init_from` in `feynrl-jax eval`: the base with that adapter (merged), not the bare base."""
    from feynrl_jax.checkpoints.peft_adapters import export_peft
    from feynrl_jax.models import lora

    root = toy[0]

    def eval_config(name):
        config = base_config()
        config.paradigm = "eval"
        config.run_dir = str(tmp_path / name)
        config.seed = 0
        config.model.random_init = True
        config.model.tokenizer = str(root / "tokenizer")
        arch = config.model.arch
        arch.vocab_size, arch.hidden_size, arch.intermediate_size = 288, 32, 64
        arch.num_heads, arch.num_kv_heads, arch.head_dim = 4, 2, 8
        add_data_source(config, "toy_test", data_source("jsonl", path=str(root / "test.jsonl"), split="test"))
        config.data.max_prompt_len = 40
        config.data.max_seq_len = 48
        config.eval.reward = "test_eval_evaluate:even_length_reward"
        config.eval.n_samples, config.eval.k, config.eval.temperature = 1, (1,), 0.0
        config.eval.max_new_tokens = 6
        config.eval.num_prompts = 8
        config.rollout.max_slots = 4
        return config

    def completions(name):
        with open(tmp_path / name / evaluate_lib.RESULTS_FILE) as f:
            return [s["completion"] for s in json.load(f)["samples"]]

    evaluate_lib.run(eval_config("base"))
    adapted = eval_config("adapted")
    adapted.model.lora.rank, adapted.model.lora.alpha = 4, 8.0
    model_config = ModelConfig(
        vocab_size=288,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        lora_rank=4,
        lora_alpha=8.0,
        lora_targets=tuple(adapted.model.lora.targets),
    )
    params = init_params(model_config, jax.random.key(1))
    strong = jax.tree_util.tree_map_with_path(
        lambda path, x: jax.random.normal(jax.random.key(2), x.shape) if lora.is_adapter_path(path) else x, params
    )
    adapted.model.lora.init_from = export_peft(strong, model_config, str(tmp_path / "adapter"))
    evaluate_lib.run(adapted)
    assert completions("adapted") != completions("base")  # an ignored adapter would leave the base's greedy answers


def test_eval_release_memory_frees_the_engine_between_calls_and_changes_no_result(toy, tmp_path):
    """`eval.release_memory` (default True): after each call the evaluator's own native engine holds no params and
    no KV cache; with False it keeps both. Either way the calls return the same metrics."""
    tokenizer, model_config = toy[1], toy[2]
    params = init_params(model_config, jax.random.PRNGKey(0))
    config = _gsm8k_eval_config(toy, tmp_path)
    config.eval.num_prompts = 4
    config.eval.max_new_tokens = 6
    results = {}
    for release in (True, False):
        config.eval.release_memory = release
        evaluator = evaluate_lib.evaluator_from_config(config, model_config, None, tokenizer)
        try:
            calls = [evaluator(params, step) for step in (0, 1)]
            calls = [{k: v for k, v in c.items() if not k.startswith("perf/")} for c in calls]  # times differ
            engine = evaluator.engine
            held = (engine._params is not None, engine._state is not None)
        finally:
            evaluator.close()
        assert held == ((False, False) if release else (True, True))
        assert calls[0] == calls[1]
        results[release] = calls[0]
    assert results[True] == results[False]
    # An engine handed in (the RL run's vLLM workers, TRL's in the learning benchmark) is the caller's: never freed.
    config.eval.release_memory = True
    handed = NativeEngine(model_config, params, num_slots=4, cache_len=48)
    evaluator = evaluate_lib.evaluator_from_config(config, model_config, None, tokenizer, engine=handed)
    try:
        evaluator(params, 0)
    finally:
        evaluator.close()
    assert handed._params is not None and handed._state is not None
