"""What the config validator needs to know about each algorithm, without importing JAX.

The registry of record is `feynrl_jax.losses.ALGORITHMS`; importing it imports JAX, which the command line must
not do before the config is validated (a typo must fail in well under a second). This table mirrors the few
properties validation needs; `tests/test_config_algorithms.py` fails when it disagrees with the registry, so
adding an algorithm means one file in `losses/`, one registry line and one row here.
"""

from __future__ import annotations

import dataclasses

PARADIGMS = ("sft", "dpo", "rl", "eval")
"""Values of the top-level `paradigm` key."""

GROUP_ADVANTAGES = ("group_zscore", "group_mean", "rloo")
"""Advantage estimators that compare the samples of one prompt with each other, so `rollout.n_samples >= 2`."""


@dataclasses.dataclass(frozen=True)
class AlgorithmTraits:
    """The properties of a registered algorithm that config validation checks against.

    Attributes:
        paradigm: "sft", "dpo" or "rl"; the config's `paradigm` must match.
        needs_reference: the loss uses reference-model log-probabilities (a KL term, or DPO's log-ratios).
        needs_critic: the algorithm trains a value head (PPO with GAE).
        advantage: the name of the advantage estimator in `feynrl_jax.losses.advantages`: one of
            `GROUP_ADVANTAGES`, "reinforce_pp" (batch-normalised returns), "gae" (PPO with a critic), or None for
            losses without advantages (SFT, DPO).
    """

    paradigm: str
    needs_reference: bool
    needs_critic: bool
    advantage: str | None

    @property
    def group_based(self) -> bool:
        """True when the advantage needs several samples of the same prompt."""
        return self.advantage in GROUP_ADVANTAGES


ALGORITHM_TRAITS: dict[str, AlgorithmTraits] = {
    "sft": AlgorithmTraits("sft", needs_reference=False, needs_critic=False, advantage=None),
    "dpo": AlgorithmTraits("dpo", needs_reference=True, needs_critic=False, advantage=None),
    "ipo": AlgorithmTraits("dpo", needs_reference=True, needs_critic=False, advantage=None),
    "ppo": AlgorithmTraits("rl", needs_reference=False, needs_critic=True, advantage="gae"),
    "grpo": AlgorithmTraits("rl", needs_reference=True, needs_critic=False, advantage="group_zscore"),
    "dr_grpo": AlgorithmTraits("rl", needs_reference=False, needs_critic=False, advantage="group_mean"),
    "dapo": AlgorithmTraits("rl", needs_reference=False, needs_critic=False, advantage="group_zscore"),
    "rloo": AlgorithmTraits("rl", needs_reference=False, needs_critic=False, advantage="rloo"),
    "reinforce_pp": AlgorithmTraits("rl", needs_reference=False, needs_critic=False, advantage="reinforce_pp"),
    "cispo": AlgorithmTraits("rl", needs_reference=False, needs_critic=False, advantage="group_zscore"),
    "p3o": AlgorithmTraits("rl", needs_reference=False, needs_critic=False, advantage="group_zscore"),
    "gspo": AlgorithmTraits("rl", needs_reference=False, needs_critic=False, advantage="group_zscore"),
}
