"""Guards against weights that silently break a run: non-finite updates, runs that skip every step, NaN or
integer weights at load (GGUF, orbax resume; safetensors in test_checkpoints), tokenizers larger than the model.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from ml_collections import ConfigDict

from feynrl_jax.checkpoints import CheckpointError, convert_gguf, export_hf, tensor_mappings
from feynrl_jax.checkpoints.gguf_import import _GGUF_NAMES
from feynrl_jax.checkpoints.train_state import RunProgress, TrainCheckpointer
from feynrl_jax.config.base import base_config
from feynrl_jax.config.errors import ConfigError
from feynrl_jax.errors import EXIT_BAD_INPUT, EXIT_RUN_FAILED, InputError
from feynrl_jax.models import ModelConfig, init_params
from feynrl_jax.train import run_setup
from feynrl_jax.train.nonfinite import NonFiniteError, NonFiniteGuard, all_finite, check_restored_state
from feynrl_jax.train.state import create_train_state

CONFIG = ModelConfig(
    vocab_size=16, hidden_size=16, intermediate_size=32, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=8
)


def _initial_params():
    return jax.tree.map(np.asarray, jax.jit(init_params, static_argnums=0)(CONFIG, jax.random.key(0)))


# ---------------------------------------------------------------- the guard on the host


def _update(applied: int, streak: int, total: int) -> dict[str, int]:
    return {"train/step": applied, "train/nonfinite_streak": streak, "train/nonfinite_total": total}


def _config_keys(config: ConfigDict, prefix: str = "") -> set[str]:
    keys = set()
    for name, value in config.items():
        keys.add(prefix + name)
        if isinstance(value, ConfigDict):
            keys |= _config_keys(value, prefix + name + ".")
    return keys


def test_guard_messages_name_config_keys_that_exist():
    guard = NonFiniteGuard(max_consecutive=1)
    guard.check(_update(0, 1, 1))
    with pytest.raises(NonFiniteError) as err:
        guard.check(_update(0, 2, 2), step=2)
    assert err.value.exit_code == EXIT_RUN_FAILED
    keys = _config_keys(base_config())
    named = re.findall(r"\b[a-z_]+\.[a-z_]+(?:\.[a-z_]+)*", str(err.value))
    assert "optim.max_consecutive_nonfinite" in named, str(err.value)
    assert all(key in keys for key in named), (named, str(err.value))


def test_finish_fails_a_run_that_skipped_every_update_and_passes_one_that_applied_any():
    all_skipped = NonFiniteGuard(max_consecutive=3)
    for i in range(3):  # train.steps <= max_consecutive: the streak limit never trips
        all_skipped.check(_update(0, i + 1, i + 1), step=i + 1)
    with pytest.raises(NonFiniteError, match=r"every update of the run was skipped \(3 skipped"):
        all_skipped.finish()

    one_applied = NonFiniteGuard(max_consecutive=3)
    for metrics in (_update(0, 1, 1), _update(1, 0, 1), _update(1, 1, 2)):
        one_applied.check(metrics)
    one_applied.finish()

    # A resumed run whose updates before the checkpoint applied: its train/step says so.
    resumed = NonFiniteGuard(max_consecutive=3)
    resumed.check(_update(4, 1, 1))
    resumed.finish()
    NonFiniteGuard(max_consecutive=3).finish()  # nothing ran (resumed at the last step)

    critic = NonFiniteGuard(max_consecutive=3, model="critic")
    critic.check(_update(0, 1, 1))
    with pytest.raises(NonFiniteError, match="^critic: every update"):
        critic.finish()


def test_all_finite_reads_floating_leaves_and_skips_integer_counters():
    tree = {"w": jnp.ones((3, 2)), "count": jnp.zeros((), jnp.int32), "b": jnp.ones(2, jnp.bfloat16)}
    assert bool(jax.jit(all_finite)(tree, {"mu": jnp.zeros(4)}))
    assert not bool(jax.jit(all_finite)(tree, {"mu": jnp.array([0.0, jnp.inf])}))
    assert not bool(all_finite({**tree, "b": jnp.array([jnp.nan], jnp.bfloat16)}))
    assert bool(all_finite({}))


# ---------------------------------------------------------------- an orbax checkpoint with NaN params


def test_restored_state_with_nan_params_names_the_checkpoint_step(tmp_path):
    optimizer = optax.adam(1e-3)
    params = {"dense": {"kernel": np.ones((4, 3), np.float32)}, "norm": {"scale": np.ones(3, np.float32)}}
    state = create_train_state(params, optimizer)
    check_restored_state(state, "unused")  # finite: passes
    poisoned = dict(params, dense={"kernel": params["dense"]["kernel"].copy()})
    poisoned["dense"]["kernel"][1, 2] = np.nan
    progress = RunProgress(step=7, rng=jax.random.key(0), data_state={}, policy_version=7, config={})
    with TrainCheckpointer(str(tmp_path), save_every=1, keep=2, async_save=False) as checkpointer:
        checkpointer.save(create_train_state(poisoned, optimizer), progress, force=True)
        checkpointer.wait_until_finished()
        restored, progress = checkpointer.restore(jax.eval_shape(lambda: state))
        where = f"{checkpointer.directory}/{progress.step}"
    with pytest.raises(InputError) as err:
        check_restored_state(restored, where)
    assert err.value.exit_code == EXIT_BAD_INPUT
    assert where in str(err.value) and "params['dense']['kernel']" in str(err.value)


# ---------------------------------------------------------------- GGUF


def _write_gguf(path, poison: tuple[str, np.ndarray] | None = None) -> None:
    """A tiny llama GGUF (float32 tensors, no tokenizer) with tensor `poison[0]` replaced by `poison[1]`."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_embedding_length(CONFIG.hidden_size)
    writer.add_feed_forward_length(CONFIG.intermediate_size)
    writer.add_block_count(CONFIG.num_layers)
    writer.add_head_count(CONFIG.num_heads)
    writer.add_head_count_kv(CONFIG.num_kv_heads)
    writer.add_rope_dimension_count(CONFIG.head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(CONFIG.vocab_size)
    rng = np.random.default_rng(0)
    for m in tensor_mappings(CONFIG):
        for i in range(CONFIG.num_layers) if m.stacked else [None]:
            name = _GGUF_NAMES[m.hf_name].format(i=i)
            value = rng.normal(size=m.hf_shape).astype(np.float32)
            writer.add_tensor(name, poison[1] if poison and poison[0] == name else value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _nan_matrix(shape):
    value = np.zeros(shape, np.float32)
    value[0, 1] = np.nan
    return value


@pytest.mark.parametrize(
    "tensor, value, text",
    [
        ("blk.1.ffn_down.weight", _nan_matrix((16, 32)), "NaN or infinite"),
        ("blk.0.attn_v.weight", np.ones((8, 16), np.int32), "integer type I32"),
    ],
)
def test_gguf_with_bad_tensor_names_the_file_and_the_tensor(tmp_path, tensor, value, text):
    path = tmp_path / "tiny.gguf"
    _write_gguf(path, (tensor, value))
    with pytest.raises(CheckpointError) as err:
        convert_gguf(path, tmp_path / "out")
    assert str(path) in str(err.value) and repr(tensor) in str(err.value) and text in str(err.value)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- tokenizer against the model's vocabulary


def _write_word_tokenizer(folder, num_tokens: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, num_tokens)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(
        folder
    )


def _model_cfg(path, tokenizer=None) -> ConfigDict:
    model = base_config().model
    model.path, model.tokenizer = str(path), tokenizer
    return model


def test_tokenizer_larger_than_the_model_vocabulary_is_refused_at_load(tmp_path):
    params = _initial_params()
    model_dir = export_hf(params, CONFIG, tmp_path / "model")
    _write_word_tokenizer(tmp_path / "big", 20)  # 20 tokens > vocab_size 16
    model_cfg = _model_cfg(model_dir, str(tmp_path / "big"))
    source = run_setup.resolve_model_source(model_cfg, str(tmp_path / "run"))
    with pytest.raises(InputError) as err:
        run_setup.model_config(model_cfg, source, run_setup.load_run_tokenizer(source))
    message = str(err.value)
    for text in ("config.model.tokenizer", str(tmp_path / "big"), "20 tokens", "vocab_size 16", str(model_dir)):
        assert text in message, (text, message)

    # A padded vocabulary (model larger than the tokenizer) is normal.
    _write_word_tokenizer(tmp_path / "small", 10)
    model_cfg = _model_cfg(model_dir, str(tmp_path / "small"))
    source = run_setup.resolve_model_source(model_cfg, str(tmp_path / "run"))
    assert run_setup.model_config(model_cfg, source, run_setup.load_run_tokenizer(source)).vocab_size == 16

    # A random-init shape smaller than the tokenizer is a config error naming its key.
    model_cfg = base_config().model
    model_cfg.random_init, model_cfg.tokenizer, model_cfg.arch.vocab_size = True, str(tmp_path / "big"), 12
    source = run_setup.resolve_model_source(model_cfg, str(tmp_path / "run"))
    with pytest.raises(ConfigError) as err:
        run_setup.model_config(model_cfg, source, run_setup.load_run_tokenizer(source))
    assert err.value.keys == ("model.arch.vocab_size",) and "20 tokens" in str(err.value)
