"""GPU/TPU readiness: train-step MFU and decode memory bandwidth of a random-init Llama-style model in bfloat16.

Goals: MFU >= 45% for the train step, and decode at >= 70% of the device's HBM bandwidth.

Train step: ``make_algorithm_train_step`` with the ``sft`` loss (every token after the first supervised), AdamW
(``make_optimizer``: lr 1e-5, weight decay 0.01, clipping at 1.0), ``param_dtype = compute_dtype = "bfloat16"``
and float32 master weights (``ParamsSpec.of_model(config).with_master_dtype("float32")``, docs/DTYPES.md), on a
mesh over every local device (``--rules fsdp`` or ``dp``), random token ids ``[B, T]``. tokens/s = B*T / step time.

Model FLOPs (``train_flops_per_token``), PaLM's convention (Chowdhery et al., 2022, "PaLM", arXiv:2204.02311,
appendix B): ``6 N + 12 L T d_attn`` per token, where ``N`` counts every parameter except the embedding table (a
lookup, no matmul) and counts the ``D x V`` output projection also when it is the tied embedding table (the RMSNorm
scales, ``2 L D + D``, are included: negligible), ``L`` is the layers, ``T`` the sequence length and
``d_attn = H * Dh``. Like PaLM, the causal mask is not used to halve the attention term, all
``B * T`` tokens count (also the first, which has no loss), and recomputation (``--remat``) adds nothing: MFU is
model FLOP/s over the peak bfloat16 dense FLOP/s of the devices (``DEVICE_PEAKS``, keyed by
``jax.devices()[0].device_kind``; ``--peak-tflops`` for another device). On a device not in the table (a CPU) MFU
is null.

Decode: the native rollout engine's decode path (``feynrl_jax.rollout.decode.decode_dispatch``, jitted with the
state donated, ``--dispatch-steps`` tokens per dispatch in one ``lax.scan``, sampling at temperature 1) on
per-layer bfloat16 params and a per-layer KV cache (the engine's layout, ``unstack_layers``), on one device.
``--decode-batch`` rows each start a dispatch at position ``--context`` of a cache of ``context + dispatch_steps``
positions. Per-token step time = dispatch time / dispatch steps; tokens/s = decode batch / step time.

Bytes per decode step (``decode_bytes_per_step``): the weights (every parameter once, except the untied embedding
table, of which only the B looked-up rows count) plus the whole KV cache (keys and values of every layer and every
one of the ``S`` cache positions: attention reads all ``S`` and masks the positions beyond each row). Cache writes,
the ``[B, V]`` logits and sampling are not counted. The fraction is bytes / step time over the device's HBM
bandwidth (``DEVICE_PEAKS``; ``--hbm-gbps`` for another device).

Timing: every measured call is followed by ``jax.block_until_ready``; the first ``--warmup`` calls (the first one
compiles) are excluded and the median of the next ``--steps`` is reported.

Only jax, optax, numpy (with what they require) and the standard library are imported, so it runs on a plain
``jax[cuda]`` image from a checkout of this repository, installed or not: tests/test_bench_gpu.py runs it with
every other installed package blocked, orbax and the project's other dependencies included.

Run (on a GPU or TPU host):
    python benchmarks/bench_gpu.py --preset 1b --json runs/bench_gpu.json
    python benchmarks/bench_gpu.py --tiny  # a tiny model, on a CPU in seconds: a smoke run, its figures mean nothing
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib.util
import json
import math
import os
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO_ROOT not in sys.path:
    sys.path.insert(0, REPO_ROOT)

import feynrl_jax  # noqa: E402

if importlib.util.find_spec("feynrl_jax.losses") is None:
    # Not installed: losses/, rollout/ and sharding/ are the feynrl_jax.* subpackages of the same names
    # (pyproject.toml's package-dir), found through the package's search path.
    feynrl_jax.__path__.append(REPO_ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from feynrl_jax.losses import ALGORITHMS, TrainBatch  # noqa: E402
from feynrl_jax.models import ModelConfig, cache_dtype, init_params, param_shapes, unstack_layers  # noqa: E402
from feynrl_jax.rollout.decode import decode_dispatch  # noqa: E402
from feynrl_jax.rollout.slots import init_state  # noqa: E402
from feynrl_jax.sharding import RULES, make_mesh  # noqa: E402
from feynrl_jax.train.optimizer import make_optimizer  # noqa: E402
from feynrl_jax.train.step import ParamsSpec, make_algorithm_train_step  # noqa: E402

GOAL_MFU = 0.45
GOAL_BANDWIDTH_FRACTION = 0.70

_LLAMA = dict(architecture="llama", vocab_size=32000, rms_norm_eps=1e-5, rope_theta=10000.0)
PRESETS: dict[str, dict] = {
    # Llama-style shapes, untied embeddings; the parameter counts are printed (param_count).
    "0.5b": dict(
        _LLAMA, hidden_size=1024, intermediate_size=5120, num_layers=24, num_heads=8, num_kv_heads=4, head_dim=128
    ),
    "1b": dict(
        _LLAMA, hidden_size=2048, intermediate_size=7168, num_layers=16, num_heads=16, num_kv_heads=8, head_dim=128
    ),
    "tiny": dict(
        _LLAMA,
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
    ),
}

# Run sizes: a GPU/TPU run, and the --tiny smoke run. Flags override single values.
RUN_SIZES = {
    "full": dict(batch=8, seq=2048, decode_batch=64, context=1024, dispatch_steps=16, steps=10),
    "tiny": dict(batch=2, seq=32, decode_batch=4, context=16, dispatch_steps=4, steps=3),
}

DEVICE_PEAKS: dict[str, tuple[str, float, float]] = {
    # jax.devices()[0].device_kind: (name, peak bfloat16 dense FLOP/s, HBM bytes/s), from the vendors' data sheets.
    "NVIDIA H100 80GB HBM3": ("H100 SXM", 989.4e12, 3.35e12),
    "NVIDIA H100 PCIe": ("H100 PCIe", 756e12, 2.0e12),
    "NVIDIA H200": ("H200", 989.4e12, 4.8e12),
    "NVIDIA A100-SXM4-80GB": ("A100 80GB", 312e12, 2.04e12),
    "NVIDIA A100 80GB PCIe": ("A100 80GB PCIe", 312e12, 1.935e12),
    "NVIDIA A100-SXM4-40GB": ("A100 40GB", 312e12, 1.555e12),
    "NVIDIA A100-PCIE-40GB": ("A100 40GB", 312e12, 1.555e12),
    "TPU v4": ("TPU v4", 275e12, 1.2e12),
    "TPU v5 lite": ("TPU v5e", 197e12, 0.819e12),
    "TPU v5e": ("TPU v5e", 197e12, 0.819e12),
    "TPU v5": ("TPU v5p", 459e12, 2.765e12),
    "TPU v5p": ("TPU v5p", 459e12, 2.765e12),
    "TPU v6 lite": ("TPU v6e", 918e12, 1.64e12),
    "TPU v6e": ("TPU v6e", 918e12, 1.64e12),
}


def model_config(preset: str) -> ModelConfig:
    """The preset's model in bfloat16 (params and compute)."""
    return ModelConfig(**PRESETS[preset], param_dtype="bfloat16", compute_dtype="bfloat16")


