"""`feynrl-jax export RUN_DIR --out DIR`: a run's latest checkpoint as a Hugging Face folder.

The params of the newest committed orbax step are read on the host (no accelerator, no optimizer state kept),
the model config is rebuilt from the config saved with the checkpoint, and `feynrl_jax.checkpoints.export_hf`
writes `config.json`, safetensors and the run's tokenizer files, which `transformers` loads with
`AutoModelForCausalLM.from_pretrained(DIR)`. The run folder is only read, so a run may keep training in it.

A LoRA run (`model.lora.rank > 0`) exports the merged weights (`W + (alpha / r) A B`) as that plain folder, and its
adapters alone in PEFT's format in `DIR/lora_adapter` (`peft.PeftModel.from_pretrained(base_model, DIR/lora_adapter)`
gives the same logits; `model.lora.init_from` continues training from it).
"""

from __future__ import annotations

import os
from typing import Any

from ml_collections import ConfigDict

from feynrl_jax.checkpoints import export_hf
from feynrl_jax.checkpoints.peft_adapters import export_peft
from feynrl_jax.checkpoints.train_state import TrainCheckpointer
from feynrl_jax.train import run_setup

ADAPTER_FOLDER = "lora_adapter"
"""Sub-folder of a LoRA run's export holding the adapters alone, in PEFT's format."""


def _params_of(state: Any, where: str) -> Any:
    params = state.get("params") if isinstance(state, dict) else getattr(state, "params", None)
    if params is None:
        raise ValueError(f"checkpoint {where} holds no 'params' in its train state")
    return params


def export_run(run_dir: str | os.PathLike, out_dir: str | os.PathLike, *, step: int | None = None) -> str:
    """Writes the params of `run_dir`'s latest (or `step`'s) checkpoint as a Hugging Face folder.

    Args:
        run_dir: a run folder written by `feynrl-jax train` (with `checkpoints/`).
        out_dir: the destination folder (replaced atomically if it exists).
        step: the checkpoint step; None: the newest committed one.

    Returns:
        The destination folder.

    Raises:
        FileNotFoundError: the run folder has no committed checkpoint (or not `step`).
        ValueError: the checkpoint's params do not match the model its config describes.
    """
    run_dir = os.fspath(run_dir)
    with TrainCheckpointer(run_dir, save_every=1, keep=1, read_only=True) as checkpointer:
        step = checkpointer.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"run folder {run_dir} holds no committed checkpoint to export")
        saved = checkpointer.restore_config(step)
        state = checkpointer.restore_state_unsharded(step)
    where = os.path.join(run_dir, "checkpoints", str(step))
    params = _params_of(state, where)
    model_cfg = ConfigDict(saved["model"])
    source = run_setup.resolve_model_source(model_cfg, run_dir)
    tokenizer = run_setup.load_run_tokenizer(source)
    model_config = run_setup.model_config(model_cfg, source, tokenizer)
    _check_shapes(params, model_config, where)
    out = export_hf(
        params,
        model_config,
        out_dir,
        tokenizer_dir=source.tokenizer_dir,
        extra_config={"feynrl_jax": {"run_dir": os.path.abspath(run_dir), "step": int(step)}},
    )
    if model_config.lora_rank:
        base = os.path.abspath(source.weights_dir) if source.weights_dir else ""
        export_peft(params, model_config, os.path.join(out, ADAPTER_FOLDER), base_model=base)
    return out


def _check_shapes(params: Any, model_config: Any, where: str) -> None:
    import jax

    from feynrl_jax.models import init_params

    want = jax.eval_shape(lambda key: init_params(model_config, key), jax.random.key(0))
    got_leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    want_leaves = dict(
        (jax.tree_util.keystr(path), leaf.shape) for path, leaf in jax.tree_util.tree_flatten_with_path(want)[0]
    )
    got = {jax.tree_util.keystr(path): tuple(leaf.shape) for path, leaf in got_leaves}
    if got.keys() != want_leaves.keys():
        missing, extra = sorted(want_leaves.keys() - got.keys()), sorted(got.keys() - want_leaves.keys())
        raise ValueError(f"checkpoint {where}: params tree differs from the model (missing {missing}, extra {extra})")
    for name, shape in got.items():
        if shape != tuple(want_leaves[name]):
            raise ValueError(
                f"checkpoint {where}: tensor params{name} has shape {shape}, the model needs {want_leaves[name]}"
            )
