"""The RL trainer compiles its update in a thread of its own from `start` on, on a placeholder batch; the first
real update runs that program: it neither traces nor compiles the train step again.

What would break it: a placeholder whose pytree, shapes, dtypes or shardings differ from a real mini-batch's in any
layout (one row per sample, shared prefix, packed), with any of the optional fields (the reference's
log-probabilities, the critic's values and returns, a separate proximal pass), with frozen params (LoRA), with
bfloat16 params over float32 masters, or after a resume. Then the first update would trace and compile again, in
the main thread, and these tests fail.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import jax
import numpy as np
import pytest
from test_shared_prefix import _rollouts

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "configs"))
import tiny_rl  # noqa: E402

from feynrl_jax.compile_clock import COMPILE_EVENT  # noqa: E402
from feynrl_jax.train.rl_trainer import RLTrainer, placeholder_rollouts  # noqa: E402
from feynrl_jax.train.step import TrainStep  # noqa: E402

STEP = "jit(step)"  # the policy's and the critic's train step (`step.make_train_step`)

# case: (algorithm, config overrides, (shared-prefix layout, packed)). tiny_rl's GRPO has a KL term (the
# reference's log-probabilities); its PPO a critic (values, returns).
CASES = {
    # "auto": on a CPU in float32 "dots" (the tiny model's own is "none"), whose step takes no sink.
    "grpo_one_row_per_sample": (
        "grpo",
        {"train.shared_prefix": "off", "train.pack_sequences": False, "model.remat": "auto"},
        (False, False),
    ),
    "grpo_shared_prefix": (
        "grpo",
        {"train.shared_prefix": "on", "train.pack_sequences": False, "train.micro_batch_size": 16},
        (True, False),
    ),
    # Rematerialisation "full" (the CPU default in bfloat16; the tiny model's is "none"): 2 micro-batches whose layers'
    # gradient the model adds into the accumulator in place (`grad_sink`).
    "grpo_packed": (
        "grpo",
        {"train.shared_prefix": "off", "train.pack_sequences": True, "model.remat": "full"},
        (False, True),
    ),
    "grpo_lora": ("grpo", {"train.shared_prefix": "off", "model.lora.rank": 4}, (False, True)),
    "grpo_bf16_masters_two_mini_batches": (
        "grpo",
        {
            "train.shared_prefix": "off",
            "train.mini_batches": 2,
            "model.param_dtype": "bfloat16",
            "model.compute_dtype": "bfloat16",
            "model.master_dtype": "float32",
        },
        (False, False),
    ),
    # Two epochs: a proximal pass of its own. Rematerialisation "full": the critic's backbone, as the policy, adds
    # its layers' gradient into the accumulator in place.
    "ppo_two_epochs": (
        "ppo",
        {"train.shared_prefix": "off", "train.pack_sequences": False, "train.ppo_epochs": 2, "model.remat": "full"},
        (False, False),
    ),
}


class Compiles:
    """Backend compiles of programs named `name`, by the thread that ran them; `names`: every program compiled."""

    def __init__(self, name: str):
        self.name, self.threads, self.names = name, [], []

    def __call__(self, event: str, seconds: float, **kwargs) -> None:
        if event == COMPILE_EVENT:
            self.names.append(kwargs.get("fun_name"))
            if kwargs.get("fun_name") == self.name:
                self.threads.append(threading.current_thread().name)

    def __enter__(self) -> Compiles:
        jax.monitoring.register_event_duration_secs_listener(self)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self)


def _config(tmp_path, algorithm: str, overrides: dict):
    config = tiny_rl.get_config(algorithm)
    config.run_dir = str(tmp_path / "run")
    config.train.mini_batches = 1
    config.rollout.n_samples = 2
    config.checkpoint.every_steps = 0
    for path, value in overrides.items():
        section, *rest, key = path.split(".")
        node = config[section]
        for name in rest:
            node = node[name]
        node[key] = value
    return config


def _batch() -> tuple:
    """16 rollouts (8 prompts x 2) and their rewards."""
    rollouts = _rollouts(prompt_lengths=(30, 7, 19, 12, 3, 40, 22, 9), group=2, max_new=16, seed=5, vocab=61)
    return rollouts, np.random.default_rng(0).integers(0, 2, 16).astype(np.float32)


# Operations of the advantage estimators and the log-prob diagnostics: compiled one by one when those functions
# run op by op (about 2 s of a trainer's first step on a 2-core CPU), never when each runs as one program.
EAGER_OPERATIONS = {"jit(cumsum)", "jit(scatter-add)", "jit(sqrt)", "jit(select_n)", "jit(exp)", "jit(_where)"}


def _first_update(trainer: RLTrainer, step: int = 1) -> tuple[list[str], list[str], dict]:
    """`(threads that compiled the step from start on, threads that compiled it in the first update, metrics)`;
    checks that the batch's host-side JAX functions compiled as whole programs (`EAGER_OPERATIONS`)."""
    with Compiles(STEP) as compiles:
        trainer.start()
        trainer._wait_for_compile()
        ahead = list(compiles.threads)
        compiles.threads.clear()
        metrics = trainer.train(*_batch(), step=step, shuffle_seed=0)
    assert not EAGER_OPERATIONS & set(compiles.names), sorted(EAGER_OPERATIONS & set(compiles.names))
    return ahead, compiles.threads, metrics


