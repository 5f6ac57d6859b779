"""Attention over packed rows of short segments, in blocks: each query scores only the keys its mask can open.

A packed row of `T` columns whose segments are short wastes most of the dense `[T, T]` attention: a token sees
its own segment's earlier tokens and, in a continuation segment, the visible part of its root
(`feynrl_jax.models.segments`). In the shared-prefix layout of an RL update (`feynrl_jax.train.shared_prefix`) a
row holds a prompt of at most `W` tokens and `n` completions of at most `C` each: `T = W + n C` columns, of which
a token sees at most `W + C`. At `W = 64`, `C = 128`, `n = 8` the dense scores are 1,088 wide and cost about 30%
of a SmolLM2-135M forward and backward pass on a CPU; most of that is the softmax's elementwise work, which
grows with the square.

Given static `SegmentBounds` (no segment longer than `segment` columns, no continuation starting past
position `prefix`) on rows that keep the layout's rules (positions run on by one inside a segment, and no
segment id is used by two runs of a row: `SegmentBounds.check` checks all four on the host), the row is cut
into blocks of `Q >= segment - 1` columns (a multiple of 8), and a query in block `i` scores:
  * the `2Q` keys of blocks `i - 1` and `i`: its own segment starts at most `segment - 1` columns back, and a
    root segment that starts in these blocks lies there too;
  * the `P` keys (`prefix` rounded up to a multiple of 8) from the start of the root of block `i`'s first
    column (moved back to end at the row's end where it would pass it), when that root starts before block
    `i - 1`. No other root can start that early: the root of a later column in the block is the most recent
    segment starting at position 0 before it, so it is that one, or one starting after column `iQ`.
The mask over these `2Q + P` keys is the dense one restricted to them (the far window's keys inside blocks
`i - 1` and `i` are masked there, so that no key counts twice), and every key the dense mask opens is among
them. The softmax therefore sums the same non-zero terms: outputs equal the dense ones up to the order of
float32 sums, for every token with a segment. (Padding tokens get finite, ignored values that differ between
the two.)

The far window's keys are taken with one-hot matrix products rather than an index gather: dense arithmetic
that partitions along the batch like the rest of the layer (gathers inside the attention mask deadlocked
XLA's collectives with the batch sharded over 8 CPU devices, `feynrl_jax.models.segments`). One product picks
the `m = 1 + ceil((P - 1) / Q)` blocks the window lies in, a second its `P` columns among their `mQ`: about
`4 (m nb Q + P m Q) nb K Dh` FLOPs per layer for keys and values (`nb` blocks, `K` KV heads), 2% of the layer
at the sizes above; `SegmentBounds.blocked_pairs` counts them with the pairs.

References:
    Liu et al., "Prefix Grouper: Efficient GRPO Training through Shared-Prefix Forward", 2025
    (arXiv:2506.05433): the completions' attention split into their prefix's part and their own.
    Zaheer et al., "Big Bird: Transformers for Longer Sequences", 2020 (arXiv:2007.14062): blocked local
    attention with a few far blocks.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from feynrl_jax.models.attention import attend, within_window
from feynrl_jax.models.segments import segment_layout

_ALIGN = 8  # block sizes are rounded up to this many columns


@dataclasses.dataclass(frozen=True)
class SegmentBounds:
    """Static bounds on the segments of packed rows, which let attention skip what the mask hides.

    Attributes:
        segment: columns of the longest segment (a prompt, a completion, a packed sequence).
        prefix: the largest first position of a continuation segment: how many tokens of its root it sees.
    """

    segment: int
    prefix: int

    def __post_init__(self):
        if self.segment < 1 or self.prefix < 0:
            raise ValueError(f"SegmentBounds needs segment >= 1 and prefix >= 0, got {self}")

    @property
    def block(self) -> int:
        """`Q`: columns per block of queries."""
        return -(-max(self.segment - 1, 1) // _ALIGN) * _ALIGN

    @property
    def window(self) -> int:
        """`P`: columns of the far window (0 when no segment continues a prefix)."""
        return -(-self.prefix // _ALIGN) * _ALIGN

    @property
    def far_blocks(self) -> int:
        """`m`: the blocks a far window of `P` columns starting anywhere in a block lies in."""
        return 1 + -(-(self.window - 1) // self.block) if self.window else 0

    def blocked_pairs(self, width: int, kv_share: float = 1.0) -> int:
        """(query, key) pairs that attention scores in blocks over a row of `width` columns, plus the far windows'
        one-hot products in the same units (a pair costs `4 H Dh` FLOPs a layer, a selected key and value
        `4 K Dh`: `kv_share = K / H`)."""
        blocks = -(-width // self.block)
        pairs = blocks * self.block * (2 * self.block + self.window)
        m = min(blocks, self.far_blocks)
        selection = (m * blocks * self.block + self.window * m * self.block) * blocks if self.window else 0
        return pairs + round(kv_share * selection)

    def pays(self, width: int, kv_share: float = 1.0) -> bool:
        """Whether rows of `width` columns cost less in blocks than densely (`width ** 2` pairs)."""
        return self.blocked_pairs(width, kv_share) < width * width

    def check(self, positions: np.ndarray, segment_ids: np.ndarray) -> None:
        """Raises ValueError when host rows `[B, T]` break the bounds or the layout rules the blocks rely on
        (positions running on by one inside a segment, one run per segment id in a row), naming the row and the
        segment."""
        positions, segment_ids = np.asarray(positions), np.asarray(segment_ids)
        for row in range(segment_ids.shape[0]):
            ids = segment_ids[row]
            starts = np.flatnonzero(np.r_[True, ids[1:] != ids[:-1]])
            ends = np.r_[starts[1:], ids.shape[0]]
            seen: set[int] = set()
            for start, end in zip(starts, ends, strict=True):
                segment = int(ids[start])
                if segment == 0:
                    continue
                where = f"row {row}: segment {segment} at columns {start}..{end - 1}"
                first = int(positions[row, start])
                if end - start > self.segment or first > self.prefix:
                    raise ValueError(f"{where} (first position {first}) breaks the attention bounds {self}")
                if segment in seen:
                    raise ValueError(f"{where}: the id is used by an earlier run of the row")
                if np.any(positions[row, start:end] != first + np.arange(end - start)):
                    raise ValueError(f"{where}: positions do not run on by one")
                seen.add(segment)


@dataclasses.dataclass(frozen=True)
class FarWindow:
    """Selects each block's far window: `P` consecutive columns starting inside `m` consecutive blocks.

    Attributes:
        blocks: `[B, nb, m, nb]` bool, one-hot: the blocks the window lies in.
        columns: `[B, nb, P, m * Q]` bool, one-hot: the window's columns among theirs.
    """

    blocks: jax.Array
    columns: jax.Array

    def take_ints(self, x: jax.Array) -> jax.Array:
        """Integer `[B, nb, Q]` -> `[B, nb, P]`."""
        picked = jnp.sum(jnp.where(self.blocks[..., None], x[:, None, None], 0), axis=3)  # [B, nb, m, Q]
        picked = picked.reshape(*picked.shape[:2], -1)
        return jnp.sum(jnp.where(self.columns, picked[:, :, None, :], 0), axis=-1)

    def take(self, x: jax.Array) -> jax.Array:
        """Float `[B, nb, Q, K, Dh]` -> `[B, nb, P, K, Dh]`, by one-hot products (exact: one non-zero term each)."""
        exact = dict(precision=jax.lax.Precision.HIGHEST, preferred_element_type=x.dtype)
        picked = jnp.einsum("bnmj,bjqkd->bnmqkd", self.blocks.astype(x.dtype), x, **exact)
        picked = picked.reshape(*picked.shape[:2], -1, *picked.shape[4:])
        return jnp.einsum("bnpj,bnjkd->bnpkd", self.columns.astype(x.dtype), picked, **exact)


@dataclasses.dataclass(frozen=True)
class Blocks:
    """The block structure of one batch of packed rows, built once per forward pass and shared by every layer.

    Attributes:
        width: T, the rows' columns.
        block: Q, columns per block (the rows are padded to `blocks * Q`).
        far: the far windows' selectors (`FarWindow`; None when P = 0).
        mask: `[B * nb, Q, 2Q + P]` bool, True where a query may attend to a key.
        query_positions: `[B * nb, Q]` int32, for sliding windows.
        key_positions: `[B * nb, 2Q + P]` int32.
    """

    width: int
    block: int
    far: FarWindow | None
    mask: jax.Array
    query_positions: jax.Array
    key_positions: jax.Array


def _split(x: jax.Array, block: int) -> jax.Array:
    """`[B, nb * Q, ...]` -> `[B, nb, Q, ...]`."""
    return x.reshape(x.shape[0], -1, block, *x.shape[2:])


def _with_previous(x: jax.Array) -> jax.Array:
    """`[B, nb, Q, ...]` -> `[B, nb, 2Q, ...]`: each block behind the one before it (zeros before the first)."""
    before = jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], axis=1)
    return jnp.concatenate([before, x], axis=2)


def _pad(x: jax.Array, width: int) -> jax.Array:
    return jnp.pad(x, [(0, 0), (0, width - x.shape[1])] + [(0, 0)] * (x.ndim - 2))


def block_structure(positions: jax.Array, segment_ids: jax.Array, bounds: SegmentBounds) -> Blocks:
    """The masks and far-window selectors of rows `[B, T]` under `bounds` (which the rows must satisfy).

    Args:
        positions: `[B, T]` int32.
        segment_ids: `[B, T]` int32, 0 = padding.
        bounds: the rows' `SegmentBounds`.

    Returns:
        The `Blocks`.
    """
    b, t = segment_ids.shape
    q, p = bounds.block, bounds.window
    nb = -(-t // q)
    padded = nb * q
    positions, segment_ids = _pad(positions, padded), _pad(segment_ids, padded)
    layout = segment_layout(positions, segment_ids)
    columns = layout.columns
    keys = [
        _with_previous(_split(x, q)) for x in (segment_ids, columns, layout.run_start, positions)
    ]  # [B, nb, 2Q] each
    far = None
    if p:
        # The window [start, start + P) is cut from the `m` blocks from `first_block` on: one one-hot over the
        # blocks, then one over the m * Q columns (linear in the row, where one over all columns is quadratic).
        m = min(nb, bounds.far_blocks)
        first_root = _split(layout.root_index, q)[:, :, 0]  # [B, nb]
        start = jnp.clip(first_root, 0, padded - p)
        first_block = jnp.clip(start // q, 0, nb - m)
        offset = start - first_block * q  # offset + P <= m * Q
        blocks_sel = (first_block[:, :, None] + jnp.arange(m))[..., None] == jnp.arange(nb)  # [B, nb, m, nb]
        window_sel = (offset[:, :, None] + jnp.arange(p))[..., None] == jnp.arange(m * q)  # [B, nb, P, m * Q]
        far = FarWindow(blocks_sel, window_sel)
        far_columns = start[:, :, None] + jnp.arange(p, dtype=jnp.int32)  # [B, nb, P]
        local_start = (jnp.arange(nb, dtype=jnp.int32) - 1) * q  # the first column of block i - 1
        # Far keys inside blocks i - 1 and i are scored there; outside the root's run no key is visible anyway.
        far_ids = jnp.where(far_columns < local_start[None, :, None], far.take_ints(_split(segment_ids, q)), 0)
        far_keys = [far_ids, far_columns, *(far.take_ints(_split(x, q)) for x in (layout.run_start, positions))]
        keys = [jnp.concatenate([k, f], axis=2) for k, f in zip(keys, far_keys, strict=True)]
    key_ids, key_columns, key_run_start, key_positions = keys
    query_ids, query_columns = _split(segment_ids, q), _split(columns, q)
    root, start_position = _split(layout.root_index, q), _split(layout.start_position, q)
    causal = key_columns[..., None, :] <= query_columns[..., :, None]
    same = (query_ids[..., :, None] == key_ids[..., None, :]) & causal
    visible = (key_run_start[..., None, :] == root[..., :, None]) & (
        key_positions[..., None, :] < start_position[..., :, None]
    )
    mask = (key_ids[..., None, :] != 0) & (same | visible)
    return Blocks(
        width=t,
        block=q,
        far=far,
        mask=mask.reshape(b * nb, q, -1),
        query_positions=_split(positions, q).reshape(b * nb, q),
        key_positions=key_positions.reshape(b * nb, -1),
    )


def block_keys(x: jax.Array, blocks: Blocks) -> jax.Array:
    """Keys or values `[B, T, K, Dh]` arranged per block of queries: `[B * nb, 2Q + P, K, Dh]`.

    On a CPU they are widened to float32 (XLA:CPU widens a bfloat16 product's operands anyway): a key's gradient
    then adds the parts of its two or three slots in float32 and is rounded once, as the dense product's is. On an
    accelerator they keep their dtype, and in bfloat16 those parts are added in bfloat16. (With attention's products
    in oneDNN, `attend_in_blocks` narrows them back: each part is rounded to bfloat16, then they are added.)
    """
    b = x.shape[0]
    q = blocks.block
    x = _pad(x, blocks.mask.shape[0] // b * q)
    if jax.default_backend() == "cpu":
        x = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    split = _split(x, q)
    local = _with_previous(split)
    if blocks.far is not None:
        local = jnp.concatenate([local, blocks.far.take(split)], axis=2)
    return local.reshape(-1, *local.shape[2:])


def block_queries(x: jax.Array, blocks: Blocks) -> jax.Array:
    """Queries `[B, T, H, Dh]` as `[B * nb, Q, H, Dh]`."""
    q = blocks.block
    x = _pad(x, blocks.mask.shape[0] // x.shape[0] * q)
    return x.reshape(-1, q, *x.shape[2:])


def unblock(x: jax.Array, blocks: Blocks, batch: int) -> jax.Array:
    """`[B * nb, Q, ...]` back to `[B, T, ...]`."""
    return x.reshape(batch, -1, *x.shape[2:])[:, : blocks.width]


def attend_in_blocks(
    q: jax.Array, k: jax.Array, v: jax.Array, blocks: Blocks, window: jax.Array | None, use_onednn: bool = False
) -> jax.Array:
    """Packed attention in blocks of queries: `attention.attend` under `attention.packed_mask`, for every real token.

    Args:
        q: `[B, T, H, Dh]` queries (RoPE applied).
        k: `[B, T, K, Dh]` keys (RoPE applied).
        v: `[B, T, K, Dh]` values.
        blocks: the rows' `Blocks` (`block_structure`).
        window: scalar int32 sliding window (`attention.within_window`), or None.
        use_onednn: the products in oneDNN (`attention.attend`).

    Returns:
        `[B, T, H, Dh]` in the dtype of `q`.
    """
    mask = blocks.mask
    if window is not None:
        mask = mask & within_window(blocks.query_positions, window, blocks.key_positions)
    keys, values = block_keys(k, blocks), block_keys(v, blocks)
    if use_onednn:  # oneDNN multiplies operands of one dtype: back to k's dtype (exact, they hold its values); each
        # slot's key gradient is then rounded to it before the slots' parts are added
        keys, values = keys.astype(k.dtype), values.astype(v.dtype)
    out = attend(block_queries(q, blocks), keys.transpose(0, 2, 3, 1), values.transpose(0, 2, 1, 3), mask, use_onednn)
    return unblock(out, blocks, q.shape[0])