def param_count(config: ModelConfig) -> int:
    """All parameters (``param_shapes``: the leaves ``init_params`` makes)."""
    return sum(math.prod(shape) for shape in jax.tree.leaves(param_shapes(config), is_leaf=_is_shape))


def matmul_param_count(config: ModelConfig) -> int:
    """``N`` of the FLOP count: every parameter but the embedding table, the output projection (``D x V``) included.

    Untied, that is every parameter except the embedding table; tied, every parameter (the table is the projection).
    """
    if config.tie_word_embeddings:
        return param_count(config)
    return param_count(config) - config.vocab_size * config.hidden_size


def train_flops_per_token(config: ModelConfig, seq_len: int) -> int:
    """Model FLOPs of one training token (forward and backward): ``6 N + 12 L T d_attn`` (PaLM, appendix B).

    Args:
        config: the model.
        seq_len: T, the length of every training sequence.

    Returns:
        FLOPs per token; causal masking does not halve the attention term (PaLM's convention).
    """
    d_attn = config.num_heads * config.head_dim
    return 6 * matmul_param_count(config) + 12 * config.num_layers * seq_len * d_attn


def decode_bytes_per_step(config: ModelConfig, batch: int, cache_len: int) -> dict[str, int]:
    """Bytes one decode step reads from memory: the weights once and the whole KV cache.

    Args:
        config: the model (weights in ``param_dtype``, cache in ``cache_dtype(config)``: the compute dtype on an
            accelerator, float32 on a CPU).
        batch: B, rows decoding one token each.
        cache_len: S, cache positions the step attends to (all of them are read; the mask is applied after).

    Returns:
        ``{"weights": ..., "kv_cache": ..., "total": ...}``: every weight once, except an untied embedding table, of
        which only the B looked-up rows; keys and values of every layer, ``[B, K, S, Dh]`` each.
    """
    param_bytes = jnp.dtype(config.param_dtype).itemsize
    embedding = config.vocab_size * config.hidden_size
    weights = param_count(config)
    if not config.tie_word_embeddings:
        weights += batch * config.hidden_size - embedding
    kv = 2 * config.num_layers * batch * config.num_kv_heads * config.head_dim * cache_len
    kv_bytes = kv * cache_dtype(config).itemsize
    return {"weights": weights * param_bytes, "kv_cache": kv_bytes, "total": weights * param_bytes + kv_bytes}


