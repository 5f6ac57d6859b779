"""Micro-batches sized by memory: how many sequences one forward/backward pass of an RL update may hold.

A train step's peak memory is the state (params, optimizer moments, the gradient accumulator) plus the
activations the backward pass keeps, which grow with the tokens of one micro-batch. With `train.micro_batch_size
= 0` the RL trainer picks the micro-batch here: the most sequences whose token slots fit `train.micro_batch_tokens`,
or, when that is 0 too, whose estimated activations fit a share of the memory free on the training device (the
host's `MemAvailable` and cgroup limit on CPU, `memory_stats()` on an accelerator). A micro-batch that cannot fit
even at its smallest, or an explicit `train.micro_batch_size` whose estimate exceeds the free memory, is an error
naming the key to lower, instead of a process the kernel's OOM killer ends.

The activation estimate (`activation_bytes_per_token`) counts what XLA keeps per token and layer for the backward
pass in the compute dtype: about `8 D + 7 I` values for the projections, norms and MLP, and `2 H W` for attention
scores and probabilities over a row of `W` columns. With `model.remat` "dots" or "full" a layer keeps only what the
policy saves and one layer is recomputed at a time. The output projection's logits live one chunk at a time
(`models.logprobs`: all rows, at most 256 columns and 1,024 token slots on each batch shard), about `3 V` float32
values per token slot of the chunk (`logits_bytes`), which stops growing with the micro-batch's tokens once a shard
holds a few rows. The constants were fitted to XLA:CPU's `memory_analysis()` of the SmolLM2-135M train step
(float32, rows of 128 and 256 columns); `tests/test_packed_units.py` checks the estimate against `memory_analysis()`
of small models.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import jax
import jax.numpy as jnp
import numpy as np

from feynrl_jax.config.derived import BatchPlan
from feynrl_jax.models import ModelConfig
from feynrl_jax.models.logprobs import CHUNK_TOKENS, chunk_positions
from feynrl_jax.train.step import ParamsSpec

log = logging.getLogger(__name__)

# Share of the free memory that an automatic micro-batch's activations may take. On a CPU host the trainer shares
# the memory with rollout workers, reward processes and Ray's object store; an accelerator is the trainer's own.
HOST_SHARE = 0.4
DEVICE_SHARE = 0.7


def activation_bytes_per_token(config: ModelConfig, width: int) -> int:
    """Estimated bytes a train step's backward pass keeps per token of a micro-batch of rows `width` wide in its
    layers (the output projection's logits apart: `logits_bytes`)."""
    c = config
    size = jnp.dtype(c.compute_dtype).itemsize
    layer = 8 * c.hidden_size + 7 * c.intermediate_size + 2 * c.num_heads * width
    remat = c.resolved_remat()
    if remat == "none":
        kept = c.num_layers * layer
    else:  # the saved layer inputs ("full") or projection outputs ("dots"), plus one layer recomputed
        saved = c.hidden_size if remat == "full" else 4 * c.hidden_size + 2 * c.intermediate_size
        kept = c.num_layers * saved + layer
    return int(kept * size)


def logits_bytes(config: ModelConfig, rows: int, width: int, shards: int = 1) -> int:
    """Estimated bytes of the output projection's chunk of float32 logits, all shards together, in a train step's pass
    over `rows` rows of `width` columns split over `shards` batch shards (`models.logprobs.chunk_positions`, at most
    `CHUNK_TOKENS` token slots on each shard)."""
    return 3 * config.vocab_size * 4 * rows * chunk_positions(rows, width, chunk_tokens=CHUNK_TOKENS * shards)


def state_bytes(config: ModelConfig) -> int:
    """Estimated bytes of the train state and step buffers: the params, and for each trained weight (the adapters
    alone under LoRA, `ParamsSpec.trainable`) two optimizer moments and two float32 gradient buffers; where the model
    computes in a narrower dtype than its params, the copy of the layer weights `forward` casts once per pass (and
    that keeps through the backward pass). A step that adds the layers' gradient into its accumulator in place
    (`TrainStep.sinks_layer_grads`) holds about one gradient buffer of the layers less: the estimate errs high."""
    spec = ParamsSpec.of_model(config)
    leaves = jax.tree_util.tree_leaves_with_path(spec.shape)
    params = sum(x.size * x.dtype.itemsize for _, x in leaves)
    trained = sum(x.size for path, x in leaves if spec.trainable is None or spec.trainable(path))
    compute = jnp.dtype(config.compute_dtype).itemsize
    cast = sum(x.size * compute for _, x in leaves if x.dtype.itemsize > compute)
    return int(params + trained * 4 * 4 + cast)


def _host_free_bytes() -> int:
    """`MemAvailable`, capped by the cgroup's remaining limit where one is set (its usage less the inactive page
    cache, which the kernel reclaims first)."""
    free = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    free = int(line.split()[1]) * 1024
    except OSError:
        pass
    if free is None:
        free = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read().strip())
        with open("/sys/fs/cgroup/memory.stat") as f:  # page cache the kernel reclaims before it kills
            stat = dict(line.split() for line in f)
        if limit != "max":
            free = min(free, int(limit) - used + int(stat.get("inactive_file", 0)))
    except (OSError, ValueError):
        pass
    return max(int(free), 0)