@pytest.mark.parametrize("case", CASES)
def test_the_first_update_runs_the_train_step_compiled_in_the_background(tmp_path, case):
    algorithm, overrides, layout = CASES[case]
    config = _config(tmp_path, algorithm, overrides)
    trainer = RLTrainer(config)
    try:
        ahead, in_update, metrics = _first_update(trainer)
        expected = 2 if trainer.critic_step is not None else 1
        assert len(ahead) == expected and all(t.startswith("compile-update") for t in ahead), ahead
        assert in_update == [], "the first update compiled its train step again"
        assert trainer.train_step.trace_count == 1
        # The runs' AdamW keeps finite inputs finite: the steps choose the update before computing it.
        assert not any(s.check_updated for s in (trainer.train_step, trainer.critic_step) if s is not None)
        # Accumulating micro-batches, with rematerialisation "full" and every param trained in float32, the policy's
        # model and the critic's backbone add the layers' gradient into the accumulator in place.
        sinking = case in ("grpo_packed", "ppo_two_epochs")
        if case == "grpo_one_row_per_sample":
            assert trainer.model_config.resolved_remat() == "dots"
        assert trainer.train_step.sinks_layer_grads == sinking, case
        assert trainer.critic_step is None or trainer.critic_step.sinks_layer_grads == sinking, case
        expected_updates = config.train.ppo_epochs * config.train.mini_batches
        assert metrics["train/updates"] == expected_updates and np.isfinite(metrics["train/loss"])
        assert (trainer.shared_prefix, trainer.pack) == layout
        assert (trainer.reference is not None) == (algorithm == "grpo")
        assert bool(trainer.model_config.lora_rank) == (case == "grpo_lora")
    finally:
        trainer.close()


def test_a_resumed_run_compiles_ahead_too(tmp_path):
    config = _config(tmp_path, "grpo", {"train.shared_prefix": "off", "checkpoint.every_steps": 1})
    trainer = RLTrainer(config)
    try:
        trainer.start()
        trainer.train(*_batch(), step=1, shuffle_seed=0)
        assert trainer.save(1, np.zeros(2, np.uint32), None, force=True)
    finally:
        trainer.close()
    config.checkpoint.resume = True
    trainer = RLTrainer(config)
    try:
        ahead, in_update, _ = _first_update(trainer, step=2)
        assert trainer.policy_version == 2  # resumed at version 1, then one step
        assert len(ahead) == 1 and ahead[0].startswith("compile-update") and in_update == []
    finally:
        trainer.close()


def test_without_compile_ahead_the_first_update_compiles_its_train_step(tmp_path):
    """`train.compile_ahead=False`: nothing compiles in the background; the first update compiles the step."""
    trainer = RLTrainer(_config(tmp_path, "grpo", {"train.compile_ahead": False}))
    try:
        ahead, in_update, _ = _first_update(trainer)
        assert ahead == [] and in_update == ["MainThread"] and trainer.train_step.trace_count == 1
    finally:
        trainer.close()


def test_a_failed_compile_ahead_is_logged_and_the_first_update_compiles(tmp_path, monkeypatch, caplog):
    """Compiling ahead is a speed-up only: where it fails, the run goes on and compiles at the first update."""

    def fail(step, state, batch):
        raise RuntimeError("compile failed")

    monkeypatch.setattr(TrainStep, "compile", fail)
    trainer = RLTrainer(_config(tmp_path, "grpo", {}))
    try:
        with caplog.at_level("WARNING", logger="feynrl_jax"):
            ahead, in_update, metrics = _first_update(trainer)
        assert ahead == [] and in_update == ["MainThread"] and np.isfinite(metrics["train/loss"])
        assert "compiling the update ahead failed" in caplog.text and "compile failed" in caplog.text
        assert "perf/update_compiled_at" not in metrics  # a failed compile-ahead is not reported as one
    finally:
        trainer.close()