def device_peaks(device_kind: str, *, peak_tflops: float | None, hbm_gbps: float | None) -> dict:
    """Peak bfloat16 dense FLOP/s and HBM bytes/s of one device, each from its flag, else ``DEVICE_PEAKS``, else None.

    Returns:
        ``{"name", "flops_per_s", "flops_source", "hbm_bytes_per_s", "hbm_source"}``; a source is "table", the flag's
        name, or None (unknown).
    """
    name, flops, hbm = DEVICE_PEAKS.get(device_kind, (None, None, None))
    out = {
        "name": name,
        "flops_per_s": flops,
        "flops_source": name and "table",
        "hbm_bytes_per_s": hbm,
        "hbm_source": name and "table",
    }
    if peak_tflops is not None:
        out.update(flops_per_s=peak_tflops * 1e12, flops_source="--peak-tflops")
    if hbm_gbps is not None:
        out.update(hbm_bytes_per_s=hbm_gbps * 1e9, hbm_source="--hbm-gbps")
    return out


def time_calls(call, warmup: int, steps: int) -> tuple[float, list[float]]:
    """Times ``call()`` (which blocks on its result): returns (the first call's seconds, the timed calls')."""
    times = []
    for _ in range(warmup + steps):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return times[0], times[warmup:]


def _is_shape(x) -> bool:
    return isinstance(x, tuple) and all(isinstance(i, int) for i in x)


def sft_batch(rng: np.random.Generator, vocab_size: int, batch: int, seq: int) -> TrainBatch:
    """Random token ids, every token after the first supervised."""
    tokens = rng.integers(0, vocab_size, (batch, seq)).astype(np.int32)
    mask = np.ones((batch, seq), np.float32)
    mask[:, 0] = 0.0
    zeros = np.zeros((batch, seq), np.float32)
    positions = np.tile(np.arange(seq, dtype=np.int32), (batch, 1))
    return TrainBatch(tokens, positions, np.ones((batch, seq), np.int32), mask, zeros, zeros)


def bench_train(config: ModelConfig, *, batch: int, seq: int, remat: str, rules: str, warmup: int, steps: int) -> dict:
    """Median train-step time over the mesh of every local device, and the figures derived from it."""
    devices = jax.local_devices()
    mesh = make_mesh(1, -1, 1, devices=devices)
    optimizer, _ = make_optimizer(1e-5, schedule="constant", weight_decay=0.01, max_grad_norm=1.0)
    train_step = make_algorithm_train_step(
        ALGORITHMS["sft"],
        optimizer,
        mesh,
        RULES[rules],
        config=config,
        remat=remat,
        params_spec=ParamsSpec.of_model(config).with_master_dtype("float32"),
        check_updated=False,  # as the runs build it on make_optimizer's AdamW
    )
    state = train_step.init_state(init_params(config, jax.random.key(0)))
    data = train_step.place_batch(sft_batch(np.random.default_rng(0), config.vocab_size, batch, seq))
    holder = {"state": state}

    def step():
        holder["state"], holder["metrics"] = train_step(holder["state"], data)
        jax.block_until_ready(holder)

    first, times = time_calls(step, warmup, steps)
    step_time = float(np.median(times))
    flops_per_token = train_flops_per_token(config, seq)
    return {
        "batch": batch,
        "seq": seq,
        "remat": remat,
        "rules": rules,
        "devices": len(devices),
        "first_step_s": first,
        "step_times_s": times,
        "step_time_s": step_time,
        "tokens_per_s": batch * seq / step_time,
        "flops_per_token": flops_per_token,
        "flops_per_step": flops_per_token * batch * seq,
        "achieved_flops_per_s": flops_per_token * batch * seq / step_time,
        "loss": float(holder["metrics"]["train/loss"].value),
    }


