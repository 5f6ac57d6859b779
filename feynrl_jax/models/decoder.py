"""The decoder: pure functions over a params dict, layers stacked on axis 0 and run with `lax.scan` (or per layer).

One pre-norm block per layer (Llama, Qwen2, Qwen3, Mistral, SmolLM2 all share it):

    x = x + o_proj(attention(rope(q_norm(q_proj(attn_norm(x)))), rope(k_norm(k_proj(...))), v_proj(...)))
    x = x + down_proj(silu(gate_proj(mlp_norm(x))) * up_proj(mlp_norm(x)))

Params pytree (the table in docs/CONTRACTS.md; `L` layers stacked on axis 0):

    embed/embedding [V, D]             layers/attn_norm/scale [L, D]     layers/mlp_norm/scale [L, D]
    layers/q_proj/kernel [L, D, H, Dh] layers/k_proj/kernel, v_proj/kernel [L, D, K, Dh]
    layers/{q,k,v}_proj/bias [L, H|K, Dh] (attention_bias)   layers/o_proj/bias [L, D] (attention_bias, not qwen2)
    layers/q_norm/scale, k_norm/scale [L, Dh] (qk_norm)      layers/o_proj/kernel [L, H, Dh, D]
    layers/gate_proj/kernel, up_proj/kernel [L, D, F]        layers/down_proj/kernel [L, F, D]
    final_norm/scale [D]               lm_head/kernel [D, V] (untied only)

Scanning the layers keeps compile time flat in depth; decoding instead runs per-layer params (`unstack_layers`)
in a Python loop, which spares every layer the copy of its slice of the stacked weights and cache. Parameters
stored in another dtype than `param_dtype` (the float32 master weights of a bfloat16 model) are first rounded to
`param_dtype` (`as_param_dtype`), then cast to `compute_dtype` where used; RMSNorm statistics, the attention
softmax and the logits are float32 (docs/DTYPES.md).

References:
    Touvron et al., "LLaMA", 2023 (arXiv:2302.13971); Zhang & Sennrich, "Root Mean Square Layer
    Normalization", 2019 (arXiv:1910.07467); Shazeer, "GLU Variants Improve Transformer", 2020
    (arXiv:2002.05202).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from feynrl_jax.kernels import onednn
from feynrl_jax.models import block_attention, lora, quant
from feynrl_jax.models.attention import attend, cache_mask, packed_mask, round_to, within_window
from feynrl_jax.models.config import LORA_TARGETS, ModelConfig
from feynrl_jax.models.rope import apply_rope, rope_cos_sin

Params = dict

_NO_WINDOW = 2**30


@functools.partial(jax.tree_util.register_dataclass, data_fields=["k", "v"], meta_fields=[])
@dataclasses.dataclass(frozen=True)
class KVCache:
    """Keys and values of every layer, indexed by position.

    Stacked (the arrays below) or per layer (`unstack`: `k` and `v` tuples of `L` arrays without the layer axis,
    the native engine's decode layout); `forward` takes and returns either.

    Attributes:
        k: `[L, B, K, Dh, S]` keys (RoPE applied) in `cache_dtype`, stored transposed: entry `[l, b, :, :, p]`
            holds position `p` of row b. Decode attention then multiplies each head's query by a plain `[Dh, S]`
            matrix, which XLA:CPU runs about 2x faster than against `[S, Dh]`.
        v: `[L, B, K, S, Dh]` values; entry `[l, b, :, p]` holds position `p`.
    """

    k: jax.Array
    v: jax.Array

    def unstack(self) -> KVCache:
        """The same cache with `k` and `v` as tuples of `L` per-layer arrays (`forward` with per-layer params
        updates those in place, where slicing a stacked cache copies each layer's slice)."""
        return KVCache(k=tuple(self.k), v=tuple(self.v))

    def stack(self) -> KVCache:
        """The inverse of `unstack`: `k` and `v` stacked on axis 0 again."""
        return KVCache(k=jnp.stack(self.k), v=jnp.stack(self.v))


def cache_dtype(config: ModelConfig) -> jnp.dtype:
    """The KV cache's dtype: the compute dtype, except float32 for a bfloat16 model when JAX runs on a CPU and a
    decode step's products run on XLA (`model.cpu_matmul`, `onednn.use_onednn` for one token per row).

    XLA:CPU computes a bfloat16 dot by widening both operands to float32, so decode attention against a bfloat16
    cache converted the whole cache at every step: a third of a SmolLM2-135M bfloat16 decode step (32 rows, 192
    positions, 2-core EPYC). A float32 cache holds the same keys and values (each is rounded to bfloat16 before it
    is written) and `attend` rounds the probabilities to bfloat16 as before, so attention multiplies the same values
    (not bit for bit the same results: XLA may keep other float32 intermediates unrounded in either case,
    `xla_allow_excess_precision`); the cache takes twice the memory. Where the decode step's products run on oneDNN
    the cache stays bfloat16: attention's two products read it as it is on the CPU's bf16 instructions, and the
    kernel writes each step's keys and values into it in place (`onednn.cache_write`; XLA:CPU would widen the whole
    cache to scatter them). With half the bytes to read, a SmolLM2-135M decode step (32 rows, 2-core AMX Xeon) ran
    1.27x faster than against the float32 cache at 256 cached positions, 1.09x at 128
    (`benchmarks/bench_decode_cache_dtype.py`). Accelerators multiply bfloat16 natively and keep it. (float16 keeps
    its own cache: rounding to it in float32 is not known to keep its subnormals.)"""
    dtype = jnp.dtype(config.compute_dtype)
    if dtype == jnp.bfloat16 and jax.default_backend() == "cpu":
        return dtype if onednn.use_onednn(config.cpu_matmul, dtype, one_token=True) else jnp.dtype(jnp.float32)
    return dtype


def write_cache(
    cache: jax.Array,
    update: jax.Array,
    positions: jax.Array,
    *,
    keys: bool,
    config: ModelConfig,
    rows: jax.Array | None = None,
    layer: jax.Array | None = None,
) -> jax.Array:
    """A KV cache with `update [R, T, K, Dh]` written at `positions [R, T]` of its rows `rows [R]` (default
    `0..R-1`): one layer's keys `[B, K, Dh, S]` (`keys`, stored transposed) or values `[B, K, S, Dh]`, or layer
    `layer` of a stacked cache `[L, B, K, ...]`. Positions and rows are non-negative (the two paths below would treat
    a negative one differently); positions at or beyond `S` are dropped (a padding token's).

    A bfloat16 cache on a CPU, which `cache_dtype` gives where the decode step's products run on oneDNN, is written
    in place by the kernel (`onednn.cache_write`): XLA:CPU widens a bfloat16 scatter's (or dynamic-update-slice's)
    whole operand to float32 and back, the whole cache at every decode step. Any other cache by XLA's scatter."""
    kernel = cache.dtype == jnp.bfloat16 and jax.default_backend() == "cpu" and cache_dtype(config) == cache.dtype
    if kernel:
        return onednn.cache_write(cache, update, positions, 0 if layer is None else layer, keys, rows)
    return _scatter_cache(cache, update, positions, keys=keys, rows=rows, layer=layer)


def _scatter_cache(cache, update, positions, *, keys: bool, rows=None, layer=None) -> jax.Array:
    """`write_cache` by XLA's scatter (`.at[...].set`, mode "drop"), whatever the cache's dtype."""
    rows = jnp.arange(update.shape[0]) if rows is None else rows
    at = () if layer is None else (layer,)
    where = (
        (*at, rows[:, None], slice(None), slice(None), positions)
        if keys
        else (*at, rows[:, None], slice(None), positions)
    )
    return cache.at[where].set(update.astype(cache.dtype), mode="drop")


def init_cache(config: ModelConfig, batch: int, max_len: int) -> KVCache:
    """An all-zero cache for `batch` rows of up to `max_len` positions, in `cache_dtype(config)`."""
    heads = (config.num_layers, batch, config.num_kv_heads)
    dtype = cache_dtype(config)
    return KVCache(
        k=jnp.zeros((*heads, config.head_dim, max_len), dtype), v=jnp.zeros((*heads, max_len, config.head_dim), dtype)
    )


def param_shapes(config: ModelConfig) -> Params:
    """Shape of every parameter, as the params pytree with tuples of ints for leaves."""
    c = config
    L, D, F, H, K, Dh, V = (
        c.num_layers,
        c.hidden_size,
        c.intermediate_size,
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        c.vocab_size,
    )
    layers = {
        "attn_norm": {"scale": (L, D)},
        "q_proj": {"kernel": (L, D, H, Dh)},
        "k_proj": {"kernel": (L, D, K, Dh)},
        "v_proj": {"kernel": (L, D, K, Dh)},
        "o_proj": {"kernel": (L, H, Dh, D)},
        "mlp_norm": {"scale": (L, D)},
        "gate_proj": {"kernel": (L, D, F)},
        "up_proj": {"kernel": (L, D, F)},
        "down_proj": {"kernel": (L, F, D)},
    }
    if c.attention_bias:
        layers["q_proj"]["bias"] = (L, H, Dh)
        layers["k_proj"]["bias"] = (L, K, Dh)
        layers["v_proj"]["bias"] = (L, K, Dh)
        if c.architecture != "qwen2":
            layers["o_proj"]["bias"] = (L, D)
    if c.qk_norm:
        layers["q_norm"] = {"scale": (L, Dh)}
        layers["k_norm"] = {"scale": (L, Dh)}
    shapes = {"embed": {"embedding": (V, D)}, "layers": layers, "final_norm": {"scale": (D,)}}
    if not c.tie_word_embeddings:
        shapes["lm_head"] = {"kernel": (D, V)}
    if c.lora_rank:  # adapters beside their kernels (feynrl_jax.models.lora)
        kernels = {target: layers[target]["kernel"] for target in c.lora_targets}
        for target, leaves in lora.adapter_shapes(c, kernels).items():
            layers[target].update(leaves)
    if c.base_quantization:  # NF4 codes and block scales instead of each projection kernel (feynrl_jax.models.quant)
        for name in quant.PROJECTIONS:
            layers[name].update(quant.quantized_shapes(layers[name].pop("kernel")))
    return shapes


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(i, int) for i in x)


def init_params(config: ModelConfig, rng: jax.Array) -> Params:
    """Random parameters: normal(0, 0.02) matrices, zero biases, unit norm scales (as transformers does); LoRA
    adapters as `lora.init_leaf` (zero `lora_b`), in float32.

    Args:
        config: the model config.
        rng: a PRNG key.

    Returns:
        The params pytree in `param_dtype` (built in one jitted program).
    """
    if config.base_quantization:  # random kernels, then quantized
        plain = dataclasses.replace(config, base_quantization=None)
        return jax.jit(quant.quantize_base)(_init_params(plain, rng))
    return _init_params(config, rng)


def placeholder_params(config: ModelConfig) -> Params:
    """Zeros of the shape and dtype of every parameter the model computes with (`as_param_dtype(init_params(...))`,
    as a trainer publishes them: adapters, NF4 codes and scales included), as host numpy arrays that the OS maps
    lazily: weights to compile programs with before the real ones arrive (a rollout engine's warm-up). Zero weights
    compute finite values: zero norm scales give zero hidden states, hence uniform logits."""
    shapes = jax.eval_shape(lambda key: as_param_dtype(init_params(config, key), config), jax.random.key(0))
    return jax.tree.map(lambda leaf: np.zeros(leaf.shape, leaf.dtype), shapes)


@functools.partial(jax.jit, static_argnums=0)
def _init_params(config: ModelConfig, rng: jax.Array) -> Params:
    shapes = param_shapes(config)
    leaves, treedef = jax.tree.flatten_with_path(shapes, is_leaf=_is_shape)
    keys = jax.random.split(rng, len(leaves))
    dtype = jnp.dtype(config.param_dtype)
    out = []
    for key, (path, shape) in zip(keys, leaves):
        name = jax.tree_util.keystr(path)
        if lora.is_adapter_path(path):
            out.append(lora.init_leaf(path[-1].key, shape, key, path[-2].key))
        elif "scale" in name:
            out.append(jnp.ones(shape, dtype))
        elif "bias" in name:
            out.append(jnp.zeros(shape, dtype))
        else:
            out.append((0.02 * jax.random.normal(key, shape, jnp.float32)).astype(dtype))
    return jax.tree.unflatten(treedef, out)


def as_param_dtype(params: Params, config: ModelConfig) -> Params:
    """`params` with every leaf in `config.param_dtype`: the weights the model computes with.

    A train state may hold wider master weights (float32 masters of a bfloat16 model, `model.master_dtype`);
    `forward`, `logits`, the native engine and the trainer's weight publication round them to `param_dtype`
    here. Leaves already in `param_dtype` are returned as they are (no copy, no op under jit), and so are the NF4
    leaves of a quantized base.
    """
    dtype = jnp.dtype(config.param_dtype)
    # NF4 codes and their float32 block scales stay as they are (`quant.dequantize` makes the compute dtype).
    return _in_dtype(params, dtype)


def _in_dtype(tree, dtype):
    """`tree`'s leaves cast to `dtype`, NF4 leaves (`quant`) kept as they are."""
    return jax.tree_util.tree_map_with_path(lambda path, p: p if quant.is_quant_path(path) else p.astype(dtype), tree)


def _kernels_cast_in_products(config: ModelConfig, dtype, use_onednn: bool, into_sink: bool) -> bool:
    """Whether float32 projection kernels reach the products as they are, for `onednn.dot_cast` to cast (and give
    their gradient in float32): bfloat16 products on oneDNN, and weights rounded to nothing narrower than that on
    their way (`param_dtype` float32, or the compute dtype itself, where both roundings are the same one).

    Not in a pass into a gradient sink (`into_sink`, `forward`'s `grad_sink`): its backward pass recomputes every
    layer from the float32 weights, and there casting each kernel in each of its products ran 1.01-1.02x slower than
    casting it once per layer (`benchmarks/bench_grad_sink.py --precision bfloat16 --cpu-matmul auto`, its "cast in
    products" variant, 2-core AMX Xeon).
    """
    param_dtype = jnp.dtype(config.param_dtype)
    fits = use_onednn and dtype == jnp.bfloat16 and param_dtype in (jnp.dtype(jnp.float32), dtype)
    return fits and not into_sink


def _layer_weights(layers, config: ModelConfig, dtype, keep_kernels: bool):
    """The layers' weights rounded to `param_dtype`, then cast to the compute dtype `dtype`; NF4 leaves as they are,
    and with `keep_kernels` (`_kernels_cast_in_products`) float32 projection kernels too (`_matmul` casts them)."""
    param_dtype = jnp.dtype(config.param_dtype)

    def cast(path, p):
        if quant.is_quant_path(path):
            return p
        if keep_kernels and getattr(path[-1], "key", None) == "kernel" and p.dtype == jnp.float32:
            return p
        return p.astype(param_dtype).astype(dtype)

    return jax.tree_util.tree_map_with_path(cast, layers)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm computed in float32 (or wider), rounded once to `x`'s dtype. `x: [..., N]`, `scale: [N]`.

    Elementwise chains between the products compute in float32 and round once (`gated`, `rope.apply_rope`), where
    rounding after every operation in bfloat16 made XLA:CPU widen and narrow around each one: in a bf16
    forward+backward pass of SmolLM2-135M (8 x 256 tokens, 2-core AMX Xeon) the three together took the step from
    4.70 to 3.99 s (`benchmarks/bench_bf16_step.py`, medians of 7). Transformers rounds the normalised input before
    the scale; this rounds once, after it, closer to the float32 result."""
    wide = jnp.promote_types(x.dtype, jnp.float32)
    xf = x.astype(wide)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (scale.astype(wide) * normed).astype(x.dtype)


def gated(gate: jax.Array, up: jax.Array) -> jax.Array:
    """The MLP's `silu(gate) * up`, computed in float32 (or wider) and rounded once to `gate`'s dtype (`rms_norm`)."""
    wide = jnp.promote_types(gate.dtype, jnp.float32)
    return (jax.nn.silu(gate.astype(wide)) * up.astype(wide)).astype(gate.dtype)


ONEDNN_DOT = "onednn_dot"
"""`checkpoint_name` of oneDNN products, which remat policy "dots" keeps as it keeps XLA's dots."""


def _matmul(x: jax.Array, kernel: jax.Array, dtype, use_onednn: bool = False) -> jax.Array:
    """`x [B, T, N] @ kernel [N, M] -> [B, T, M]` as one 2-D matrix product.

    Folding the batch and time axes into one keeps the dot and both of its gradients plain 2-D GEMMs, which
    XLA:CPU runs near its matmul peak; the same contraction written as a 3-D einsum ran its backward pass
    about 1.5x slower on CPU (benchmarks/bench_model_fwd_bwd.py). `use_onednn`: the product runs in oneDNN
    (`feynrl_jax.kernels.onednn`: bfloat16 on a CPU's bf16 instructions, or float32); a float32 `kernel` with
    bfloat16 products there goes to `onednn.dot_cast`, which casts it and gives its gradient in float32.
    """
    b, t, n = x.shape
    if use_onednn and kernel.dtype == jnp.float32 and jnp.dtype(dtype) == jnp.bfloat16:  # `_layer_weights` kept it
        out = checkpoint_name(onednn.dot_cast(x.reshape(b * t, n).astype(dtype), kernel, dtype), ONEDNN_DOT)
        return out.reshape(b, t, kernel.shape[-1])
    x2, kernel = x.reshape(b * t, n), kernel.astype(dtype)
    if use_onednn:
        out = checkpoint_name(onednn.dot(x2.astype(dtype), kernel, False, dtype), ONEDNN_DOT)
    else:
        out = x2 @ kernel
    return out.reshape(b, t, kernel.shape[-1])


def _dense(
    x: jax.Array, proj: dict, dtype, lora_scale: float, dropout: tuple | None = None, use_onednn: bool = False
) -> jax.Array:
    """`x [B, T, N]` through a projection `{"kernel": [*inputs, *outputs]}` (inputs multiply to N) to
    `[B, T, M]` (M the product of the outputs), plus `lora_scale * (x A) B` when the projection holds LoRA
    adapters `lora_a [*inputs, r]`, `lora_b [r, *outputs]` (`feynrl_jax.models.lora`).

    `dropout = (key, rate)` drops elements of the adapters' input `x` (inverted dropout, scaled by
    `1 / (1 - rate)`), as PEFT's `lora_dropout` does; the frozen projection sees `x` whole. `use_onednn`: see
    `_matmul`."""
    n = x.shape[-1]
    kernel = proj["kernel"] if "kernel" in proj else quant.kernel(proj, dtype)  # `_matmul` casts it (NF4: here)
    out = _matmul(x, kernel.reshape(n, -1), dtype, use_onednn)
    if "lora_a" in proj:
        a, b = proj["lora_a"], proj["lora_b"]
        rank = a.shape[-1]
        if dropout is not None:
            key, rate = dropout
            keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
            x = jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))
        low = _matmul(x, a.reshape(n, rank), dtype, use_onednn)
        out = out + (lora_scale * _matmul(low, b.reshape(rank, -1), dtype, use_onednn)).astype(out.dtype)
    return out


