"""Supervised fine-tuning: `feynrl-jax train --config=configs/sft_<...>.py`.

The loss is the registry's `sft` (masked token cross-entropy on response / assistant tokens); batches come
from the config's training sources (optionally packed with `segment_ids`); evaluation generates answers to the
held-out split with the native engine and scores them with `config.eval.reward` (pass@k, accuracy, lengths).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
from ml_collections import ConfigDict

from feynrl_jax.data.from_config import build_mixture_from_config, build_sources_from_config
from feynrl_jax.eval.evaluate import GenerationEvaluator, evaluator_from_config
from feynrl_jax.models import ModelConfig, as_param_dtype, lora, quant
from feynrl_jax.sharding import host_tree
from feynrl_jax.train.run_lock import RunLock
from feynrl_jax.train.supervised_loop import RunContext, SupervisedTask, place, run_supervised, sft_train_batch


def train_prompts(config: ConfigDict) -> frozenset:
    """The raw prompt strings of the training sources (what a held-out evaluation must leave out)."""
    sources = build_sources_from_config(
        config.data, paradigm=config.paradigm, split="train", response_template=config.data.response_template
    )
    return frozenset(
        example["prompt"]
        for source in sources.values()
        for example in source.examples
        if isinstance(example.get("prompt"), str)
    )


class GenerationOnPrimary:
    """The held-out generation evaluation of a run (SFT, DPO, the RL trainer's), called by every process of it.

    One process: the evaluator's engine takes the trainer's params where they are (same shardings). Several
    processes: each call rounds the params to `param_dtype` on the devices (float32 masters travel as the bfloat16
    weights the engine would use), gathers them from every process (`host_tree`, a collective all of them make),
    and process 0 alone generates, on its own devices, and writes the results; the others return no metrics.
    LoRA adapters are first merged into their kernels (`lora.merge`, on the devices): the engine runs the base model
    (`model_config.without_lora()`) with the merged weights, at the base model's decode speed.

    Args:
        evaluator: a `GenerationEvaluator` of `model_config.without_lora()`, or None on a process that does not
            evaluate.
        model_config: the model's config (its `param_dtype`, its LoRA adapters).
    """

    def __init__(self, evaluator: GenerationEvaluator | None, model_config: ModelConfig):
        self.evaluator = evaluator
        self.model_config = model_config
        self._merge = jax.jit(functools.partial(lora.merge, config=model_config)) if model_config.lora_rank else None

    def __call__(self, params: Any, step: int) -> dict[str, float]:
        if self._merge is not None:
            params = self._merge(params)
        if jax.process_count() > 1:
            params = host_tree(as_param_dtype(params, self.model_config))
        return self.evaluator(params, step) if self.evaluator is not None else {}

    def close(self) -> None:
        if self.evaluator is not None:
            self.evaluator.close()


def evaluation_on(engine: Any, config: ConfigDict, model_config: ModelConfig, tokenizer: Any) -> GenerationEvaluator:
    """The held-out generation evaluation (`config.eval`, the training prompts left out, samples written to
    `<run_dir>/eval_results_step<N>.json`) on an engine the run already holds: an RL run's rollout engines (vLLM's
    workers, or a colocated native engine), which load the params they generate with themselves."""
    return evaluator_from_config(
        config,
        model_config,
        None,
        tokenizer,
        engine=engine,
        exclude_prompts=train_prompts(config),
        results_dir=config.run_dir,
    )


def generation_evaluation(
    config: ConfigDict, model_config: ModelConfig, tokenizer: Any, *, param_shardings: Any
) -> GenerationOnPrimary:
    """The held-out generation evaluation (`config.eval`, scored by `eval.reward`, samples written to
    `<run_dir>/eval_results_step<N>.json`) of a run whose trainer holds params at `param_shardings`."""
    evaluator = None
    if jax.process_index() == 0:
        if model_config.lora_rank:  # the engine gets merged weights (GenerationOnPrimary), a QLoRA base dequantized
            param_shardings = quant.kernel_shardings(lora.base_params(param_shardings))
        evaluator = evaluator_from_config(
            config,
            model_config.without_lora(),
            None,
            tokenizer,
            param_shardings=param_shardings if jax.process_count() == 1 else None,
            exclude_prompts=train_prompts(config),
            results_dir=config.run_dir,
        )
    return GenerationOnPrimary(evaluator, model_config)


def make_sft_task(config: ConfigDict, context: RunContext) -> SupervisedTask:
    """The SFT batches (`train.global_batch_size` rows), the plain `TrainBatch` and the generation eval."""
    batches = build_mixture_from_config(
        config.data,
        context.tokenizer,
        paradigm="sft",
        batch_size=config.train.global_batch_size,
        response_template=config.data.response_template,
    )
    evaluator = None
    if config.eval.during_training and config.eval.reward:
        evaluator = generation_evaluation(
            config, context.model_config, context.tokenizer, param_shardings=context.train_step.state_shardings.params
        )
    return SupervisedTask(
        batches=batches,
        to_train_batch=lambda batch: place(context.train_step, sft_train_batch(batch)),
        evaluate=evaluator,
        close=evaluator.close if evaluator is not None else (lambda: None),
    )


def run(config: ConfigDict) -> dict[str, float]:
    """Trains `config` (paradigm "sft") to `config.train.steps`, resuming from the run folder if it can.

    Returns:
        The last step's metrics, with the final evaluation's.
    """
    if config.paradigm != "sft":
        raise ValueError(f"sft_loop.run needs config.paradigm='sft', got {config.paradigm!r}")
    with RunLock(config.run_dir):  # one run per run folder, for the whole run
        return run_supervised(config, make_sft_task)
