"""Group rollouts laid out one prompt per row, its `n` completions sharing it (the shared-prefix layout).

GRPO-style sampling draws `n` completions of every prompt. The row layout (`rl_batch.rollouts_to_batch`) writes
the prompt into each of the `n` rows, so the forward and backward passes run every prompt `n` times. Here a
group is one row: the prompt once, right-aligned to column `prompt_width`, then the completions one after the
other, each its own segment whose positions go on from the prompt (`feynrl_jax.models.segments`):

    column  0 .. W-p-1 | W-p .. W-1 | W .. W+c1-1  | W+c1 .. W+c1+c2-1 | ...    (W = prompt_width)
    segment      0     |     1      |      2       |         3         | ...
    tokens      pad    |   prompt   | completion 1 |    completion 2   | ...

Every completion token then starts at or after column `W`, so the output projection skips the prompts
(`sequence_logprobs(first_column=W)`). Log-probabilities, values and gradients equal the row layout's (the
models' tests check both); per-token arrays move between the two layouts with `pack` and `unpack`.

Whether it pays is a matter of shapes: the shared layout runs `W + n * C` tokens per group instead of
`n * T`, but its attention is quadratic in the longer row. `cheaper_than_rows` compares the two costs.

References:
    Liu et al., "Prefix Grouper: Efficient GRPO Training through Shared-Prefix Forward", 2025
    (arXiv:2506.05433).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from feynrl_jax.models import ModelConfig, SegmentBounds
from feynrl_jax.rollout.types import Rollouts


@dataclasses.dataclass(frozen=True)
class SharedPrefixRows:
    """Rollouts of `G` groups in the shared-prefix layout, and the map back to the row layout.

    Attributes:
        tokens: `[G, L]` int32.
        positions: `[G, L]` int32 (a completion's positions go on from its prompt's length).
        segment_ids: `[G, L]` int32: 0 padding, 1 the prompt, `k + 2` the group's completion `k`.
        sample_row: `[G, L]` int: the rollout row a completion token belongs to, -1 on prompts and padding.
        sample_column: `[G, L]` int: that token's column in the row layout (`prompt length + j`), -1 elsewhere.
        prompt_width: W, the column every completion starts at or after.
        num_samples: N, the rollout rows.
    """

    tokens: np.ndarray
    positions: np.ndarray
    segment_ids: np.ndarray
    sample_row: np.ndarray
    sample_column: np.ndarray
    prompt_width: int
    num_samples: int

    def pack(self, values: np.ndarray) -> np.ndarray:
        """A row-layout per-token array `[N, T]` to the shared layout `[G, L]` (completion tokens; 0 elsewhere)."""
        valid = self.sample_row >= 0
        out = np.zeros(self.tokens.shape, np.float32)
        out[valid] = values[self.sample_row[valid], self.sample_column[valid]]
        return out

    def unpack(self, values: np.ndarray, seq_len: int) -> np.ndarray:
        """A shared-layout per-token array `[G, L]` to the row layout `[N, seq_len]` (0 off completion tokens)."""
        valid = self.sample_row >= 0
        out = np.zeros((self.num_samples, seq_len), np.float32)
        out[self.sample_row[valid], self.sample_column[valid]] = values[valid]
        return out


def group_rows(group_id: np.ndarray) -> list[np.ndarray]:
    """The rollout rows of every group, in order; a group's rows must be consecutive.

    Raises:
        ValueError: when a group's rows are not consecutive.
    """
    starts = np.flatnonzero(np.r_[True, group_id[1:] != group_id[:-1]])
    groups = np.split(np.arange(group_id.shape[0]), starts[1:])
    if len({int(group_id[g[0]]) for g in groups}) != len(groups):
        raise ValueError("rollout groups are not consecutive: a group id appears in two separate runs of rows")
    return groups


def shared_prefix_rows(
    rollouts: Rollouts, *, prompt_width: int, completion_width: int, pad_id: int
) -> SharedPrefixRows:
    """Lays rollouts out one group per row.

    Args:
        rollouts: sampled completions; the rows of a group are consecutive and share one prompt.
        prompt_width: W; every prompt must fit in it.
        completion_width: columns after W for a group's completions (`n * max_new_tokens` always fits).
        pad_id: the token id written on padding.

    Returns:
        The `SharedPrefixRows` (`[G, W + completion_width]` arrays).

    Raises:
        ValueError: naming the row whose prompt differs from its group's, is longer than W, or whose group's
            completions overflow `completion_width`.
    """
    groups = group_rows(np.asarray(rollouts.group_id))
    width = prompt_width + completion_width
    shape = (len(groups), width)
    tokens = np.full(shape, pad_id, np.int32)
    positions = np.zeros(shape, np.int32)
    segment_ids = np.zeros(shape, np.int32)
    sample_row = np.full(shape, -1, np.int64)
    sample_column = np.full(shape, -1, np.int64)
    for g, rows in enumerate(groups):
        first = int(rows[0])
        p = int(rollouts.prompt_lengths[first])
        prompt = rollouts.prompt_ids[first, :p]
        if p > prompt_width:
            raise ValueError(
                f"rollout row {first}: prompt of {p} tokens is longer than the prompt width {prompt_width}"
            )
        for row in rows[1:]:
            same = int(rollouts.prompt_lengths[row]) == p and np.array_equal(rollouts.prompt_ids[row, :p], prompt)
            if not same:
                raise ValueError(f"rollout row {int(row)}: its prompt differs from row {first}'s, in the same group")
        tokens[g, prompt_width - p : prompt_width] = prompt
        positions[g, prompt_width - p : prompt_width] = np.arange(p)
        segment_ids[g, prompt_width - p : prompt_width] = 1
        column = prompt_width
        for k, row in enumerate(rows):
            c = int(rollouts.completion_lengths[row])
            if column + c > width:
                raise ValueError(
                    f"rollout row {int(row)}: group {g}'s completions need more than {completion_width} columns"
                )
            span = slice(column, column + c)
            tokens[g, span] = rollouts.completion_ids[row, :c]
            positions[g, span] = p + np.arange(c)
            segment_ids[g, span] = k + 2
            sample_row[g, span] = row
            sample_column[g, span] = p + np.arange(c)
            column += c
    return SharedPrefixRows(
        tokens, positions, segment_ids, sample_row, sample_column, prompt_width, int(rollouts.group_id.shape[0])
    )


def shared_bounds(prompt_width: int, max_new_tokens: int) -> SegmentBounds:
    """The `SegmentBounds` of the shared layout: prompts of at most `prompt_width` tokens (W), each seen whole by
    its completions, and completions of at most `max_new_tokens`."""
    return SegmentBounds(segment=max(prompt_width, max_new_tokens), prefix=prompt_width)


def cheaper_than_rows(
    config: ModelConfig, *, group_size: int, seq_len: int, prompt_width: int, completion_width: int
) -> bool:
    """Whether a group's forward and backward cost fewer FLOPs in the shared layout than as `group_size` rows.

    Per token: two FLOPs per weight of the layers and the output projection (forward; the backward scales both
    sides alike). Attention: `4 * L * H * Dh` FLOPs per (query, key) pair that the kernels compute: the whole
    square of a row, or the blocks of `models.block_attention` where those are fewer (the shared row's segments
    span at most `max(prompt_width, completion_width / group_size)` columns).
    """
    c = config
    per_token = 2 * (
        c.num_layers
        * (
            c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
            + c.num_heads * c.head_dim * c.hidden_size
            + 3 * c.hidden_size * c.intermediate_size
        )
        + c.hidden_size * c.vocab_size
    )
    per_pair = 4 * c.num_layers * c.num_heads * c.head_dim
    rows = group_size * (seq_len * per_token + seq_len**2 * per_pair)
    shared_len = prompt_width + completion_width
    bounds = shared_bounds(prompt_width, completion_width // group_size)
    pairs = min(shared_len**2, bounds.blocked_pairs(shared_len, c.num_kv_heads / c.num_heads))
    shared = shared_len * per_token + pairs * per_pair
    return shared < rows
