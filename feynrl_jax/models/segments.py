"""The structure of a packed row: segments, and segments that continue a shared prefix.

A row holds segments (maximal runs of one non-zero `segment_ids` value; 0 is padding). An ordinary segment starts
at position 0 and sees only itself. A segment whose first position is `p > 0` is a *continuation*: it extends
the first `p` tokens of the row's most recent segment that starts at position 0 (its *root*), as if those tokens
were written in front of it. This is the shared-prefix layout of group sampling (GRPO and relatives), where the
`n` completions of one prompt share that prompt:

    columns    pad  pad  p0  p1  p2 | c1_0 c1_1 c1_2 | c2_0 c2_1 | c3_0 ...
    segment     0    0   1   1   1  |  2    2    2   |  3    3   |  4   ...
    position    -    -   0   1   2  |  3    4    5   |  3    4   |  3   ...

Completion `k` attends to the prompt and to its own earlier tokens, never to a sibling; its first token is
predicted from the prompt's last token. The forward and backward passes then run the prompt once per group
instead of once per sample, and the gradient is exactly that of the unpacked rows: the prompt's keys and values
receive the sum of what every completion sends back through attention.

References:
    Liu et al., "Prefix Grouper: Efficient GRPO Training through Shared-Prefix Forward", 2025
    (arXiv:2506.05433): the same computation, with the prompt's attention split from the completions'.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SegmentLayout:
    """Per-token structure of packed rows (all `[B, T]`).

    Built from cumulative maxima and comparisons only, never index gathers of `segment_ids`: with the batch
    sharded over 8 CPU devices, such gathers inside the attention mask deadlocked XLA's collectives. Positions
    must run on by one inside a segment.

    Attributes:
        columns: int32, each token's column.
        first: bool, the token starts a run of equal segment ids.
        run_start: int32, the column where the token's run starts.
        start_position: int32, the position of the first token of the token's segment (0 for an ordinary one).
        root_index: int32, the column where the token's root segment starts (the row's most recent segment
            starting at position 0), or -1 when there is none before it.
    """

    columns: jax.Array
    first: jax.Array
    run_start: jax.Array
    start_position: jax.Array
    root_index: jax.Array


def segment_layout(positions: jax.Array, segment_ids: jax.Array) -> SegmentLayout:
    """Finds every token's run, segment start position and root.

    Args:
        positions: `[B, T]` int32.
        segment_ids: `[B, T]` int32, 0 = padding.

    Returns:
        The `SegmentLayout`.
    """
    t = segment_ids.shape[1]
    columns = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), segment_ids.shape)
    first = jnp.concatenate(
        [jnp.ones_like(segment_ids[:, :1], bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
    )
    run_start = jax.lax.cummax(jnp.where(first, columns, 0), axis=1)
    start_position = positions - (columns - run_start)
    is_root = first & (segment_ids != 0) & (positions == 0)
    root_index = jax.lax.cummax(jnp.where(is_root, columns, -1), axis=1)
    return SegmentLayout(columns, first, run_start, start_position, root_index)


def prefix_visible(positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """`[B, T, T]` bool: query `t` (axis 1) may see key `s` (axis 2) as part of its shared prefix.

    True where `t` is in a continuation segment starting at position `p`, and `s` is a token of `t`'s root
    segment with position `< p`. The caller adds the ordinary rules (same segment, causal, window).
    """
    layout = segment_layout(positions, segment_ids)
    in_root = layout.run_start[:, None, :] == layout.root_index[:, :, None]
    before = positions[:, None, :] < layout.start_position[:, :, None]
    return in_root & before & (segment_ids[:, None, :] != 0)


def predecessor_index(positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """`[B, T]` int32: the column whose hidden state predicts each token, or -1 when nothing does.

    Inside a segment that is the previous column. The first token of a continuation starting at position `p`
    is predicted by its root's token at position `p - 1`. The first token of an ordinary segment, padding and
    a continuation whose root does not hold position `p - 1` get -1. (Its gathers read only the inputs: the
    sharded tests deadlocked when they read `SegmentLayout.run_start` instead.)
    """
    t = segment_ids.shape[1]
    layout = segment_layout(positions, segment_ids)
    inside = ~layout.first & (segment_ids != 0)
    candidate = layout.root_index + positions - 1
    safe = jnp.clip(candidate, 0, t - 1)
    root_segment = jnp.take_along_axis(segment_ids, jnp.maximum(layout.root_index, 0), axis=1)
    holds = (
        (layout.root_index >= 0)
        & (candidate < layout.columns)
        & (jnp.take_along_axis(segment_ids, safe, axis=1) == root_segment)
        & (jnp.take_along_axis(positions, safe, axis=1) == positions - 1)
    )
    continues = layout.first & (segment_ids != 0) & (positions > 0) & holds
    return jnp.where(inside, layout.columns - 1, jnp.where(continues, candidate, -1)).astype(jnp.int32)
