"""The step loop that SFT and DPO share: build, resume, train, log, checkpoint, evaluate.

`run_supervised(config, make_task)` owns everything both paradigms do the same way; `make_task` (in
`sft_loop` / `dpo_loop`) supplies what differs, as a `SupervisedTask`: the batch builder, how a host batch
becomes a placed `TrainBatch` (DPO adds reference log-probabilities), and the periodic evaluation.

Exact resume: a checkpoint at step `s` holds the train state after `s` updates, the data iterator's state after
`s` batches, the RNG and the config. A resumed run restores all of them and continues with batch `s + 1`, so
its losses and final params equal those of a run that never stopped (bitwise on CPU; the test kills a run with
SIGKILL at three points and compares).

Several processes (`feynrl-jax train` started once per host, joined by `jax.distributed`): the mesh spans every
process's devices and every process runs this same loop in step. Each one builds the same global batch plan (the
data mixture is deterministic, so its checkpointed state is the same everywhere) and moves to its devices only
the rows they hold; checkpoints are written by all of them together; process 0 alone writes `metrics.jsonl`,
wandb, the progress bar and `config.json`, and runs the generation evaluation (on its own devices, with the
params gathered from all). The losses equal a one-process run's on the same mesh shape
(tests/test_multiprocess_cli.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from ml_collections import ConfigDict

from feynrl_jax.checkpoints.train_state import RunProgress, TrainCheckpointer
from feynrl_jax.config.derived import algorithm_hyperparameters, batch_plan, checkpoint_every
from feynrl_jax.config.validation import validate
from feynrl_jax.data.packing import TokenBatch
from feynrl_jax.losses import TrainBatch, get_algorithm
from feynrl_jax.losses.metrics import combine_updates
from feynrl_jax.models import ModelConfig
from feynrl_jax.tracking import Tracker
from feynrl_jax.train import run_setup
from feynrl_jax.train.nonfinite import NonFiniteGuard, check_restored_state
from feynrl_jax.train.step import ParamsSpec, TrainStep, make_algorithm_train_step

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RunContext:
    """What a task builder may use (everything already unpacked from the config).

    Attributes:
        run_dir: the run folder.
        source: where the weights and tokenizer come from.
        tokenizer: the tokenizer.
        model_config: the model config.
        train_step: the compiled-on-first-call step (its `mesh` and `state_shardings`).
        rules: the logical-axis rules table the params are sharded by.
        initial_params: returns the run's initial params (loaded or initialised), placed like the state's
            params; called only by tasks that need them (DPO's reference), or to start a fresh run.
        lora_reference: with LoRA adapters, returns the starting policy as a reference model
            (`run_setup.lora_reference`): the train state's frozen base arrays themselves (no copy; they never
            change and are never donated), plus the `model.lora.init_from` adapters when the run started from some.
            None without LoRA.
    """

    run_dir: str
    source: run_setup.ModelSource
    tokenizer: Any
    model_config: ModelConfig
    train_step: TrainStep
    rules: Any
    initial_params: Callable[[], Any]
    lora_reference: Callable[[], Any] | None = None


@dataclasses.dataclass
class SupervisedTask:
    """What differs between SFT and DPO.

    Attributes:
        batches: the host batch builder: `next()` -> `TokenBatch`, `get_state()`/`set_state()` (JSON),
            `metrics()` (data counters).
        to_train_batch: host batch -> placed `TrainBatch` (DPO computes reference log-probabilities here).
        evaluate: `(params, step) -> metrics` (`eval/...`), or None when the run does not evaluate.
        close: releases the task's resources (reward workers, engines).
    """

    batches: Any
    to_train_batch: Callable[[TokenBatch], TrainBatch]
    evaluate: Callable[[Any, int], dict[str, float]] | None = None
    close: Callable[[], None] = lambda: None


def sft_train_batch(batch: TokenBatch) -> TrainBatch:
    """A host `TokenBatch` as a `TrainBatch` with the unused RL fields zero (`[B, T]` each)."""
    zeros = np.zeros(batch.tokens.shape, np.float32)
    return TrainBatch(
        tokens=batch.tokens,
        positions=batch.positions,
        segment_ids=batch.segment_ids,
        loss_mask=batch.loss_mask,
        advantages=zeros,
        old_logprobs=zeros,
    )


def _host_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    """The step's typed metrics as host floats (a supervised step is one update)."""
    return combine_updates([jax.device_get(metrics)])