def _project(
    h: jax.Array, proj: dict, dtype, lora_scale: float, dropout: tuple | None = None, use_onednn: bool = False
) -> jax.Array:
    """`h [B, T, D]` through a `[D, heads, Dh]` projection (`_dense`) to `[B, T, heads, Dh]`."""
    heads, head_dim = _kernel_shape(proj)[-2:]
    return _dense(h, proj, dtype, lora_scale, dropout, use_onednn).reshape(*h.shape[:2], heads, head_dim)


def _kernel_shape(proj: dict) -> tuple[int, ...]:
    """A projection kernel's shape, also when it is stored in NF4 (two codes per byte along the last axis)."""
    if quant.is_quantized(proj):
        *lead, half = proj["kernel_nf4"].shape
        return (*lead, 2 * half)
    return proj["kernel"].shape


def _remat_policy(name: str, use_onednn: bool = False):
    if name == "full":
        return jax.checkpoint_policies.nothing_saveable
    if name == "dots" and use_onednn:  # oneDNN's products are custom calls, kept by name
        return jax.checkpoint_policies.save_from_both_policies(
            jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
            jax.checkpoint_policies.save_only_these_names(ONEDNN_DOT),
        )
    if name == "dots":
        return jax.checkpoint_policies.dots_with_no_batch_dims_saveable
    raise ValueError(f"unknown remat policy {name!r}; expected 'auto', 'none', 'full' or 'dots'")


