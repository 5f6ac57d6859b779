"""The training batch every loss reads, and the checks that give bad input a clear error.

Token alignment (docs/CONTRACTS.md): every per-token array is aligned with ``tokens``; ``logprobs[b, t]`` is
``log p(tokens[b, t] | tokens[b, :t])``; the first token of every row and of every packed segment has no
prediction, holds 0 and has ``loss_mask`` 0 (a shared-prefix continuation's first token is predicted from its
prefix: ``feynrl_jax.models.segments``). A loss only reads positions where ``loss_mask`` is 1.
"""

from __future__ import annotations

import dataclasses

import jax

_PER_TOKEN_FIELDS = (
    "tokens",
    "positions",
    "segment_ids",
    "loss_mask",
    "advantages",
    "old_logprobs",
    "ref_logprobs",
    "behavior_logprobs",
    "values",
    "returns",
)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainBatch:
    """One (micro-)batch of token rows, a frozen pytree.

    Attributes:
        tokens: [B, T] int32 token ids.
        positions: [B, T] int32 positions, restarting at 0 in every packed segment.
        segment_ids: [B, T] int32; 0 marks padding, each packed sequence has its own non-zero id.
        loss_mask: [B, T] f32; 1 on the tokens the loss reads (completion tokens), 0 elsewhere.
        advantages: [B, T] f32 per-token advantages (sequence advantages broadcast over the completion).
        old_logprobs: [B, T] f32 log-probabilities under the policy the ratio is taken against (the policy
            that generated the batch, or the proximal policy of the decoupled objective).
        ref_logprobs: [B, T] f32 log-probabilities under the reference model, or None.
        behavior_logprobs: [B, T] f32 log-probabilities under the exact sampling distribution of the rollout
            engine (the behaviour policy), or None.
        values: [B, T] f32 critic values at rollout time (the "old" values), or None.
        returns: [B, T] f32 value targets, or None.

    DPO batches interleave pairs: sequence ``2i`` is the chosen response and ``2i + 1`` the rejected one.
    Unpacked, a sequence is a row; packed, sequences are counted in row-major order by segment.
    """

    tokens: jax.Array
    positions: jax.Array
    segment_ids: jax.Array
    loss_mask: jax.Array
    advantages: jax.Array
    old_logprobs: jax.Array
    ref_logprobs: jax.Array | None = None
    behavior_logprobs: jax.Array | None = None
    values: jax.Array | None = None
    returns: jax.Array | None = None


def check_inputs(loss_name: str, logprobs: jax.Array, batch: TrainBatch, *, required: tuple[str, ...] = ()) -> None:
    """Checks shapes (static, so this costs nothing under jit) and the presence of optional fields.

    Args:
        loss_name: name of the calling loss, used in error messages.
        logprobs: [B, T] current-policy log-probabilities.
        batch: the batch.
        required: optional fields of ``batch`` the caller needs (e.g. ``("ref_logprobs",)``).

    Raises:
        ValueError: naming the field whose shape differs from ``tokens`` or that is missing.
    """
    shape = batch.tokens.shape
    if len(shape) != 2:
        raise ValueError(f"{loss_name}: batch.tokens must be [B, T], got shape {shape}")
    if logprobs.shape != shape:
        raise ValueError(f"{loss_name}: logprobs has shape {logprobs.shape}, expected {shape} like batch.tokens")
    for name in _PER_TOKEN_FIELDS:
        value = getattr(batch, name)
        if value is not None and value.shape != shape:
            raise ValueError(f"{loss_name}: batch.{name} has shape {value.shape}, expected {shape} like batch.tokens")
    for name in required:
        if getattr(batch, name) is None:
            raise ValueError(f"{loss_name}: batch.{name} is required but is None")


def check_per_token(loss_name: str, name: str, value: jax.Array | None, shape: tuple[int, ...]) -> jax.Array:
    """Returns ``value`` after checking it is present and has the batch's ``[B, T]`` shape.

    Raises:
        ValueError: naming ``name`` when it is None or mis-shaped.
    """
    if value is None:
        raise ValueError(f"{loss_name}: `{name}` is required but is None")
    if value.shape != shape:
        raise ValueError(f"{loss_name}: `{name}` has shape {value.shape}, expected {shape} like batch.tokens")
    return value