def run_supervised(
    config: ConfigDict, make_task: Callable[[ConfigDict, RunContext], SupervisedTask]
) -> dict[str, float]:
    """Runs an SFT or DPO training run described by `config` until `config.train.steps`.

    Args:
        config: a validated config (`paradigm` "sft" or "dpo").
        make_task: builds the paradigm's `SupervisedTask` from the config and the run context.

    Returns:
        The metrics of the last step merged with the final evaluation's.

    Raises:
        FileExistsError: the run folder holds checkpoints but `checkpoint.resume` is False.
        InputError: the restored checkpoint holds non-finite params (names the step folder).
        NonFiniteError: too many consecutive skipped (non-finite) steps, a step that wrote a non-finite state, or
            every step of the run skipped.
    """
    validate(config, num_devices=jax.device_count())
    run_dir = config.run_dir
    source = run_setup.resolve_model_source(config.model, run_dir)
    tokenizer = run_setup.load_run_tokenizer(source)
    model_config = run_setup.model_config(config.model, source, tokenizer)
    mesh, rules = run_setup.build_mesh(config.mesh)
    run_setup.log_compute(model_config)
    algorithm = get_algorithm(config.algo.name)
    plan = batch_plan(config)
    total_steps = config.train.steps
    optimizer, schedule = run_setup.build_optimizer(config.optim, total_steps)
    train_step = make_algorithm_train_step(
        algorithm,
        optimizer,
        mesh,
        rules,
        config=model_config,
        hyperparameters=algorithm_hyperparameters(config, algorithm.hyperparameters),
        params_spec=ParamsSpec.of_model(model_config).with_master_dtype(config.model.master_dtype or None),
        grad_accum=plan.grad_accum_steps,
        learning_rate_fn=schedule,
        rng_seed=run_setup.dropout_seed(config, model_config),
        check_updated=False,  # build_optimizer's AdamW: finite in, finite out (make_optimizer)
    )

    def initial_params() -> Any:
        return run_setup.load_params(
            model_config,
            source,
            seed=config.seed,
            shardings=train_step.state_shardings.params,
            lora_init_from=config.model.lora.init_from or None,
        )

    save_every = checkpoint_every(config)
    with contextlib.ExitStack() as stack:
        checkpointer = stack.enter_context(
            TrainCheckpointer(
                run_dir, save_every=save_every, keep=config.checkpoint.keep, async_save=config.checkpoint.async_save
            )
        )
        latest = checkpointer.latest_step()
        if latest is not None and not config.checkpoint.resume:
            raise FileExistsError(
                f"run folder {run_dir} already holds checkpoints (latest step {latest}) and checkpoint.resume is "
                "False; pass --resume to continue it or choose another config.run_dir"
            )

        def build_state() -> tuple[Any, Any]:
            if latest is None:
                return train_step.init_state(initial_params()), None
            restored, progress = checkpointer.restore(train_step.abstract_state)
            check_restored_state(restored, os.path.join(checkpointer.directory, str(progress.step)))
            return restored, progress

        if model_config.lora_rank:
            # The reference of a LoRA run comes from the state's own base arrays: the state first. Built only when a
            # task asks for it (DPO), so an SFT run never reads a `model.lora.init_from` folder on resume.
            state, progress = build_state()

            def lora_reference() -> Any:
                return run_setup.lora_reference(
                    state.params,
                    model_config,
                    lora_init_from=config.model.lora.init_from or None,
                    shardings=train_step.state_shardings.params,
                )

            context = RunContext(
                run_dir, source, tokenizer, model_config, train_step, rules, initial_params, lora_reference
            )
            task = make_task(config, context)
        else:
            # The task first: a precomputed DPO reference is freed before the state (params and optimizer) exists.
            context = RunContext(run_dir, source, tokenizer, model_config, train_step, rules, initial_params)
            task = make_task(config, context)
            state, progress = build_state()
        stack.callback(task.close)
        if progress is None:
            rng = jax.random.key(config.seed)
            start = 0
        else:
            task.batches.set_state(progress.data_state)
            rng = progress.rng
            start = progress.step
            log.info("resumed %s from step %d of %d", run_dir, start, total_steps)
        primary = jax.process_index() == 0
        if primary:
            run_setup.write_resolved_config(config, run_dir)  # once the checkpoint it describes is known to be good

        config_json = run_setup.config_dict(config)
        guard = NonFiniteGuard(config.optim.max_consecutive_nonfinite)
        last: dict[str, float] = {}
        tracker = stack.enter_context(
            Tracker(
                run_dir,
                total_steps=total_steps,
                initial_step=start,
                jsonl=config.tracking.jsonl and primary,
                use_wandb=config.tracking.wandb and primary,
                wandb_project=config.tracking.wandb_project,
                wandb_name=config.name,
                config=config_json,
                progress_bar=config.tracking.progress_bar and primary,
            )
        )
        if task.evaluate is not None and start == 0:
            tracker.log(0, task.evaluate(state.params, 0))
        for step in range(start + 1, total_steps + 1):
            t0 = time.perf_counter()
            host_batch = next(task.batches)
            batch = task.to_train_batch(host_batch)
            state, metrics = train_step(state, batch)
            guard.check(metrics, step)
            checkpointer.save(
                state,
                RunProgress(
                    step=step,
                    rng=rng,
                    data_state=task.batches.get_state(),
                    policy_version=step,
                    config=config_json,
                ),
                force=step == total_steps,
            )
            record: dict[str, float] = {}
            if step % config.train.log_every == 0 or step == total_steps:
                record = _host_metrics(metrics)
                tokens = float(np.sum(host_batch.segment_ids > 0))
                seconds = time.perf_counter() - t0
                record.update(task.batches.metrics())
                record["perf/step_seconds"] = seconds
                record["perf/tokens_per_second"] = tokens / max(seconds, 1e-9)
            if task.evaluate is not None and (
                step == total_steps or (config.train.eval_every and step % config.train.eval_every == 0)
            ):
                record.update(task.evaluate(state.params, step))
            if record:
                tracker.log(step, record)  # one line per step: a later line for the same step would replace it
                last = record
        checkpointer.wait_until_finished()
        guard.finish()
    return last


def place(train_step: TrainStep, batch: TrainBatch) -> TrainBatch:
    """Places a host `TrainBatch` on the step's mesh (rows over `("data", "fsdp")`)."""
    return train_step.place_batch(batch)