def unstack_layers(params: Params) -> Params:
    """The params with `layers` split into a tuple of per-layer dicts, for `forward`'s unrolled layer loop.

    Decoding (T = 1) is dominated by small matrix products, and inside `lax.scan` every layer's weights reach
    them through a dynamic slice that XLA:CPU copies: about a sixth of a SmolLM2-135M decode step. Separate
    per-layer arrays feed the products directly. Split once (when an engine loads params), not per step.

    Args:
        params: the params pytree, layers stacked on axis 0.

    Returns:
        The same pytree except `layers`: a tuple of `L` dicts with the same keys, each leaf without the layer
        axis (`layers[l]["q_proj"]["kernel"]` is `[D, H, Dh]`).
    """
    num_layers = jax.tree.leaves(params["layers"])[0].shape[0]
    layers = tuple(jax.tree.map(lambda a, i=i: a[i], params["layers"]) for i in range(num_layers))
    return {**params, "layers": layers}


def forward(
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    *,
    config: ModelConfig,
    segment_ids: jax.Array | None = None,
    cache: KVCache | None = None,
    remat: str | None = None,
    attend_len: int | None = None,
    dropout_rng: jax.Array | None = None,
    segment_bounds: block_attention.SegmentBounds | None = None,
    grad_sink: Params | None = None,
) -> tuple[jax.Array, KVCache | None]:
    """Runs the decoder up to and including the final norm.

    Without `cache`, attention is causal within each segment (`segment_ids`, 0 = padding). With `cache`, the
    key/value of the token at position `p` of row `b` is written at cache index `p` of row `b` (tokens whose
    segment id is 0 are not written) and each query attends to cache indices `<= its position`: one rule for
    prefill, slot insertion and batched decode with every row at its own position.

    Stacked params (`layers` leaves `[L, ...]`) run the layers with `lax.scan`, so compile time stays flat in
    depth (training). Per-layer params (`unstack_layers`) run them in a Python loop: no per-layer slice copies,
    which makes decoding faster on CPU at the cost of a compile time that grows with depth. Both compute the
    same function.

    Args:
        params: the params pytree, layers stacked or unstacked (`unstack_layers`), in `param_dtype` or wider
            (rounded to it first, `as_param_dtype`).
        tokens: `[B, T]` int32 token ids.
        positions: `[B, T]` int32 positions (restart at 0 in every packed segment).
        config: the model config (static under jit).
        segment_ids: `[B, T]` int32, 0 marks padding; None means every token is real and one segment per row.
        cache: a `KVCache` with S >= max position + 1, or None; stacked or per layer (`KVCache.unstack`). Per-layer
            params update a per-layer cache in place, without the copies of slicing a stacked one (decoding).
        remat: rematerialisation policy for the backward pass ("none", "full", "dots"); None uses
            `config.remat`.
        attend_len: with `cache`, attend to its first `attend_len` indices only (static; the queries whose output
            matters must sit below it). Decoding reads less of the cache while the live sequences are short.
            None: the whole cache.
        dropout_rng: a PRNG key for LoRA dropout (`config.lora_dropout`; training passes only), or None: no
            dropout. Each layer and projection draws its own mask from it (`lora_dropout_keys`).
        segment_bounds: static bounds that `segment_ids` and `positions` satisfy (`block_attention`), or None.
            Without `cache`, attention then runs in blocks of queries where that scores fewer pairs than the
            dense mask; real tokens get the same outputs (up to the order of float32 sums). Rows that break
            the bounds get wrong outputs: check them on the host first (`SegmentBounds.check`).
        grad_sink: a gradient accumulator shaped like `params["layers"]` (stacked), or None. With it, the layers'
            gradient is not returned on its own but added into the accumulator layer by layer, in place, during
            the backward pass: the gradient `jax.grad` gives for `params["layers"]` is then `grad_sink` plus this
            pass's gradient (`_layers_into_sink`), and the accumulator's buffer is the only one of that size.
            Only where `sinks_layer_grads(config, remat)` holds, without `cache`, with stacked layers in the
            accumulator's dtype, and from exactly one pass of the function `jax.grad` differentiates, never under
            `vmap`: the accumulator reaches the result through this pass's backward pass alone (a second pass with
            the same sink would add it twice, a pass the loss does not depend on would drop it).

    Returns:
        `(hidden [B, T, D] in compute dtype, updated cache or None)`; the cache has the form it was given in.
    """
    if grad_sink is not None:
        _check_sink(params, grad_sink, config, remat, cache)
    raw_layers = params["layers"]
    dtype = jnp.dtype(config.compute_dtype)
    mm = onednn.use_onednn(config.cpu_matmul, dtype, tokens.shape[1] == 1)  # the products in oneDNN (on a CPU)
    keep_kernels = _kernels_cast_in_products(config, dtype, mm, grad_sink is not None)
    params = as_param_dtype({k: v for k, v in params.items() if k != "layers"}, config)
    # Every layer weight is used in the compute dtype: the whole stack is cast once, before the layers, so the
    # backward pass writes each layer's gradient into a stack of that dtype and widens the stack once at the end.
    # (Per-layer casts inside the scan made XLA:CPU convert-and-write each layer's gradient into the float32 stack:
    # about 3.5 s of a 12 s bfloat16 step of SmolLM2-135M at 8x256 tokens.) Float32 kernels whose bfloat16
    # products run on oneDNN stay float32 (`_kernels_cast_in_products`): `onednn.dot_cast` casts each, and writes
    # its gradient in float32.
    params = {**params, "layers": _layer_weights(raw_layers, config, dtype, keep_kernels)}
    scale = config.lora_scale  # adapters present in the params are applied (feynrl_jax.models.lora)
    layer_keys = None
    if dropout_rng is not None and config.lora_dropout > 0 and config.lora_rank:
        layer_keys = jax.random.split(dropout_rng, config.num_layers)
    x = jnp.take(params["embed"]["embedding"], tokens, axis=0).astype(dtype)
    cos, sin = rope_cos_sin(positions, config)
    blocks = None
    if cache is None:
        # The segment structure is the same in every layer: build it once, outside the layers.
        kv_share = config.num_kv_heads / config.num_heads
        if segment_bounds is not None and segment_ids is not None and segment_bounds.pays(tokens.shape[1], kv_share):
            blocks = block_attention.block_structure(positions, segment_ids, segment_bounds)
        else:
            row_mask = packed_mask(positions, segment_ids, None)
    else:
        # Padding tokens are "written" out of bounds and dropped.
        cache_len = cache.v[0].shape[-2]
        write_idx = positions if segment_ids is None else jnp.where(segment_ids != 0, positions, cache_len)

    def block(x, p, window, attention, key):
        """One layer; `attention(q, k, v, window) -> (attn, aux)` owns the cache; `key`: the layer's LoRA dropout
        key or None. Returns `(x, aux)`."""
        drop = _dropout_per_target(key, config.lora_dropout)
        h = rms_norm(x, p["attn_norm"]["scale"], config.rms_norm_eps)
        q = _project(h, p["q_proj"], dtype, scale, drop["q_proj"], mm)
        k = _project(h, p["k_proj"], dtype, scale, drop["k_proj"], mm)
        v = _project(h, p["v_proj"], dtype, scale, drop["v_proj"], mm)
        if config.attention_bias:
            q = q + p["q_proj"]["bias"].astype(dtype)
            k = k + p["k_proj"]["bias"].astype(dtype)
            v = v + p["v_proj"]["bias"].astype(dtype)
        if config.qk_norm:
            q = rms_norm(q, p["q_norm"]["scale"], config.rms_norm_eps)
            k = rms_norm(k, p["k_norm"]["scale"], config.rms_norm_eps)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        attn, aux = attention(q, k, v, window)
        out = _dense(attn.reshape(*attn.shape[:2], -1), p["o_proj"], dtype, scale, drop["o_proj"], mm)
        if "bias" in p["o_proj"]:
            out = out + p["o_proj"]["bias"].astype(dtype)
        x = x + out
        h = rms_norm(x, p["mlp_norm"]["scale"], config.rms_norm_eps)
        gate = _dense(h, p["gate_proj"], dtype, scale, drop["gate_proj"], mm)
        up = _dense(h, p["up_proj"], dtype, scale, drop["up_proj"], mm)
        x = x + _dense(gated(gate, up), p["down_proj"], dtype, scale, drop["down_proj"], mm)
        return x, aux

    def packed_attention(q, k, v, window):
        if blocks is not None:
            return block_attention.attend_in_blocks(q, k, v, blocks, window, mm), None
        mask = row_mask if window is None else row_mask & within_window(positions, window)
        return attend(q, k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3), mask, mm), None

    def cached_attention(q, k, v, window, ck, cv, at):
        """Writes k, v into the cache `ck [..., B, K, Dh, S]`, `cv [..., B, K, S, Dh]` at index `at` (a tuple
        of leading indices: `(layer,)` for the stacked cache, `()` for one layer's), then attends to it."""
        # Advanced indices split by slices: numpy puts the broadcast [B, T] index dimensions first, so the
        # indexed block of either cache is [B, T, K, Dh], the layout of k and v.
        # Rounded to the compute dtype, stored in the cache's: a wider cache (`cache_dtype`) holds the same values.
        k, v = (round_to(x, dtype).astype(ck.dtype) for x in (k, v))
        layer = at[0] if at else None
        ck = write_cache(ck, k, write_idx, keys=True, config=config, layer=layer)
        cv = write_cache(cv, v, write_idx, keys=False, config=config, layer=layer)
        keys, values = ck[at], cv[at]
        length = attend_len if attend_len is not None and attend_len < cache_len else None
        mask = cache_mask(positions, length or cache_len, window)
        return attend(q, keys, values, mask, mm, length), (ck, cv)

    if grad_sink is not None:
        x = _layers_into_sink(block, packed_attention, x, raw_layers, grad_sink, config, dtype, keep_kernels)
        x = rms_norm(x, params["final_norm"]["scale"], config.rms_norm_eps)
        return x, None

    policy = config.resolved_remat(remat)
    if policy != "none":
        block = jax.checkpoint(block, policy=_remat_policy(policy, mm), prevent_cse=False, static_argnums=(3,))

    if isinstance(params["layers"], tuple):
        x, cache = _unrolled_layers(
            block, packed_attention, cached_attention, x, params["layers"], cache, config, layer_keys
        )
    else:
        x, cache = _scanned_layers(
            block, packed_attention, cached_attention, x, params["layers"], cache, config, layer_keys
        )
    x = rms_norm(x, params["final_norm"]["scale"], config.rms_norm_eps)
    return x, cache


