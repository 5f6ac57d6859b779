"""The algorithm registry: one frozen record per algorithm, one line each.

An :class:`Algorithm` names its loss, its advantage estimator and which extra models the loop must run.
``hyperparameters`` lists every keyword of the loss with this algorithm's default (read from the loss
signature, then overridden per entry), so a config can be checked against it key by key.

Advantage estimators (see :mod:`advantages`): sequence-level ones take ``(rewards [N], group_id [N],
completion_mask [N, C])``; ``gae`` (algorithms with ``needs_critic``) takes per-token rewards, values, mask and
``done``. SFT and DPO have no advantage estimator.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any

from feynrl_jax.losses import advantages
from feynrl_jax.losses.cispo import cispo_loss
from feynrl_jax.losses.dpo import dpo_loss, ipo_loss
from feynrl_jax.losses.grpo import grpo_loss
from feynrl_jax.losses.gspo import gspo_loss
from feynrl_jax.losses.p3o import p3o_loss
from feynrl_jax.losses.ppo import ppo_loss
from feynrl_jax.losses.sft import sft_loss

_PARADIGMS = ("sft", "dpo", "rl")
_INPUT_KEYWORDS = ("entropy", "values")


@dataclasses.dataclass(frozen=True, eq=False)
class Algorithm:
    """A registered algorithm (hashable by identity, so usable as a static jit argument).

    Attributes:
        name: registry key.
        loss_fn: ``loss(logprobs, batch, *, entropy=None, values=None, **hyperparameters)``.
        advantage_fn: advantage estimator, or None (SFT, DPO).
        needs_reference: the loop must fill ``batch.ref_logprobs``.
        needs_critic: the loop must run a critic (``values`` argument, ``batch.values``/``returns``).
        uses_entropy: the loss reads the ``entropy`` argument.
        hyperparameters: every loss keyword with its default for this algorithm.
        paradigm: "sft", "dpo" or "rl".
    """

    name: str
    loss_fn: Callable[..., Any]
    advantage_fn: Callable[..., Any] | None
    needs_reference: bool
    needs_critic: bool
    uses_entropy: bool
    hyperparameters: dict[str, Any]
    paradigm: str

    def make_loss(self, **overrides: Any) -> Callable[..., Any]:
        """The loss with this algorithm's defaults bound, updated by ``overrides``.

        Raises:
            ValueError: naming an override that is not a hyperparameter of this algorithm.
        """
        unknown = sorted(set(overrides) - set(self.hyperparameters))
        if unknown:
            raise ValueError(
                f"algorithm {self.name!r} has no hyperparameter(s) {unknown}; known: {sorted(self.hyperparameters)}"
            )
        return functools.partial(self.loss_fn, **{**self.hyperparameters, **overrides})


def _algorithm(
    name: str,
    loss_fn: Callable[..., Any],
    advantage_fn: Callable[..., Any] | None,
    *,
    paradigm: str,
    needs_reference: bool = False,
    needs_critic: bool = False,
    uses_entropy: bool = False,
    **overrides: Any,
) -> Algorithm:
    """Builds a record whose hyperparameters are ``loss_fn``'s keyword defaults updated by ``overrides``."""
    if paradigm not in _PARADIGMS:
        raise ValueError(f"algorithm {name!r}: paradigm must be one of {_PARADIGMS}, got {paradigm!r}")
    signature = inspect.signature(loss_fn)
    defaults = {
        key: p.default
        for key, p in signature.parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY and key not in _INPUT_KEYWORDS
    }
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise ValueError(f"algorithm {name!r}: {loss_fn.__name__} has no keyword(s) {unknown}")
    return Algorithm(
        name=name,
        loss_fn=loss_fn,
        advantage_fn=advantage_fn,
        needs_reference=needs_reference,
        needs_critic=needs_critic,
        uses_entropy=uses_entropy,
        hyperparameters={**defaults, **overrides},
        paradigm=paradigm,
    )


# Dr. GRPO's constant normaliser: the maximum generation length; override it with the run's max_new_tokens.
_DEFAULT_MAX_TOKENS = 1024.0

ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        _algorithm("sft", sft_loss, None, paradigm="sft"),
        _algorithm("dpo", dpo_loss, None, paradigm="dpo", needs_reference=True),
        _algorithm("ipo", ipo_loss, None, paradigm="dpo", needs_reference=True),
        _algorithm(
            "ppo", ppo_loss, advantages.gae, paradigm="rl", needs_critic=True, uses_entropy=True, entropy_coef=1e-3
        ),
        _algorithm("grpo", grpo_loss, advantages.group_zscore, paradigm="rl", needs_reference=True),
        _algorithm(
            "dr_grpo",
            grpo_loss,
            advantages.group_mean,
            paradigm="rl",
            kl_coef=0.0,
            loss_agg="seq_mean_token_sum",
            max_tokens=_DEFAULT_MAX_TOKENS,
        ),
        _algorithm(
            "dapo",
            grpo_loss,
            advantages.group_zscore,
            paradigm="rl",
            clip_high=0.28,
            kl_coef=0.0,
            loss_agg="token_mean",
        ),
        _algorithm("rloo", grpo_loss, advantages.rloo, paradigm="rl", kl_coef=0.0, loss_agg="token_mean"),
        _algorithm(
            "reinforce_pp", grpo_loss, advantages.reinforce_pp, paradigm="rl", kl_coef=0.0, loss_agg="token_mean"
        ),
        _algorithm("cispo", cispo_loss, advantages.group_zscore, paradigm="rl"),
        _algorithm("p3o", p3o_loss, advantages.group_zscore, paradigm="rl"),
        _algorithm("gspo", gspo_loss, advantages.group_zscore, paradigm="rl"),
    )
}