def test_placeholder_rollouts_have_the_engines_shapes_and_groups():
    rollouts = placeholder_rollouts(6, 3, 5, pad_id=7)
    assert rollouts.completion_ids.shape == rollouts.behavior_logprobs.shape == (6, 5)
    assert rollouts.completion_lengths.tolist() == [1] * 6 and rollouts.prompt_lengths.tolist() == [1] * 6
    assert rollouts.group_id.tolist() == [0, 0, 0, 1, 1, 1]
    assert (rollouts.prompt_ids == 7).all() and (rollouts.completion_ids == 7).all()
    for field in ("prompt_ids", "prompt_lengths", "completion_ids", "finish_reason", "group_id", "policy_version"):
        assert getattr(rollouts, field).dtype == np.int32, field
    assert rollouts.completion_mask.dtype == rollouts.behavior_logprobs.dtype == np.float32


def test_a_trainer_given_its_model_config_loads_the_tokenizer_only_when_it_needs_it(tmp_path, monkeypatch):
    """The RL driver hands its trainer the policy's `ModelConfig` (`TrainerActor`): the trainer then starts
    without loading the tokenizer (transformers' import), and loads it once, at its first use (evaluation)."""
    from feynrl_jax.train import run_setup

    config = _config(tmp_path, "grpo", {"train.compile_ahead": False})
    source = run_setup.resolve_model_source(config.model, config.run_dir)
    model_config = run_setup.model_config(config.model, source, run_setup.load_run_tokenizer(source))
    loads = []
    load = run_setup.load_run_tokenizer
    monkeypatch.setattr(run_setup, "load_run_tokenizer", lambda s: loads.append(s) or load(s))
    trainer = RLTrainer(config, model_config)
    try:
        assert trainer.model_config is model_config and loads == []
        assert trainer.tokenizer.decode(trainer.tokenizer.encode("two plus 3")) == "two plus 3"
        assert trainer.tokenizer is trainer.tokenizer and loads == [source]
    finally:
        trainer.close()
    # Without it, the trainer computes the same config from the tokenizer it loads.
    trainer = RLTrainer(config)
    try:
        assert trainer.model_config == model_config and len(loads) == 2
    finally:
        trainer.close()


def test_compile_after_holds_the_compile_ahead_and_the_first_update_reports_when_it_ended(tmp_path):
    """`RLTrainer(compile_after=...)` (a colocated engine's warm-up, `TrainerActor._after_warm_up`): the update's
    programs start compiling only once it returns True, still ahead, in the compile thread; the first update reports
    when the compile ended and how long it waited for it (once, not at later steps). Where it returns False (the
    trainer closing), nothing compiles ahead, the first update compiles the step itself and reports no compile."""
    opened = threading.Event()
    returned_at = []

    def gate() -> bool:
        opened.wait(60)
        returned_at.append(time.time())
        return True

    trainer = RLTrainer(_config(tmp_path / "held", "grpo", {}), compile_after=gate)
    ends = []

    def on_compile(event: str, seconds: float, **kwargs) -> None:
        if event == COMPILE_EVENT and kwargs.get("fun_name") == STEP:
            ends.append((time.time() - seconds, threading.current_thread().name))

    jax.monitoring.register_event_duration_secs_listener(on_compile)
    try:
        trainer.start()
        started = time.time()
        time.sleep(1.0)
        opened.set()
        first = trainer.train(*_batch(), step=1, shuffle_seed=0)
        later = trainer.train(*_batch(), step=2, shuffle_seed=1)
    finally:
        jax.monitoring.unregister_event_duration_listener(on_compile)
        trainer.close()
    assert len(ends) == 1 and ends[0][1].startswith("compile-update"), ends
    assert ends[0][0] >= returned_at[0] >= started + 1.0  # the backend compile began after the gate opened
    assert first["perf/update_compiled_at"] >= ends[0][0]  # when the compile ended (the driver: past start-up)
    assert 0.0 <= first["perf/update_compile_wait_seconds"] <= first["perf/train_update_seconds"]
    assert "perf/update_compiled_at" not in later and trainer.train_step.trace_count == 1

    closing = RLTrainer(_config(tmp_path / "closing", "grpo", {}), compile_after=lambda: False)
    try:
        ahead, in_update, metrics = _first_update(closing)
        assert ahead == [] and in_update == ["MainThread"] and np.isfinite(metrics["train/loss"])
        assert "perf/update_compiled_at" not in metrics  # nothing compiled ahead: nothing to report
    finally:
        closing.close()