def sinks_layer_grads(config: ModelConfig, remat: str | None = None) -> bool:
    """Whether `forward` can add the layers' gradient into an accumulator in place (`grad_sink`) for `config`.

    The sink's backward pass recomputes each layer from its input, as rematerialisation policy "full" does, so it
    serves passes that run with that policy (the CPU's default in bfloat16, `ModelConfig.resolved_remat`); LoRA passes
    train the adapters alone, whose gradients are small, and take the ordinary path.
    """
    return config.resolved_remat(remat) == "full" and not config.lora_rank


def _check_sink(params: Params, sink: Params, config: ModelConfig, remat: str | None, cache) -> None:
    """Raises a `ValueError` unless `forward` can run its layers into `sink` (see `forward`'s `grad_sink`)."""
    if not sinks_layer_grads(config, remat):
        raise ValueError(f"grad_sink needs remat 'full' and no LoRA (remat {config.resolved_remat(remat)!r})")
    if cache is not None or isinstance(params["layers"], tuple):
        raise ValueError("grad_sink serves training passes: stacked layers and no cache")
    shapes = jax.tree.map(lambda a: (a.shape, jnp.dtype(a.dtype)), params["layers"])
    if jax.tree.map(lambda a: (a.shape, jnp.dtype(a.dtype)), sink) != shapes:
        raise ValueError("grad_sink must match params['layers'] in structure, shapes and dtypes")


