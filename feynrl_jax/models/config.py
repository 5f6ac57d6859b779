"""The decoder's hyperparameters, and how they are read from a Hugging Face `config.json`.

`ModelConfig` is a frozen, hashable dataclass so it can be a static argument of `jax.jit`. Every family we
support (Llama 2/3/3.1/3.2, SmolLM2, Qwen2/2.5, Qwen3, Mistral) is one pre-norm decoder with rotary position
embeddings, grouped-query attention and a SwiGLU MLP; the differences are flags here:

| family | `architecture` | differences |
|---|---|---|
| Llama 2/3/3.x, SmolLM2 | `llama` | Llama-3 RoPE scaling (`rope_scaling` type `llama3`); SmolLM2 ties embeddings |
| Qwen2 / Qwen2.5 | `qwen2` | bias on q/k/v projections (`attention_bias`), optional sliding window on upper layers |
| Qwen3 | `qwen3` | RMSNorm on each q/k head before RoPE (`qk_norm`); `head_dim` independent of hidden/heads |
| Mistral | `mistral` | sliding-window attention (`sliding_window`) |

`ModelConfig.from_hf` reads both the transformers v5 layout (`rope_parameters`, `dtype`) and the older one
(`rope_theta`, `rope_scaling`, `torch_dtype`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import Any

from feynrl_jax.kernels import CPU_MATMUL_BACKENDS

ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")
DTYPES = ("float32", "bfloat16", "float16")
REMAT_POLICIES = ("auto", "none", "full", "dots")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
LAYER_TYPES = ("full_attention", "sliding_attention")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""Projections that can carry LoRA adapters (their Hugging Face names, `feynrl_jax.models.lora`)."""