def bench_decode(config: ModelConfig, *, batch: int, context: int, dispatch_steps: int, warmup: int, steps: int):
    """Median per-token decode step of the engine's decode dispatch on one device, and the bytes it reads."""
    cache_len = context + dispatch_steps
    params = jax.jit(unstack_layers)(init_params(config, jax.random.key(1)))
    dispatch = jax.jit(
        functools.partial(decode_dispatch, config=config, steps=dispatch_steps, greedy=False, top_k=0, use_top_p=False),
        donate_argnums=1,
    )
    sampling_args = (jnp.zeros((0,), jnp.int32), jnp.float32(1.0), jnp.float32(1.0), jnp.int32(0))
    tokens = np.random.default_rng(1).integers(0, config.vocab_size, (batch,)).astype(np.int32)
    holder = {"state": init_state(config, batch, cache_len)}

    def run():
        # Every dispatch starts at position `context` with every row active (fresh arrays: the state is donated).
        state = holder["state"]._replace(
            tokens=jnp.asarray(tokens),
            positions=jnp.full((batch,), context, jnp.int32),
            active=jnp.ones((batch,), bool),
            generated=jnp.zeros((batch,), jnp.int32),
            max_new=jnp.full((batch,), 2**30, jnp.int32),
            keys=jnp.asarray(np.arange(2 * batch, dtype=np.uint32).reshape(batch, 2)),
        )
        holder["state"], *outputs = dispatch(params, state, *sampling_args)
        jax.block_until_ready((holder["state"], outputs))

    first, times = time_calls(run, warmup, steps)
    step_times = [t / dispatch_steps for t in times]
    step_time = float(np.median(step_times))
    read = decode_bytes_per_step(config, batch, cache_len)
    return {
        "batch": batch,
        "context": context,
        "cache_len": cache_len,
        "dispatch_steps": dispatch_steps,
        "first_dispatch_s": first,
        "step_times_s": step_times,
        "step_time_s": step_time,
        "tokens_per_s": batch / step_time,
        "weight_bytes": read["weights"],
        "kv_cache_bytes": read["kv_cache"],
        "bytes_per_step": read["total"],
        "achieved_bytes_per_s": read["total"] / step_time,
    }