def _layers_into_sink(block, attention, x, layers, sink, config, dtype, keep_kernels: bool):
    """The stacked layers as one `lax.scan`, whose backward pass adds each layer's gradient into `sink`.

    Forward: the layers run in a scan that keeps each layer's input (what rematerialisation "full" keeps). Backward
    (`_sink_scan`): a reverse scan recomputes layer `l` from its input, takes its vector-Jacobian product and adds
    the weights' part into row `l` of the accumulator, a loop-carried buffer that XLA updates in place. The
    gradient of a stack of layers otherwise comes out as a stack of its own, which a caller accumulating several
    micro-batches adds to its accumulator afterwards: two buffers of the layers' size at once (PyTorch adds into
    `.grad` in place for the same reason). `layers` are the params as given (the accumulator's dtype); each layer
    is rounded to `param_dtype` and cast to the compute dtype `dtype` where it is used, as `forward` does to the
    stack (`_layer_weights`), its float32 kernels kept for `onednn.dot_cast` with `keep_kernels` (which
    `_kernels_cast_in_products` leaves off here).
    """
    windows, any_window = _window_table(config)

    def one_layer(x, p, window):
        p = _layer_weights(p, config, dtype, keep_kernels)
        return block(x, p, window if any_window else None, attention, None)[0]

    first = jax.tree.map(lambda a: a[0], layers)
    # The layer closes over the batch's traced structure. Its float arrays (the rotary tables) become explicit
    # arguments of the custom rule; the integer and boolean ones (masks, block indices) stay closed over, which
    # holds because the rule's forward and backward passes are traced within the same trace as the caller.
    converted, consts = jax.closure_convert(one_layer, x, first, windows[0])
    return _sink_scan(converted, x, layers, sink, windows, tuple(consts))