# Hugging Face `model_type` -> our `architecture`.
_HF_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral"}
_HF_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "float": "float32", "half": "float16"}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Hyperparameters of one decoder-only transformer.

    Attributes:
        architecture: one of `ARCHITECTURES`.
        vocab_size: V, rows of the embedding table.
        hidden_size: D, width of the residual stream.
        intermediate_size: F, width of the SwiGLU MLP.
        num_layers: L.
        num_heads: H, query heads.
        num_kv_heads: K, key/value heads (grouped-query attention when K < H).
        head_dim: Dh, width of one head.
        rms_norm_eps: epsilon inside every RMSNorm.
        rope_theta: RoPE base wavelength.
        rope_scaling: RoPE scaling as a sorted tuple of `(key, value)` pairs including `rope_type`
            ("linear", "llama3" or "yarn"), or None for plain RoPE. Use `rope_scaling_dict()` to read it.
        max_position_embeddings: the longest context the model was trained for.
        tie_word_embeddings: the output projection is the transposed embedding table.
        attention_bias: q/k/v projections carry a bias (Qwen2 always; Llama/Qwen3/Mistral also on o_proj).
        qk_norm: RMSNorm over each query/key head before RoPE (Qwen3).
        sliding_window: keys more than `sliding_window - 1` positions back are masked, or None.
        layer_types: per-layer "full_attention" / "sliding_attention", or None: every layer slides when
            `sliding_window` is set.
        param_dtype: dtype the parameters are stored in ("float32", "bfloat16", "float16").
        compute_dtype: dtype of activations and matmuls; logits and log-probabilities are always float32.
        remat: default rematerialisation policy of `forward`: "none", "full" (recompute every layer in the
            backward pass), "dots" (keep matmul outputs, recompute the rest) or "auto" (on a CPU "dots" in float32
            without LoRA, else "full"; "none" elsewhere; `resolved_remat`).
        cpu_matmul: backend of the projections', attention's and output projection's products (bfloat16 or float32)
            on a CPU: "xla", "onednn" or "auto" (`feynrl_jax.kernels.onednn`). Runs set it from `model.cpu_matmul`
            ("auto"). Where a bfloat16 model's decode products run on oneDNN, its KV cache is bfloat16 (the kernel
            writes it), float32 otherwise (`decoder.cache_dtype`).
        bos_token_id, eos_token_id, pad_token_id: special tokens (eos may be a tuple), or None.
        lora_rank: r of the low-rank adapters on `lora_targets` (Hu et al. 2021, `feynrl_jax.models.lora`); 0: no
            adapters. The params then hold `lora_a`/`lora_b` beside each target's kernel.
        lora_alpha: the adapters' output is scaled by `lora_alpha / lora_rank`.
        lora_targets: the projections that carry adapters, a subset of `LORA_TARGETS`.
        lora_dropout: probability of zeroing each input element of an adapter (not of the frozen projection),
            in training forward passes that are given a key (`forward`'s `dropout_rng`); 0: none.
        base_quantization: "nf4": the seven projection kernels are stored in 4-bit NormalFloat blocks (QLoRA,
            `feynrl_jax.models.quant`: leaves `kernel_nf4`, `kernel_absmax` instead of `kernel`) and dequantized
            where used; None: stored in `param_dtype`.
    """

    architecture: str = "llama"
    vocab_size: int = 256
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    param_dtype: str = "float32"
    compute_dtype: str = "float32"
    remat: str = "none"
    cpu_matmul: str = "xla"
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None
    pad_token_id: int | None = None
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = ()
    lora_dropout: float = 0.0
    base_quantization: str | None = None

    def resolved_remat(self, remat: str | None = None) -> str:
        """The policy a pass runs with: `remat` (None: `self.remat`), "auto" resolved for the backend JAX runs on
        and the compute dtype.

        "auto" on a CPU is "dots" in float32 without LoRA: the backward pass keeps the layers' projection outputs and
        recomputes only what lies between them (norms, RoPE, attention, the MLP's activation), so it skips
        recomputing the projections, about a quarter of an update's products. Measured on the 2-core AVX2 EPYC with
        SmolLM2-135M's shapes against "full": the GRPO update 1.14x and 1.17x faster in two runs
        (`benchmarks/bench_grad_sink.py --blocks --also-remat dots`), the runs' trainer at 128 new tokens 1.19x
        (`benchmarks/bench_rl_update.py --remat full --also-remat dots`), the colocated GRPO step 1.12x
        (`benchmarks/bench_grpo_vs_trl.py --colocate --also-remat full`), at 1.84x XLA's temporaries, which the RL
        micro-batches' memory budget counts (`train.token_budget`). SFT and DPO steps run the same forward and
        backward passes and take it too (not measured there; their micro-batches are the config's). With LoRA it
        is "full", as before: a projection's base and adapter outputs would both be kept, which the budget's
        estimate does not count, and "dots" was measured on full fine-tuning only. In bfloat16 it is "full":
        XLA:CPU widens every bfloat16 residual it stacks across the layer scan to float32 and back, whole stack per
        layer, so keeping residuals costs more than recomputing them (full 1.4x faster than none on the AVX-512
        EPYC, 8x256 tokens). On accelerators it is "none": recomputation costs a third more FLOPs there and memory
        is rarely what limits a step."""
        policy = self.remat if remat is None else remat
        if policy != "auto":
            return policy
        import jax  # the config module itself stays importable without JAX

        if jax.default_backend() != "cpu":
            return "none"
        return "dots" if self.compute_dtype == "float32" and not self.lora_rank else "full"

    def __post_init__(self):
        def fail(key, message):
            raise ValueError(f"ModelConfig.{key}: {message}")

        if self.architecture not in ARCHITECTURES:
            fail("architecture", f"unknown architecture {self.architecture!r}; expected one of {ARCHITECTURES}")
        for key in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads"):
            if int(getattr(self, key)) <= 0:
                fail(key, f"must be positive, got {getattr(self, key)}")
        if self.num_heads % self.num_kv_heads:
            fail("num_kv_heads", f"{self.num_kv_heads} does not divide num_heads={self.num_heads}")
        if self.head_dim <= 0 or self.head_dim % 2:
            fail("head_dim", f"must be a positive even number (RoPE rotates pairs), got {self.head_dim}")
        for key in ("param_dtype", "compute_dtype"):
            if getattr(self, key) not in DTYPES:
                fail(key, f"unknown dtype {getattr(self, key)!r}; expected one of {DTYPES}")
        if self.remat not in REMAT_POLICIES:
            fail("remat", f"unknown policy {self.remat!r}; expected one of {REMAT_POLICIES}")
        if self.cpu_matmul not in CPU_MATMUL_BACKENDS:
            fail("cpu_matmul", f"unknown backend {self.cpu_matmul!r}; expected one of {CPU_MATMUL_BACKENDS}")
        if self.rope_scaling is not None:
            rope_type = dict(self.rope_scaling).get("rope_type")
            if rope_type not in ROPE_TYPES:
                fail("rope_scaling", f"unsupported rope_type {rope_type!r}; expected one of {ROPE_TYPES}")
        if self.sliding_window is not None and self.sliding_window <= 0:
            fail("sliding_window", f"must be positive or None, got {self.sliding_window}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                fail("layer_types", f"has {len(self.layer_types)} entries for num_layers={self.num_layers}")
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown:
                fail("layer_types", f"unknown layer types {unknown}; expected {LAYER_TYPES}")
        if self.lora_rank < 0:
            fail("lora_rank", f"must be >= 0, got {self.lora_rank}")
        if self.lora_rank and not self.lora_targets:
            fail("lora_targets", f"names no projection although lora_rank={self.lora_rank}")
        unknown = sorted(set(self.lora_targets) - set(LORA_TARGETS))
        if unknown:
            fail("lora_targets", f"unknown projections {unknown}; expected a subset of {LORA_TARGETS}")
        if self.lora_rank and not self.lora_alpha > 0:
            fail("lora_alpha", f"must be positive, got {self.lora_alpha}")
        if not 0.0 <= self.lora_dropout < 1.0:
            fail("lora_dropout", f"must be in [0, 1), got {self.lora_dropout}")
        if self.base_quantization is not None:
            if self.base_quantization != "nf4":
                fail("base_quantization", f"must be None or 'nf4', got {self.base_quantization!r}")
            odd = [n for n in ("hidden_size", "intermediate_size", "head_dim") if getattr(self, n) % 2]
            if odd:
                fail(
                    "base_quantization", f"NF4 packs two codes per byte along a kernel's last axis: {odd} must be even"
                )

    def rope_scaling_dict(self) -> dict[str, Any] | None:
        """`rope_scaling` as a plain dict (or None)."""
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    def layer_windows(self) -> tuple[int | None, ...]:
        """The attention window of every layer: `sliding_window` or None (full attention)."""
        if self.sliding_window is None:
            return (None,) * self.num_layers
        if self.layer_types is None:
            return (self.sliding_window,) * self.num_layers
        return tuple(self.sliding_window if t == "sliding_attention" else None for t in self.layer_types)

    @property
    def lora_scale(self) -> float:
        """The factor on the adapters' output, `lora_alpha / lora_rank` (0 without adapters)."""
        return self.lora_alpha / self.lora_rank if self.lora_rank else 0.0

    def without_lora(self) -> ModelConfig:
        """This config without adapters and with a plain (unquantized) base: the base model's architecture (the
        merged export, the evaluation's merged weights, a critic, a reference folder)."""
        return dataclasses.replace(
            self,
            lora_rank=0,
            lora_alpha=ModelConfig.lora_alpha,
            lora_targets=(),
            lora_dropout=0.0,
            base_quantization=None,
        )

    def frozen_base(self) -> ModelConfig:
        """This config without adapters, its base stored as the policy's is (NF4 under QLoRA): the config of
        `lora.base_params(params)`, the reference model of a LoRA run."""
        return dataclasses.replace(self.without_lora(), base_quantization=self.base_quantization)

    @property
    def num_params(self) -> int:
        """Number of parameters of the base model (embedding counted once when tied; adapters not counted)."""
        d, f, h, k, dh = self.hidden_size, self.intermediate_size, self.num_heads, self.num_kv_heads, self.head_dim
        attn = d * h * dh * 2 + d * k * dh * 2
        if self.attention_bias:
            attn += (h + 2 * k) * dh + (d if self.architecture != "qwen2" else 0)
        if self.qk_norm:
            attn += 2 * dh
        per_layer = attn + 3 * d * f + 2 * d
        head = 0 if self.tie_word_embeddings else d * self.vocab_size
        return self.vocab_size * d + self.num_layers * per_layer + d + head

    @classmethod
    def from_hf(cls, path_or_dict: str | os.PathLike | Mapping[str, Any], **overrides) -> ModelConfig:
        """Reads a Hugging Face `config.json`.

        Args:
            path_or_dict: a model folder, the path of a `config.json`, or its parsed dict.
            **overrides: fields to set instead of the file's values, e.g. `param_dtype="bfloat16"`.

        Returns:
            The config. `param_dtype`/`compute_dtype` default to the file's `dtype` (v5) or `torch_dtype`,
            float32 when neither is given.

        Raises:
            FileNotFoundError: the folder has no `config.json`.
            ValueError: unknown architecture, unsupported activation or RoPE type, or a missing key; the
                message names the file and the key.
        """
        if isinstance(path_or_dict, Mapping):
            raw, source = dict(path_or_dict), "<config dict>"
        else:
            source = os.fspath(path_or_dict)
            if os.path.isdir(source):
                source = os.path.join(source, "config.json")
            if not os.path.isfile(source):
                raise FileNotFoundError(f"no Hugging Face config at {source}")
            with open(source) as f:
                raw = json.load(f)
        return cls(**{**_fields_from_hf(raw, source), **overrides})

    def to_hf(self) -> dict[str, Any]:
        """The transformers (v5 layout) `config.json` dict describing this model."""
        arch_class = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
        arch_class["mistral"] = "MistralForCausalLM"
        rope = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling is not None:
            rope.update(self.rope_scaling_dict())
        out: dict[str, Any] = {
            "architectures": [arch_class[self.architecture]],
            "model_type": self.architecture,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": rope,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "dtype": self.param_dtype,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id) if isinstance(self.eos_token_id, tuple) else self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }
        if self.rope_scaling is not None:
            out["rope_scaling"] = dict(rope)
        if self.architecture != "qwen2":
            out["attention_bias"] = self.attention_bias
        if self.architecture in ("llama", "mistral"):
            out["mlp_bias"] = False
        if self.architecture in ("qwen2", "qwen3"):
            out["use_sliding_window"] = self.sliding_window is not None
            out["sliding_window"] = self.sliding_window
            out["max_window_layers"] = self.num_layers
            out["layer_types"] = [
                "sliding_attention" if w is not None else "full_attention" for w in self.layer_windows()
            ]
        if self.architecture == "mistral":
            out["sliding_window"] = self.sliding_window
        return out


def _fields_from_hf(raw: dict[str, Any], source: str) -> dict[str, Any]:
    """Maps a parsed HF config dict to `ModelConfig` fields; errors name `source` and the key."""

    def need(key):
        if key not in raw or raw[key] is None:
            raise ValueError(f"{source}: missing key {key!r}")
        return raw[key]

    model_type = raw.get("model_type")
    if model_type not in _HF_MODEL_TYPES:
        arch = raw.get("architectures")
        raise ValueError(
            f"{source}: unknown architecture model_type={model_type!r} (architectures={arch}); "
            f"supported model types: {sorted(_HF_MODEL_TYPES)}"
        )
    architecture = _HF_MODEL_TYPES[model_type]
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{source}: hidden_act={act!r} is not supported (only 'silu')")
    if raw.get("mlp_bias"):
        raise ValueError(f"{source}: mlp_bias=true is not supported")

    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    head_dim = raw.get("head_dim") or hidden // heads
    kv_heads = raw.get("num_key_value_heads") or heads

    # RoPE: v5 `rope_parameters` holds theta and the scaling; older files have `rope_theta` + `rope_scaling`.
    rope = dict(raw.get("rope_parameters") or {})
    if any(isinstance(v, dict) for v in rope.values()):
        raise ValueError(f"{source}: per-layer-type rope_parameters are not supported")
    legacy = raw.get("rope_scaling") or {}
    for key, value in legacy.items():
        rope.setdefault(key, value)
    theta = rope.pop("rope_theta", None) or raw.get("rope_theta") or 10000.0
    rope_type = rope.pop("rope_type", None) or rope.pop("type", None) or "default"
    rope.pop("type", None)
    if raw.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"{source}: partial_rotary_factor != 1 is not supported")
    rope.pop("partial_rotary_factor", None)
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"{source}: rope_type={rope_type!r} is not supported; expected one of {ROPE_TYPES}")
    rope_scaling = None
    if rope_type != "default":
        if rope_type in ("llama3", "yarn"):
            rope.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings"))
        if rope_type in ("linear", "llama3") and "factor" not in rope:
            raise ValueError(f"{source}: rope_type={rope_type!r} needs key 'factor'")
        items = {k: tuple(v) if isinstance(v, list) else v for k, v in rope.items() if v is not None}
        rope_scaling = tuple(sorted({**items, "rope_type": rope_type}.items()))

    # Sliding windows. Qwen2/3 only slide when `use_sliding_window`; Mistral whenever a window is set.
    window = raw.get("sliding_window")
    if architecture in ("qwen2", "qwen3") and not raw.get("use_sliding_window", False):
        window = None
    layer_types = None
    if window is not None:
        types = raw.get("layer_types")
        if types is None and architecture in ("qwen2", "qwen3"):
            start = raw.get("max_window_layers", 0)
            types = ["sliding_attention" if i >= start else "full_attention" for i in range(need("num_hidden_layers"))]
        layer_types = tuple(types) if types is not None else None

    if architecture == "qwen2":
        attention_bias = True
    else:
        attention_bias = bool(raw.get("attention_bias", False))

    dtype_name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    dtype_name = str(dtype_name).removeprefix("torch.")
    if dtype_name not in _HF_DTYPES:
        raise ValueError(f"{source}: unsupported dtype {dtype_name!r}")
    dtype = _HF_DTYPES[dtype_name]
    eos = raw.get("eos_token_id")
    return dict(
        architecture=architecture,
        vocab_size=int(need("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_layers=int(need("num_hidden_layers")),
        num_heads=heads,
        num_kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        rope_scaling=rope_scaling,
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        qk_norm=architecture == "qwen3",
        sliding_window=None if window is None else int(window),
        layer_types=layer_types,
        param_dtype=dtype,
        compute_dtype=dtype,
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        pad_token_id=raw.get("pad_token_id"),
    )