def _goal(value: float | None, target: float) -> dict:
    return {"target": target, "value": value, "met": None if value is None else bool(value >= target)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=("0.5b", "1b"), default="1b")
    parser.add_argument("--tiny", action="store_true", help="a tiny model and run (CPU smoke run); overrides --preset")
    parser.add_argument("--batch", type=int, help="train batch B (default 8; --tiny 2)")
    parser.add_argument("--seq", type=int, help="train sequence length T (default 2048; --tiny 32)")
    parser.add_argument("--remat", choices=("none", "full", "dots"), default="dots", help="train-step remat policy")
    parser.add_argument("--rules", choices=("fsdp", "dp"), default="fsdp", help="sharding of the train state")
    parser.add_argument("--decode-batch", type=int, help="rows decoding together (default 64; --tiny 4)")
    parser.add_argument("--context", type=int, help="position each decode dispatch starts at (default 1024)")
    parser.add_argument("--dispatch-steps", type=int, help="decode steps per jitted dispatch (default 16)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls first (the first one compiles)")
    parser.add_argument("--steps", type=int, help="timed calls, train steps and decode dispatches (default 10)")
    parser.add_argument("--peak-tflops", type=float, help="peak bf16 dense TFLOP/s of one device (else the table)")
    parser.add_argument("--hbm-gbps", type=float, help="HBM bandwidth of one device, GB/s (else the table)")
    parser.add_argument("--json", help="write every figure to this JSON file")
    args = parser.parse_args(argv)
    if args.warmup < 1:
        parser.error("--warmup must be >= 1 (the first call compiles)")

    preset = "tiny" if args.tiny else args.preset
    sizes = dict(RUN_SIZES["tiny" if args.tiny else "full"])
    sizes.update({key: value for key in sizes if (value := getattr(args, key)) is not None})
    config = model_config(preset)
    device = jax.devices()[0]
    peaks = device_peaks(device.device_kind, peak_tflops=args.peak_tflops, hbm_gbps=args.hbm_gbps)
    n_params = param_count(config)
    print(f"device: {device.device_kind} x {jax.local_device_count()} ({jax.default_backend()}), jax {jax.__version__}")
    print(
        f"model: preset {preset}, {n_params:,} parameters ({matmul_param_count(config):,} in the FLOP count's N), "
        f"L={config.num_layers} D={config.hidden_size} F={config.intermediate_size} H={config.num_heads} "
        f"K={config.num_kv_heads} Dh={config.head_dim} V={config.vocab_size}, bfloat16, float32 masters",
        flush=True,
    )

    train = bench_train(
        config,
        batch=sizes["batch"],
        seq=sizes["seq"],
        remat=args.remat,
        rules=args.rules,
        warmup=args.warmup,
        steps=sizes["steps"],
    )
    peak_train = None if peaks["flops_per_s"] is None else peaks["flops_per_s"] * train["devices"]
    train["peak_flops_per_s"] = peak_train
    train["mfu"] = None if peak_train is None else train["achieved_flops_per_s"] / peak_train
    print(
        f"train: B={train['batch']} T={train['seq']} remat={train['remat']} rules={train['rules']} over "
        f"{train['devices']} device(s); first step {train['first_step_s']:.2f} s; median step "
        f"{train['step_time_s'] * 1e3:.1f} ms; {train['tokens_per_s']:,.0f} tokens/s; "
        f"{train['flops_per_token'] / 1e9:.3f} GFLOP/token; {train['achieved_flops_per_s'] / 1e12:.3f} TFLOP/s; "
        f"MFU {_percent(train['mfu'])}; loss {train['loss']:.4f}",
        flush=True,
    )

    decode = bench_decode(
        config,
        batch=sizes["decode_batch"],
        context=sizes["context"],
        dispatch_steps=sizes["dispatch_steps"],
        warmup=args.warmup,
        steps=sizes["steps"],
    )
    hbm = peaks["hbm_bytes_per_s"]
    decode["hbm_bytes_per_s"] = hbm
    decode["bandwidth_fraction"] = None if hbm is None else decode["achieved_bytes_per_s"] / hbm
    print(
        f"decode: B={decode['batch']} at positions {decode['context']}..{decode['cache_len'] - 1} of S="
        f"{decode['cache_len']}, {decode['dispatch_steps']} steps/dispatch, 1 device; median step "
        f"{decode['step_time_s'] * 1e3:.2f} ms; {decode['tokens_per_s']:,.0f} tokens/s; reads "
        f"{decode['weight_bytes'] / 2**20:.1f} MiB weights + {decode['kv_cache_bytes'] / 2**20:.1f} MiB KV cache "
        f"= {decode['achieved_bytes_per_s'] / 1e9:.2f} GB/s, {_percent(decode['bandwidth_fraction'])} of HBM",
        flush=True,
    )

    notes = []
    unknown = [
        f"{figure} is null (pass {flag})"
        for figure, flag, peak in (
            ("MFU", "--peak-tflops", peaks["flops_per_s"]),
            ("the bandwidth fraction", "--hbm-gbps", hbm),
        )
        if peak is None
    ]
    if unknown:
        notes.append(f"device kind {device.device_kind!r} is not in DEVICE_PEAKS: {'; '.join(unknown)}")
    if args.tiny:
        notes.append("--tiny: a smoke run of a tiny model; its figures say nothing about a GPU")
    goals = {
        "mfu": _goal(train["mfu"], GOAL_MFU),
        "decode_bandwidth_fraction": _goal(decode["bandwidth_fraction"], GOAL_BANDWIDTH_FRACTION),
    }
    for name, goal in goals.items():
        verdict = {None: "unknown (no peak)", True: "met", False: "not met"}[goal["met"]]
        print(f"goal {name} >= {goal['target']:.0%}: {_percent(goal['value'])}, {verdict}")
    for note in notes:
        print(f"note: {note}")

    result = {
        "device_kind": device.device_kind,
        "platform": jax.default_backend(),
        "device_count": jax.local_device_count(),
        "jax_version": jax.__version__,
        "preset": preset,
        "model": {**dataclasses.asdict(config), "params": n_params, "flop_params": matmul_param_count(config)},
        "peaks": peaks,
        "train": train,
        "decode": decode,
        "goals": goals,
        "notes": notes,
    }
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.json}")
    return result


def _percent(value: float | None) -> str:
    return "null" if value is None else f"{value:.1%}"


if __name__ == "__main__":
    main()