def _scan_layers(layer_fn, x, layers, windows, consts, keep_inputs: bool):
    """`lax.scan` of `layer_fn(x, layer, window, *consts)` over the stacked layers; with `keep_inputs` also each
    layer's input, stacked."""

    def body(x, one):
        p, window = one
        return layer_fn(x, p, window, *consts), (x if keep_inputs else None)

    return jax.lax.scan(body, x, (layers, windows))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _sink_scan(layer_fn, x, layers, sink, windows, consts):
    return _scan_layers(layer_fn, x, layers, windows, consts, keep_inputs=False)[0]


def _sink_scan_fwd(layer_fn, x, layers, sink, windows, consts):
    out, inputs = _scan_layers(layer_fn, x, layers, windows, consts, keep_inputs=True)
    return out, (inputs, layers, sink, windows, consts)


def _sink_scan_bwd(layer_fn, residuals, ct):
    inputs, layers, sink, windows, consts = residuals

    def body(carry, index):
        dx, acc = carry
        p = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, index, keepdims=False), layers)
        _, vjp = jax.vjp(lambda x, p: layer_fn(x, p, windows[index], *consts), inputs[index], p)
        dx, dp = vjp(dx)

        def add(a, g):
            row = jax.lax.dynamic_index_in_dim(a, index, keepdims=False) + g.astype(a.dtype)
            return jax.lax.dynamic_update_index_in_dim(a, row, index, 0)

        return (dx, jax.tree.map(add, acc, dp)), None

    num = windows.shape[0]
    (dx, acc), _ = jax.lax.scan(body, (ct, sink), jnp.arange(num - 1, -1, -1))
    # The accumulator is the layers' cotangent; the sink, the windows and the batch structure get none.
    return dx, acc, None, None, jax.tree.map(lambda _: None, consts)


