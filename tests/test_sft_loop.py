"""The SFT loop end to end on a tiny random model: training, logging, checkpoints, held-out evaluation."""

import json
import os

import pytest

from feynrl_jax.checkpoints.train_state import latest_step
from feynrl_jax.config.base import add_data_source, base_config, data_source
from feynrl_jax.tracking import read_metrics
from feynrl_jax.train import sft_loop

STEPS = 12


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from feynrl_jax.data.toy_tokenizer import build_toy_tokenizer

    root = tmp_path_factory.mktemp("sft")
    train, test = [], []
    for i in range(40):
        a, b = i % 7 + 1, (i * 3) % 5 + 1
        row = {"prompt": f"What is {a} plus {b}?", "response": f"#### {a + b}", "answer": str(a + b)}
        (test if i % 5 == 0 else train).append(row)
    _write_jsonl(root / "train.jsonl", train)
    _write_jsonl(root / "test.jsonl", test)
    texts = [r["prompt"] + " " + r["response"] for r in train + test]
    build_toy_tokenizer(texts, vocab_size=280).save_pretrained(root / "tokenizer")
    return root


def tiny_sft_config(root, run_dir):
    config = base_config()
    config.paradigm = "sft"
    config.run_dir = str(run_dir)
    config.model.random_init = True
    config.model.tokenizer = str(root / "tokenizer")
    arch = config.model.arch
    arch.vocab_size, arch.hidden_size, arch.intermediate_size = 288, 32, 64
    arch.num_heads, arch.num_kv_heads, arch.head_dim = 4, 2, 8
    add_data_source(config, "toy", data_source("jsonl", path=str(root / "train.jsonl")))
    add_data_source(config, "toy_test", data_source("jsonl", path=str(root / "test.jsonl"), split="test"))
    config.data.max_seq_len = 48
    config.data.max_prompt_len = 32
    config.algo.name = "sft"
    config.algo.reference = "none"
    config.optim.lr = 3e-3
    config.optim.schedule = "constant"
    config.train.steps = STEPS
    config.train.global_batch_size = 8
    config.checkpoint.every_steps = 4
    config.tracking.progress_bar = False
    config.eval.reward = "gsm8k"
    config.eval.n_samples = 2
    config.eval.k = (1, 2)
    config.eval.max_new_tokens = 6
    config.eval.temperature = 1.0
    config.eval.num_prompts = 5
    config.rollout.max_slots = 4
    return config


@pytest.mark.slow
def test_sft_trains_logs_checkpoints_and_evaluates(data_dir, tmp_path, monkeypatch):
    from feynrl_jax.train import supervised_loop

    built = []  # the runs' train steps choose the update before computing it (`make_train_step`'s check_updated)
    make_step = supervised_loop.make_algorithm_train_step
    monkeypatch.setattr(
        supervised_loop, "make_algorithm_train_step", lambda *a, **k: built.append(make_step(*a, **k)) or built[-1]
    )
    run_dir = tmp_path / "run"
    config = tiny_sft_config(data_dir, run_dir)
    final = sft_loop.run(config)
    assert [step.check_updated for step in built] == [False]

    records = read_metrics(str(run_dir))
    assert [r["step"] for r in records] == list(range(0, STEPS + 1))
    losses = [r["train/loss"] for r in records[1:]]
    assert losses[-1] < 0.8 * losses[0], losses
    assert final["train/loss"] == losses[-1]
    for record in (records[0], records[-1]):  # evaluation at the start and at the end
        assert 0.0 <= record["eval/pass@1"] <= record["eval/pass@2"] <= 1.0
        assert record["eval/num_prompts"] == 5 and record["eval/num_samples"] == 10
        assert 1 <= record["eval/response_length"] <= 6
    assert "eval/pass@1" not in records[5]
    assert records[3]["train/data/taken_toy"] == 24
    for step in (0, STEPS):
        with open(run_dir / f"eval_results_step{step}.json") as f:
            results = json.load(f)
        assert results["step"] == step and len(results["samples"]) == 10
        assert all(s["answer"] is not None for s in results["samples"])
    assert latest_step(run_dir) == STEPS
    with open(run_dir / "config.json") as f:
        assert json.load(f)["paradigm"] == "sft"

    # A finished run folder is not silently overwritten.
    config.checkpoint.resume = False
    with pytest.raises(FileExistsError, match="already holds checkpoints"):
        sft_loop.run(config)


def test_sft_rejects_a_config_of_another_paradigm(data_dir, tmp_path):
    config = tiny_sft_config(data_dir, tmp_path / "run")
    config.paradigm = "dpo"
    with pytest.raises(ValueError, match="paradigm='sft'"):
        sft_loop.run(config)
    assert not os.path.exists(tmp_path / "run")


def test_model_source_errors_name_the_config_key(data_dir, tmp_path):
    from feynrl_jax.train import run_setup

    config = tiny_sft_config(data_dir, tmp_path / "run")
    model = config.model
    model.random_init = False
    with pytest.raises(ValueError, match="got none"):
        run_setup.resolve_model_source(model, str(tmp_path))
    model.random_init = True
    model.path = str(tmp_path)
    with pytest.raises(ValueError, match="model.path, model.random_init"):
        run_setup.resolve_model_source(model, str(tmp_path))
    model.path = None
    model.tokenizer = str(tmp_path / "missing")
    with pytest.raises(FileNotFoundError, match="config.model.tokenizer"):
        run_setup.resolve_model_source(model, str(tmp_path))
    model.tokenizer = None
    with pytest.raises(ValueError, match="needs config.model.tokenizer"):
        run_setup.resolve_model_source(model, str(tmp_path))
    model.tokenizer = str(data_dir / "tokenizer")
    model.arch.vocab_size = 100
    source = run_setup.resolve_model_source(model, str(tmp_path))
    with pytest.raises(ValueError, match="config.model.arch.vocab_size=100"):
        run_setup.model_config(model, source, run_setup.load_run_tokenizer(source))
