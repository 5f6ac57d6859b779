"""Evaluation: sample n completions per prompt, score them, report pass@k, mean reward and lengths.

`evaluate` is the library function (the RL loop calls it for its periodic evaluation); `run(config)` is
`feynrl-jax eval --config=...`: it builds the model, the engine (`rollout.engine`: native or vLLM), the held-out
prompts and the reward scorer from the config, calls `evaluate` and writes the results JSON into the run folder.

pass@k is the unbiased estimator of Chen et al. (2021, "Evaluating Large Language Models Trained on Code"),
`1 - C(n - c, k) / C(n, k)` per prompt, averaged over prompts (`feynrl_jax.eval.passk`).

A sample counts as correct when its reward (the scorer's weighted total, or one named reward) reaches
`success_threshold`; an empty completion (nothing but whitespace after decoding) is always a failure, whatever
its reward.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from feynrl_jax.eval.passk import pass_at_k
from feynrl_jax.rollout.types import FINISH_LENGTH, RolloutEngine, SamplingParams

RESULTS_FILE = "eval_results.json"


@dataclasses.dataclass(frozen=True)
class EvalReport:
    """What one evaluation measured.

    Attributes:
        metrics: flat `eval/...` metrics: `eval/pass@{k}` for each k, `eval/mean_reward`, `eval/accuracy`
            (fraction of correct samples), `eval/response_length` (mean tokens), `eval/truncated_frac`
            (samples that hit `max_new_tokens`), `eval/empty_frac`, `eval/num_prompts`, `eval/num_samples`.
        samples: one record per sample: `prompt_index`, `sample_index`, `completion`, `reward`, `correct`,
            `length`, `finish_reason` ("stop" or "length"), `answer` (the example's gold answer, if any).
        num_correct: `[P]` correct samples per prompt.
    """

    metrics: dict[str, float]
    samples: list[dict[str, Any]]
    num_correct: np.ndarray

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict: metrics, per-prompt correct counts and samples."""
        return {
            "metrics": self.metrics,
            "num_correct": self.num_correct.tolist(),
            "samples": self.samples,
        }


def evaluate(
    engine: RolloutEngine,
    tokenizer: Any,
    prompt_ids: Sequence[Sequence[int]],
    prompt_texts: Sequence[str],
    examples: Sequence[Mapping[str, Any]],
    scorer: Any,
    *,
    n: int,
    k_list: Sequence[int],
    sampling: SamplingParams,
    success_threshold: float = 1.0,
    correctness_reward: str | None = None,
    batch_prompts: int = 64,
) -> EvalReport:
    """Generates `n` samples per prompt with `engine`, scores them with `scorer`, and reports pass@k.

    Args:
        engine: a rollout engine (`generate(prompts, sampling) -> Rollouts`) holding the policy to evaluate.
        tokenizer: decodes completions (`tokenizer.decode(ids, skip_special_tokens=True)`).
        prompt_ids: P prompts as token ids (rendered with the chat template), unpadded.
        prompt_texts: the P rendered prompt strings (what rewards receive as `prompt`).
        examples: the P example dicts (gold `answer`, `metadata`) the rewards read.
        scorer: a `feynrl_jax.rollout.rewards.RewardScorer` (`score(prompts, completions, examples,
            completion_lengths=...) -> (total [N], per_reward, metrics)`).
        n: samples per prompt; overrides `sampling.n`.
        k_list: the k of each pass@k to report; every k must be in [1, n].
        sampling: temperature, top-k/p, max_new_tokens, stop tokens, seed.
        success_threshold: a sample is correct when its reward is >= this (and its completion is not empty).
        correctness_reward: the name of the reward (a key of the scorer's `per_reward`) that decides
            correctness; None: the weighted total.
        batch_prompts: prompts per `engine.generate` call (bounds host memory for long evaluations).

    Returns:
        An `EvalReport`.

    Raises:
        ValueError: on mismatched lengths, no prompts, or a k outside [1, n].
    """
    num_prompts = len(prompt_ids)
    if num_prompts == 0:
        raise ValueError("evaluate needs at least one prompt")
    if len(prompt_texts) != num_prompts or len(examples) != num_prompts:
        raise ValueError(
            f"prompt_ids, prompt_texts and examples need one entry per prompt, got {num_prompts}, "
            f"{len(prompt_texts)}, {len(examples)}"
        )
    bad_k = [k for k in k_list if not 1 <= k <= n]
    if bad_k:
        raise ValueError(f"eval.k values must be in [1, n_samples={n}], got {list(k_list)}")
    sampling = dataclasses.replace(sampling, n=n)

    start = time.perf_counter()
    completions: list[str] = []
    lengths: list[int] = []
    truncated: list[bool] = []
    for first in range(0, num_prompts, batch_prompts):
        chunk = [list(p) for p in prompt_ids[first : first + batch_prompts]]
        rollouts = engine.generate(chunk, sampling)
        for ids in rollouts.completions():
            completions.append(tokenizer.decode(ids, skip_special_tokens=True))
        lengths.extend(int(x) for x in rollouts.completion_lengths)
        truncated.extend(bool(x == FINISH_LENGTH) for x in rollouts.finish_reason)
    generate_s = time.perf_counter() - start

    rows = num_prompts * n
    if len(completions) != rows:
        raise RuntimeError(f"the engine returned {len(completions)} samples for {num_prompts} prompts x n={n}")
    row_prompts = [prompt_texts[i // n] for i in range(rows)]
    row_examples = [dict(examples[i // n]) for i in range(rows)]
    total, per_reward, _ = scorer.score(row_prompts, completions, row_examples, completion_lengths=lengths)
    if correctness_reward is None:
        rewards = np.asarray(total, np.float64)
    else:
        if correctness_reward not in per_reward:
            raise ValueError(
                f"correctness_reward {correctness_reward!r} is not one of the scorer's rewards {sorted(per_reward)}"
            )
        rewards = np.asarray(per_reward[correctness_reward], np.float64)
    empty = np.array([not c.strip() for c in completions])
    correct = (rewards >= success_threshold) & ~empty
    num_correct = correct.reshape(num_prompts, n).sum(axis=1)

    metrics: dict[str, float] = {}
    for k in k_list:
        metrics[f"eval/pass@{k}"] = float(np.mean([pass_at_k(n, int(c), k) for c in num_correct]))
    metrics["eval/accuracy"] = float(correct.mean())
    metrics["eval/mean_reward"] = float(np.mean(total))
    metrics["eval/response_length"] = float(np.mean(lengths))
    metrics["eval/truncated_frac"] = float(np.mean(truncated))
    metrics["eval/empty_frac"] = float(empty.mean())
    metrics["eval/num_prompts"] = float(num_prompts)
    metrics["eval/num_samples"] = float(rows)
    metrics["perf/eval/generate_seconds"] = generate_s

    samples = []
    for i in range(rows):
        samples.append(
            {
                "prompt_index": i // n,
                "sample_index": i % n,
                "completion": completions[i],
                "reward": float(total[i]),
                "correct": bool(correct[i]),
                "length": lengths[i],
                "finish_reason": "length" if truncated[i] else "stop",
                "answer": row_examples[i].get("answer"),
            }
        )
    return EvalReport(metrics=metrics, samples=samples, num_correct=num_correct)


def write_report(
    report: EvalReport, run_dir: str, *, step: int | None = None, extra: Mapping[str, Any] | None = None
) -> str:
    """Writes `report` as JSON into `run_dir` and returns the path.

    The file is `eval_results.json` (or `eval_results_step{step}.json` during training); it is written to a
    temporary name and renamed, so a reader never sees half a file.
    """
    os.makedirs(run_dir, exist_ok=True)
    name = RESULTS_FILE if step is None else f"eval_results_step{step}.json"
    path = os.path.join(run_dir, name)
    payload = {"step": step, **(dict(extra) if extra else {}), **report.to_json()}
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(tmp, path)
    return path


# -- the config edge --------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class EvalSet:
    """Held-out prompts, rendered and tokenised.

    Attributes:
        prompt_ids: P token-id lists (chat template applied).
        prompt_texts: the P rendered prompt strings.
        examples: the P example dicts (gold answers and metadata for the rewards).
        dropped: prompts left out by reason ("prompt_too_long", "in_train_set").
    """

    prompt_ids: list[list[int]]
    prompt_texts: list[str]
    examples: list[dict[str, Any]]
    dropped: dict[str, int]


def load_eval_set(config: Any, tokenizer: Any, *, exclude_prompts: set | frozenset = frozenset()) -> EvalSet:
    """The first `config.eval.num_prompts` prompts (all when 0) of the sources with split `config.eval.split`.

    One pass in source order (no shuffling), so every call sees the same prompts. Prompts whose raw text is in
    `exclude_prompts` (the training set's) are dropped and counted, so held-out numbers are held out.

    Raises:
        feynrl_jax.data.DataError: no source has the eval split (names the sources), or none is left.
    """
    from feynrl_jax.data import DataError
    from feynrl_jax.data.from_config import build_mixture_from_config

    limit = config.eval.num_prompts
    batches = build_mixture_from_config(
        config.data,
        tokenizer,
        paradigm="eval",
        batch_size=limit or 256,
        split=config.eval.split,
        shuffle=False,
        num_epochs=1,
    )
    ids, texts, examples = [], [], []
    dropped = {"in_train_set": 0}
    while not limit or len(ids) < limit:
        try:
            batch = next(batches)
        except StopIteration:
            break
        for prompt_ids, text, example in zip(batch.prompt_ids, batch.prompt_texts, batch.examples):
            if isinstance(example["prompt"], str) and example["prompt"] in exclude_prompts:
                dropped["in_train_set"] += 1
                continue
            if limit and len(ids) == limit:
                break
            ids.append(prompt_ids)
            texts.append(text)
            examples.append(example)
    dropped.update(batches.skip_counts())
    if not ids:
        raise DataError(f"no evaluation prompts left in split {config.eval.split!r} (dropped: {dropped})")
    return EvalSet(ids, texts, examples, dropped)


def sampling_from_config(config: Any, tokenizer: Any) -> SamplingParams:
    """Evaluation sampling: `eval.temperature` (0: greedy), `eval.max_new_tokens`, EOS and stop strings."""
    eos = tokenizer.eos_token_id
    stop_ids = tuple(eos) if isinstance(eos, list | tuple) else ((eos,) if eos is not None else ())
    temperature = config.eval.temperature
    return SamplingParams(
        temperature=temperature if temperature > 0 else 1.0,
        greedy=temperature == 0,
        max_new_tokens=config.eval.max_new_tokens,
        stop_token_ids=stop_ids,
        stop_strings=tuple(config.rollout.stop_strings),
        n=config.eval.n_samples,
        seed=config.seed,
    )


class GenerationEvaluator:
    """Evaluates params on a fixed `EvalSet` with the native engine and a reward scorer (the loops' eval).

    Args:
        model_config: the model config.
        params: initial params (any placement; `param_shardings` places them), or None: the engine is built
            on the first call.
        tokenizer: decodes completions.
        eval_set: the held-out prompts.
        reward: the reward spec deciding correctness (a `feynrl_jax.rollout.rewards` registry name).
        success_threshold: reward at or above which a sample is correct.
        n: samples per prompt.
        k_list: pass@k to report.
        sampling: sampling settings (`n` is overridden by `n`).
        num_slots: decode slots of the engine.
        decode_steps_per_dispatch: engine decode steps per host round trip.
        param_shardings: shardings of the params on the mesh (the trainer's), or None.
        results_dir: when set, every call writes `eval_results_step{step}.json` there (samples included).
        engine: a `RolloutEngine` to evaluate with instead of a native engine of its own (a `VLLMEngine`, the RL
            run's rollout workers); each call hands it `params` through its `load_params(params, step)`.
        owns_engine: `close()` closes `engine` too.
        release_memory: a native engine of the evaluator's own frees its params and KV cache after each call
            (`eval.release_memory`, see `__call__`); an engine handed in is left as it is.
    """

    def __init__(
        self,
        model_config: Any,
        params: Any,
        tokenizer: Any,
        eval_set: EvalSet,
        *,
        reward: str,
        reward_kwargs: Mapping[str, Any] | None = None,
        success_threshold: float,
        n: int,
        k_list: Sequence[int],
        sampling: SamplingParams,
        num_slots: int,
        decode_steps_per_dispatch: int,
        param_shardings: Any = None,
        results_dir: str | None = None,
        engine: Any = None,
        owns_engine: bool = False,
        release_memory: bool = True,
    ):
        from feynrl_jax.rollout.rewards.scorer import RewardScorer

        self.results_dir = results_dir

        self.model_config, self.param_shardings = model_config, param_shardings
        self.num_slots, self.decode_steps_per_dispatch = num_slots, decode_steps_per_dispatch
        self.tokenizer, self.eval_set, self.reward = tokenizer, eval_set, reward
        self.success_threshold, self.n, self.k_list, self.sampling = success_threshold, n, tuple(k_list), sampling
        self.last_report: EvalReport | None = None
        self.owns_engine = owns_engine
        self.release_memory = release_memory and engine is None  # an engine handed in is the caller's
        self.engine = engine if engine is not None or params is None else self._make_engine(params)
        self.scorer = RewardScorer(
            {reward: 1.0}, reward_kwargs={reward: dict(reward_kwargs)} if reward_kwargs else None, num_workers=1
        )

    def _make_engine(self, params: Any):
        from feynrl_jax.rollout.native_engine import NativeEngine

        longest = max(len(p) for p in self.eval_set.prompt_ids)
        return NativeEngine(
            self.model_config,
            params,
            num_slots=self.num_slots,
            cache_len=longest + self.sampling.max_new_tokens,
            decode_steps_per_dispatch=self.decode_steps_per_dispatch,
            detokenize=lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True),
            param_shardings=self.param_shardings,
        )

    def __call__(self, params: Any, step: int) -> dict[str, float]:
        """Loads `params` as policy version `step`, evaluates, and returns the `eval/` metrics.

        With `release_memory`, the evaluator's own native engine then frees its copy of the params and its KV
        cache (`NativeEngine.release_memory`; its compiled programs stay). A trainer evaluates between updates: the
        memory a held engine kept would sit between the update's large buffers, so the next update could not reuse
        the pages the evaluation had touched and took fresh ones. On the 2-core development machine, with the
        demo evaluating after every step (`benchmarks/bench_eval_release.py`, medians of 4 runs a side), the second
        update took 7.9 s with the engine kept (7.5 s of it in the kernel, faulting fresh pages in) against 4.5 s
        freed, and the trainer's peak resident memory was 8.67 GiB against 6.57.
        """
        if self.engine is None:
            self.engine = self._make_engine(params)
        try:
            self.engine.load_params(params, step)
            report = evaluate(
                self.engine,
                self.tokenizer,
                self.eval_set.prompt_ids,
                self.eval_set.prompt_texts,
                self.eval_set.examples,
                self.scorer,
                n=self.n,
                k_list=self.k_list,
                sampling=self.sampling,
                success_threshold=self.success_threshold,
                correctness_reward=self.reward,
            )
        finally:
            if self.release_memory:
                self.engine.release_memory()
        self.last_report = report
        if self.results_dir is not None:
            extra = {"dropped": self.eval_set.dropped, "engine": type(self.engine).__name__}
            write_report(report, self.results_dir, step=step, extra=extra)
        return report.metrics

    def close(self) -> None:
        self.scorer.close()
        if self.owns_engine:
            self.engine.close()
            self.owns_engine = False


def evaluator_from_config(
    config: Any,
    model_config: Any,
    params: Any,
    tokenizer: Any,
    *,
    param_shardings: Any = None,
    exclude_prompts: set | frozenset = frozenset(),
    results_dir: str | None = None,
    engine: Any = None,
) -> GenerationEvaluator:
    """A `GenerationEvaluator` on the config's eval split (`config.eval`, `config.rollout` engine sizes).

    The engine: `engine` when given (see `GenerationEvaluator`); else a vLLM engine of the evaluator's own when
    `rollout.engine="vllm"` (closed by the evaluator's `close`), else a native one.
    """
    eval_set = load_eval_set(config, tokenizer, exclude_prompts=exclude_prompts)
    own_vllm = engine is None and config.rollout.engine == "vllm"
    if own_vllm:
        engine = vllm_engine(config, model_config, tokenizer, eval_set)
    return GenerationEvaluator(
        model_config,
        params,
        tokenizer,
        eval_set,
        reward=config.eval.reward,
        reward_kwargs=dict(config.eval.reward_kwargs),
        success_threshold=config.eval.success_threshold,
        n=config.eval.n_samples,
        k_list=tuple(config.eval.k),
        sampling=sampling_from_config(config, tokenizer),
        num_slots=config.rollout.max_slots,
        decode_steps_per_dispatch=config.rollout.decode_steps_per_dispatch,
        param_shardings=param_shardings,
        results_dir=results_dir,
        engine=engine,
        owns_engine=own_vllm,
        release_memory=config.eval.release_memory,
    )


def vllm_engine(config: Any, model_config: Any, tokenizer: Any, eval_set: EvalSet) -> Any:
    """A running `VLLMEngine` (`rollout.vllm` settings) long enough for the longest eval prompt plus
    `eval.max_new_tokens`, its weights not loaded yet (the evaluator loads the params at each call)."""
    from feynrl_jax.orchestration.engines import build_vllm, engine_spec

    longest = max(len(p) for p in eval_set.prompt_ids)
    spec = engine_spec(config, model_config, tokenizer, cache_len=longest + config.eval.max_new_tokens)
    return build_vllm(spec, model_config)


def run(config: Any) -> dict[str, float]:
    """`feynrl-jax eval`: evaluates the config's model on its eval split and writes `eval_results.json`.

    The engine is `rollout.engine`: the native JAX engine, or vLLM (started from a weightless folder in the run
    folder, then given the params in memory, like an RL run's rollout workers). In a multi-process launch
    process 0 evaluates on its own devices and writes the results; the other processes wait for it.

    Returns:
        The `eval/` metrics (also printed, one per line).
    """
    import jax
    from jax.experimental import multihost_utils

    if jax.process_count() > 1:  # a multi-process launch: process 0 evaluates, the others wait for it
        try:
            return _evaluate(config) if jax.process_index() == 0 else {}
        finally:
            multihost_utils.sync_global_devices("feynrl-jax eval finished")
    return _evaluate(config)


def _evaluate(config: Any) -> dict[str, float]:
    from feynrl_jax.train import run_setup

    run_dir = config.run_dir
    source = run_setup.resolve_model_source(config.model, run_dir)
    tokenizer = run_setup.load_run_tokenizer(source)
    model_config = run_setup.model_config(config.model, source, tokenizer)
    params = run_setup.load_params(
        model_config, source, seed=config.seed, lora_init_from=config.model.lora.init_from or None
    )
    if model_config.lora_rank:  # a PEFT adapter on the base: evaluated merged, at the base model's speed
        from feynrl_jax.models import lora

        params, model_config = lora.merge(params, model_config), model_config.without_lora()
    evaluator = evaluator_from_config(config, model_config, params, tokenizer)
    try:
        metrics = evaluator(params, 0)
        path = write_report(
            evaluator.last_report,
            run_dir,
            extra={
                "model": source.weights_dir or "random_init",
                "dropped": evaluator.eval_set.dropped,
                "engine": type(evaluator.engine).__name__,
            },
        )
    finally:
        evaluator.close()
    for name, value in metrics.items():
        print(f"{name}: {value:.6g}")
    print(f"wrote {path}")
    return metrics