_sink_scan.defvjp(_sink_scan_fwd, _sink_scan_bwd)


def _dropout_per_target(key: jax.Array | None, rate: float) -> dict[str, tuple | None]:
    """`{target: (key, rate)}` of one layer's LoRA dropout (a key per projection), or `{target: None}`."""
    if key is None:
        return dict.fromkeys(LORA_TARGETS)
    keys = jax.random.split(key, len(LORA_TARGETS))
    return {target: (keys[i], rate) for i, target in enumerate(LORA_TARGETS)}


def _window_table(config: ModelConfig) -> tuple[jax.Array, bool]:
    """`([L] int32 sliding window per layer, _NO_WINDOW where none), whether any layer has one)`: what the layer
    scans feed each layer."""
    windows = config.layer_windows()
    table = jnp.asarray([_NO_WINDOW if w is None else w for w in windows], jnp.int32)
    return table, any(w is not None for w in windows)


def _scanned_layers(block, packed_attention, cached_attention, x, layers, cache, config, layer_keys):
    """`lax.scan` over stacked layers; a per-layer cache is stacked and split again."""
    per_layer = cache is not None and isinstance(cache.k, tuple)
    if per_layer:
        cache = cache.stack()
    windows, any_window = _window_table(config)

    # The cache rides in the scan carry and each layer writes its slice in place (XLA updates a loop-carried
    # buffer without copying it, and the caller donates the cache); passing it through the scan as xs -> ys
    # would re-stack the whole cache on every call.
    def layer(carry, layer_in):
        x, ck, cv = carry
        p, window, index, key = layer_in
        window = window if any_window else None
        if ck is None:
            x, _ = block(x, p, window, packed_attention, key)
        else:

            def attention(q, k, v, window):
                return cached_attention(q, k, v, window, ck, cv, (index,))

            x, (ck, cv) = block(x, p, window, attention, key)
        return (x, ck, cv), None

    ck, cv = (None, None) if cache is None else (cache.k, cache.v)
    layer_index = jnp.arange(config.num_layers)
    (x, ck, cv), _ = jax.lax.scan(layer, (x, ck, cv), (layers, windows, layer_index, layer_keys))
    if cache is None:
        return x, None
    cache = KVCache(k=ck, v=cv)
    return x, (cache.unstack() if per_layer else cache)