def free_bytes(device: jax.Device | None = None) -> tuple[int, float]:
    """`(free bytes, share an automatic micro-batch may use)` of `device` (default: the first local device); with
    several processes, the least of theirs (a collective every process calls)."""
    device = device or jax.local_devices()[0]
    stats = None
    if device.platform != "cpu":
        try:
            stats = device.memory_stats()
        except Exception:  # noqa: BLE001 - backends without memory statistics
            stats = None
    if stats and "bytes_limit" in stats:
        free, share = int(stats["bytes_limit"] - stats.get("bytes_in_use", 0)), DEVICE_SHARE
    else:
        free, share = _host_free_bytes(), HOST_SHARE
    if jax.process_count() > 1:  # every process must choose the same micro-batch: the least free memory decides
        from jax.experimental import multihost_utils

        mib = multihost_utils.process_allgather(np.asarray([free // 2**20], np.int32))  # int32 without x64
        free = int(np.min(mib)) * 2**20
    return free, share


@dataclasses.dataclass(frozen=True)
class MicroBatchChoice:
    """The RL micro-batch the budget allows.

    Attributes:
        plan: the batch plan with `micro_batch_size` and `grad_accum_steps` set.
        budget_tokens: the token slots one micro-batch may hold (0 when `train.micro_batch_size` was given).
        estimated_bytes: estimated peak of the train step (state plus one micro-batch's activations).
        free_bytes: free memory on the training device when the trainer started.
    """

    plan: BatchPlan
    budget_tokens: int
    estimated_bytes: int
    free_bytes: int


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def rl_micro_batch(
    plan: BatchPlan,
    model: ModelConfig,
    *,
    micro_batch_size: int,
    micro_batch_tokens: int,
    seq_len: int,
    group_size: int,
    shared_width: int,
    shards: int,
    min_micro_batches: int = 1,
    whole_groups: bool = False,
    free: tuple[int, float] | None = None,
) -> MicroBatchChoice:
    """The RL update's micro-batch (sequences per forward/backward pass) from the config's keys and free memory.

    Candidates are the divisors of the mini-batch that the batch shards split evenly. A candidate of `d`
    sequences holds `d x seq_len` token slots in the row layout and, when it is whole groups on every shard,
    `d / n` rows of `shared_width` in the shared-prefix layout; the larger of the two counts.

    Args:
        plan: the config's batch plan (`config.derived.batch_plan`).
        model: the policy's model config.
        micro_batch_size: `train.micro_batch_size` (> 0: used as it is, checked against free memory).
        micro_batch_tokens: `train.micro_batch_tokens` (> 0: the token budget; 0: from free memory).
        seq_len: `data.max_seq_len`, the row layout's width.
        group_size: `rollout.n_samples`.
        shared_width: the shared-prefix layout's width (`max_prompt_len + n * max_new_tokens`).
        shards: the mesh's batch shards (`data x fsdp`).
        min_micro_batches: from free memory, split the mini-batch into at least this many micro-batches where the
            shards allow (packed updates skip empty micro-batches, so a finer split wastes fewer slots).
        whole_groups: only micro-batches of whole groups on every shard, where the mini-batch has any (so the
            shared-prefix layout stays possible).
        free: `(free bytes, usable share)`; default `free_bytes()`.

    Raises:
        ValueError: naming `train.micro_batch_size` when its estimate exceeds the free memory, or
            `train.micro_batch_tokens` / `data.max_seq_len` and `model.remat` when the smallest micro-batch does
            not fit its budget.
    """
    free_total, share = free if free is not None else free_bytes()
    fixed = state_bytes(model)

    def slots(d: int) -> tuple[int, int]:
        """(token slots, widest row) of a micro-batch of `d` sequences."""
        rows = (d * seq_len, seq_len)
        if group_size >= 2 and d % (group_size * shards) == 0:
            shared = (d // group_size * shared_width, shared_width)
            return max(rows, shared)
        return rows

    def activations(d: int) -> int:
        tokens, width = slots(d)
        return tokens * activation_bytes_per_token(model, width) + logits_bytes(model, tokens // width, width, shards)

    def estimate(d: int) -> int:
        return fixed + activations(d)

    mini = plan.mini_batch_size
    # Suggested only where it would change something ("auto" is already "full" on a CPU in bfloat16 or with LoRA).
    remat = "" if model.resolved_remat() == "full" else ", or set model.remat='full'"
    if micro_batch_size > 0:
        need = estimate(micro_batch_size)
        if need > free_total:
            raise ValueError(
                f"train.micro_batch_size={micro_batch_size}: a train step of {micro_batch_size} sequences of up to "
                f"{seq_len} tokens needs about {_gib(need)} (estimated), more than the {_gib(free_total)} free; lower "
                f"train.micro_batch_size (or set it to 0 to size micro-batches by memory){remat}"
            )
        return MicroBatchChoice(plan, 0, need, free_total)
    candidates = [d for d in range(mini, 0, -1) if mini % d == 0 and d % shards == 0]
    grouped = [d for d in candidates if d % (group_size * shards) == 0]
    if whole_groups and group_size >= 2 and grouped:
        candidates = grouped
    if micro_batch_tokens > 0:
        budget = micro_batch_tokens
        fits = [d for d in candidates if slots(d)[0] <= budget]
        if not fits:
            raise ValueError(
                f"train.micro_batch_tokens={budget} is smaller than the smallest micro-batch: {candidates[-1]} "
                f"sequence(s) ({slots(candidates[-1])[0]} token slots, one row per batch shard); raise it"
            )
    else:
        allowed = int(free_total * share) - fixed
        fits = [d for d in candidates if activations(d) <= allowed]
        fine = [d for d in fits if d * min_micro_batches <= mini]
        fits = fine or fits[-1:]
        tokens, width = slots(candidates[-1])
        per_token = max(activation_bytes_per_token(model, width), 1)
        budget = max(allowed - logits_bytes(model, tokens // width, width, shards), 0) // per_token
        if not fits:
            raise ValueError(
                f"the smallest RL micro-batch ({candidates[-1]} sequence(s) of up to {seq_len} tokens) needs about "
                f"{_gib(estimate(candidates[-1]))} (estimated), more than {share:.0%} of the {_gib(free_total)} "
                f"free; lower data.max_seq_len (or rollout.max_new_tokens){remat}, or set train.micro_batch_tokens "
                "to accept the risk"
            )
    d = fits[0]
    log.info(
        "RL micro-batch: %d of %d sequences (%d token slots of a budget of %d; estimated peak %s of %s free)",
        d, mini, slots(d)[0], budget, _gib(estimate(d)), _gib(free_total),
    )  # fmt: skip
    chosen = dataclasses.replace(plan, micro_batch_size=d, grad_accum_steps=mini // d)
    return MicroBatchChoice(chosen, int(budget), estimate(d), free_total)
