"""Values computed from a config, computed here and nowhere else.

The loops call these at the edge and pass plain numbers and dicts inward; nothing below the loops sees the
config object. Both functions assume `validate(config)` passed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ml_collections import ConfigDict

from feynrl_jax.config.errors import ConfigError, Problem, suggestion

# Shared hyperparameters that live directly under `algo` (None there means "the algorithm's default").
SHARED_HYPERPARAMETERS = ("kl_coef", "clip_low", "clip_high", "loss_agg")


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """How one optimizer phase splits its sequences.

    Attributes:
        global_batch_size: sequences per phase over all devices (RL: completions).
        mini_batches: optimizer updates per pass over the phase's batch.
        mini_batch_size: sequences per optimizer update.
        micro_batch_size: sequences per forward/backward pass.
        grad_accum_steps: micro-batches accumulated into one update (`mini_batch_size / micro_batch_size`).
        prompts_per_step: RL prompts sampled per phase (`global_batch_size / n_samples`); for SFT and DPO,
            the examples (pairs for DPO) per phase.
    """

    global_batch_size: int
    mini_batches: int
    mini_batch_size: int
    micro_batch_size: int
    grad_accum_steps: int
    prompts_per_step: int


def batch_plan(config: ConfigDict) -> BatchPlan:
    """The batch arithmetic of `config.train` (and `config.rollout.n_samples` for RL)."""
    train = config.train
    mini = train.global_batch_size // train.mini_batches
    micro = train.micro_batch_size or mini
    group = config.rollout.n_samples if config.paradigm == "rl" else 1
    return BatchPlan(
        global_batch_size=train.global_batch_size,
        mini_batches=train.mini_batches,
        mini_batch_size=mini,
        micro_batch_size=micro,
        grad_accum_steps=mini // micro,
        prompts_per_step=train.global_batch_size // group,
    )


def algorithm_hyperparameters(config: ConfigDict, accepted: Mapping[str, Any]) -> dict[str, Any]:
    """The keyword arguments for the algorithm's loss, from `config.algo`.

    Args:
        config: the run's config.
        accepted: the algorithm's hyperparameters and their defaults, i.e.
            `feynrl_jax.losses.get_algorithm(config.algo.name).hyperparameters`.

    Returns:
        `accepted` updated with every shared key of `config.algo` that is set (not None) and every entry of
        `config.algo.hparams`.

    Raises:
        ConfigError: naming `algo.hparams.<key>` (with the closest accepted name) for a hyperparameter the
            algorithm does not take, or `algo.<key>` for a shared one set for an algorithm that ignores it
            (`algo.kl_coef=0` excepted: a loss without a KL term does what it asks).
    """
    values = dict(accepted)
    problems = []
    name = config.algo.name
    for key in SHARED_HYPERPARAMETERS:
        value = config.algo[key]
        if value is None or (key == "kl_coef" and value == 0 and key not in accepted):
            continue
        if key not in accepted:
            problems.append(Problem(f"algo.{key}", f"algo.{key}={value!r} is set but {name} takes no {key}."))
        values[key] = value
    for key, value in config.algo.hparams.items():
        if key not in accepted:
            problems.append(
                Problem(
                    f"algo.hparams.{key}",
                    f"algo.hparams.{key} is not a hyperparameter of "
                    f"{name}{suggestion(key, accepted)}; it takes {', '.join(sorted(accepted))}.",
                )
            )
        values[key] = value.to_dict() if isinstance(value, ConfigDict) else value
    if problems:
        raise ConfigError(problems)
    return values


def off_policy_problem(config: ConfigDict, accepted: Mapping[str, Any]) -> Problem | None:
    """Why an RL run cannot correct its off-policy gap with this loss, or None.

    The correction (`effective_off_policy`: async runs, and sync vLLM runs that recompute pi_old) happens inside
    the loss, through its `decoupled` and `tis_cap` keywords; a loss of your own without them trains on-policy
    samples only.
    """
    mode = effective_off_policy(config)
    if mode == "none" or {"decoupled", "tis_cap"} <= set(accepted):
        return None
    return Problem(
        "algo.off_policy",
        f"the off-policy correction is {mode!r} (algo.off_policy, or its default for this run) but the loss of "
        f"{config.algo.name} takes no `decoupled` and `tis_cap` keywords; give it them (see losses/grpo.py) or set "
        "algo.off_policy='none'.",
    )


def effective_off_policy(config: ConfigDict) -> str:
    """`algo.off_policy`, or its default.

    Async runs: "decoupled" (AReaL's recipe). Sync runs: "tis" with vLLM, whose log-probabilities differ from the
    trainer's (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"), when the
    trainer recomputes pi_old (the weight needs it); "none" otherwise.
    """
    if config.algo.off_policy is not None:
        return config.algo.off_policy
    if config.train.max_staleness > 0:
        return "decoupled"
    if config.rollout.engine == "vllm" and config.train.recompute_old_logprobs:
        return "tis"
    return "none"


def checkpoint_every(config: ConfigDict) -> int:
    """Steps between checkpoints: `checkpoint.every_steps`, or `train.steps` (only at the end) when it is 0."""
    return config.checkpoint.every_steps or config.train.steps