def _unrolled_layers(block, packed_attention, cached_attention, x, layers, cache, config, layer_keys):
    """A Python loop over per-layer params; a stacked cache is split into per-layer arrays and re-stacked."""
    stacked = cache is not None and not isinstance(cache.k, tuple)
    if stacked:
        cache = cache.unstack()
    ks, vs = (None, None) if cache is None else (list(cache.k), list(cache.v))
    for index, (p, window) in enumerate(zip(layers, config.layer_windows(), strict=True)):
        key = None if layer_keys is None else layer_keys[index]
        if cache is None:
            x, _ = block(x, p, window, packed_attention, key)
        else:

            def attention(q, k, v, window, index=index):
                return cached_attention(q, k, v, window, ks[index], vs[index], ())

            x, (ks[index], vs[index]) = block(x, p, window, attention, key)
    if cache is None:
        return x, None
    cache = KVCache(k=tuple(ks), v=tuple(vs))
    return x, (cache.stack() if stacked else cache)


def logits(params: Params, hidden: jax.Array, *, config: ModelConfig) -> jax.Array:
    """Output projection (the tied embedding or `lm_head`).

    Args:
        params: the params pytree (the projection is rounded to `param_dtype` first, `as_param_dtype`).
        hidden: `[B, T, D]` from `forward`.
        config: the model config.

    Returns:
        `[B, T, V]` float32.
    """
    dtype = hidden.dtype
    tied = config.tie_word_embeddings
    weight = params["embed"]["embedding"] if tied else params["lm_head"]["kernel"]
    weight = as_param_dtype(weight, config).astype(dtype)
    if onednn.use_onednn(config.cpu_matmul, dtype, hidden.shape[1] == 1):
        b, t, d = hidden.shape
        out = onednn.dot(hidden.reshape(b * t, d), weight, tied, jnp.float32)
        return checkpoint_name(out, ONEDNN_DOT).reshape(b, t, -1)
    if tied:
        return jnp.einsum("btd,vd->btv", hidden, weight, preferred_element_type=jnp.float32)
    return jnp.einsum("btd,dv->btv", hidden, weight, preferred_element_type=jnp.float32)
