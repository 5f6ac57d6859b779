"""Checkpoint I/O without transformers models: sharded safetensors, placement, atomic export, bad input."""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from feynrl_jax.checkpoints import (
    CheckpointError,
    convert_gguf,
    export_hf,
    find_smollm2_gguf,
    load_hf,
    load_tokenizer,
    tensor_mappings,
)
from feynrl_jax.checkpoints.gguf_import import _unpermute
from feynrl_jax.models import ModelConfig, init_params, logical_axes

CONFIG = ModelConfig(
    vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8
)


def _random_params(config, seed=0):
    params = init_params(config, jax.random.key(seed))
    # Distinct non-trivial values everywhere (norm scales are all ones at init).
    leaves, treedef = jax.tree.flatten(params)
    rng = np.random.default_rng(seed)
    return jax.tree.unflatten(treedef, [rng.normal(size=x.shape).astype(np.float32) for x in leaves])


@pytest.fixture(scope="module")
def sharded_folder(tmp_path_factory):
    """An exported checkpoint split into several safetensors shards (with an index)."""
    params = _random_params(CONFIG)
    out = export_hf(params, CONFIG, tmp_path_factory.mktemp("ckpt") / "model", max_shard_bytes=20_000)
    return params, out


def test_export_writes_sharded_index_and_loads_back(sharded_folder):
    params, folder = sharded_folder
    files = sorted(os.listdir(folder))
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 2 and "model.safetensors.index.json" in files and "config.json" in files
    index = json.load(open(os.path.join(folder, "model.safetensors.index.json")))
    assert set(index["weight_map"].values()) == set(shards)
    assert "model.layers.2.self_attn.q_proj.weight" in index["weight_map"]
    loaded, config = load_hf(folder)
    assert config == CONFIG
    jax.tree.map(np.testing.assert_array_equal, loaded, params)


def test_load_places_params_with_the_given_shardings(sharded_folder):
    params, folder = sharded_folder
    mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 4), ("data", "fsdp"))
    rules = {"embed": "fsdp", "mlp": "data", "vocab": "data"}
    is_axes = lambda x: isinstance(x, tuple) and all(isinstance(a, str) for a in x)  # noqa: E731
    shardings = jax.tree.map(
        lambda axes: NamedSharding(mesh, P(*(rules.get(a) for a in axes))), logical_axes(CONFIG), is_leaf=is_axes
    )
    loaded, _ = load_hf(folder, shardings=shardings)
    jax.tree.map(lambda x, s: x.sharding == s or pytest.fail(f"{x.sharding} != {s}"), loaded, shardings)
    assert loaded["layers"]["gate_proj"]["kernel"].sharding.spec == P(None, "fsdp", "data")
    jax.tree.map(np.testing.assert_array_equal, loaded, params)


def test_load_converts_to_the_requested_dtype(sharded_folder):
    params, folder = sharded_folder
    loaded, config = load_hf(folder, param_dtype="bfloat16")
    assert config.param_dtype == "bfloat16"
    assert all(x.dtype == jax.numpy.bfloat16 for x in jax.tree.leaves(loaded))
    np.testing.assert_allclose(loaded["final_norm"]["scale"].astype(np.float32), params["final_norm"]["scale"], 1e-2)


def test_export_replaces_existing_folder_atomically_and_cleans_up_on_failure(tmp_path):
    params = _random_params(CONFIG)
    out = tmp_path / "model"
    export_hf(params, CONFIG, out)
    (out / "stale.txt").write_text("old")
    export_hf(params, CONFIG, out)
    assert not (out / "stale.txt").exists() and (out / "model.safetensors").exists()
    broken = {k: v for k, v in params.items() if k != "final_norm"}
    with pytest.raises(KeyError, match="final_norm/scale"):
        export_hf(broken, CONFIG, tmp_path / "never")
    assert not (tmp_path / "never").exists()
    assert sorted(os.listdir(tmp_path)) == ["model"], "temporary folders left behind"
    with pytest.raises(FileNotFoundError, match="no tokenizer files"):
        export_hf(params, CONFIG, tmp_path / "never", tokenizer_dir=tmp_path / "model")
    assert sorted(os.listdir(tmp_path)) == ["model"]


def _write_tokenizer(folder):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}"
    fast.save_pretrained(folder)


def test_export_copies_tokenizer_and_chat_template(tmp_path):
    _write_tokenizer(tmp_path / "tok")
    out = export_hf(_random_params(CONFIG), CONFIG, tmp_path / "model", tokenizer_dir=tmp_path / "tok")
    tokenizer = load_tokenizer(out)
    assert tokenizer("hello world")["input_ids"] == [3, 4]
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert list(ids) == [1, 3, 2]


def test_unpermute_inverts_llama_cpp_permutation():
    # llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel.permute), written from its definition.
    def permute(w, n_head):
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    w = np.arange(6 * 8 * 5, dtype=np.float32).reshape(6 * 8, 5)
    np.testing.assert_array_equal(_unpermute(permute(w, 6), 6), w)
    assert not np.array_equal(permute(w, 6), w)


# ---------------------------------------------------------------- bad input, table-driven


def _missing_shard(folder):
    index = json.load(open(folder / "model.safetensors.index.json"))
    shard = index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
    os.remove(folder / shard)
    return [shard, "model.layers.1.mlp.up_proj.weight"]


def _wrong_shape(folder):
    cfg = json.load(open(folder / "config.json"))
    cfg["intermediate_size"] = 40
    json.dump(cfg, open(folder / "config.json", "w"))
    return ["model.layers.0.mlp.gate_proj.weight", "(48, 32)", "(40, 32)"]


def _unknown_architecture(folder):
    cfg = json.load(open(folder / "config.json"))
    cfg["model_type"], cfg["architectures"] = "falcon", ["FalconForCausalLM"]
    json.dump(cfg, open(folder / "config.json", "w"))
    return ["config.json", "falcon"]


def _truncated_file(folder):
    index = json.load(open(folder / "model.safetensors.index.json"))
    shard = index["weight_map"]["model.layers.2.self_attn.o_proj.weight"]
    data = (folder / shard).read_bytes()
    (folder / shard).write_bytes(data[: len(data) - 100])
    return [shard]


def _missing_tensor(folder):
    index = json.load(open(folder / "model.safetensors.index.json"))
    del index["weight_map"]["model.norm.weight"]
    json.dump(index, open(folder / "model.safetensors.index.json", "w"))
    return ["model.norm.weight", str(folder)]


def _missing_config(folder):
    os.remove(folder / "config.json")
    return ["config.json", str(folder)]


def _rewrite_tensor(folder, name, change):
    """Rewrites the shard holding tensor `name` with `change(array)` in its place; returns the shard's name."""
    from safetensors.numpy import load_file, save_file

    shard = json.load(open(folder / "model.safetensors.index.json"))["weight_map"][name]
    tensors = load_file(folder / shard)
    tensors[name] = change(tensors[name])
    save_file(tensors, folder / shard, metadata={"format": "pt"})
    return shard


def _integer_tensor(folder):
    name = "model.layers.1.self_attn.k_proj.weight"
    shard = _rewrite_tensor(folder, name, lambda x: np.round(x * 100).astype(np.int32))
    return [shard, name, "I32", "floating point"]


def _nan_tensor(folder):
    name = "model.layers.2.mlp.down_proj.weight"

    def poison(x):
        x = x.copy()
        x[3, 5] = np.nan
        return x

    return [_rewrite_tensor(folder, name, poison), name, "NaN"]


def _inf_bfloat16_tensor(folder):
    import ml_dtypes

    name = "model.norm.weight"

    def poison(x):
        x = x.astype(ml_dtypes.bfloat16)
        x[-1] = -np.inf
        return x

    return [_rewrite_tensor(folder, name, poison), name, "infinite"]


BAD_CHECKPOINTS = {
    "integer tensor": (_integer_tensor, CheckpointError),
    "NaN in a tensor": (_nan_tensor, CheckpointError),
    "inf in a bfloat16 tensor": (_inf_bfloat16_tensor, CheckpointError),
    "missing shard": (_missing_shard, CheckpointError),
    "wrong tensor shape": (_wrong_shape, CheckpointError),
    "unknown architecture": (_unknown_architecture, ValueError),
    "truncated safetensors": (_truncated_file, CheckpointError),
    "tensor missing from index": (_missing_tensor, CheckpointError),
    "no config.json": (_missing_config, FileNotFoundError),
}


@pytest.mark.parametrize("case", sorted(BAD_CHECKPOINTS))
def test_bad_checkpoint_errors_name_file_and_tensor(case, tmp_path):
    damage, error = BAD_CHECKPOINTS[case]
    folder = tmp_path / "model"
    export_hf(_random_params(CONFIG), CONFIG, folder, max_shard_bytes=20_000)
    expected = damage(folder)
    with pytest.raises(error) as err:
        load_hf(folder)
    for text in expected:
        assert text in str(err.value), (text, str(err.value))


def test_bfloat16_and_float16_checkpoints_load(tmp_path):
    params = _random_params(CONFIG)
    for dtype in ("bfloat16", "float16"):
        config = dataclasses.replace(CONFIG, param_dtype=dtype)
        loaded, _ = load_hf(export_hf(params, config, tmp_path / dtype), config=config)
        assert loaded["final_norm"]["scale"].dtype == dtype


BAD_TOKENIZERS = {
    "missing folder": lambda d: (d / "absent", ["does not exist", str(d / "absent")]),
    "no tokenizer files": lambda d: (d, ["no tokenizer in", str(d), "tokenizer.json"]),
}


@pytest.mark.parametrize("case", sorted(BAD_TOKENIZERS))
def test_missing_tokenizer_names_the_folder(case, tmp_path):
    (tmp_path / "config.json").write_text("{}")
    folder, expected = BAD_TOKENIZERS[case](tmp_path)
    with pytest.raises(FileNotFoundError) as err:
        load_tokenizer(folder)
    for text in expected:
        assert text in str(err.value)


@pytest.mark.parametrize(
    "content, error, text",
    [(None, FileNotFoundError, "no GGUF file"), (b"not a gguf file at all" * 10, CheckpointError, "cannot read GGUF")],
)
def test_bad_gguf_names_the_file(tmp_path, content, error, text):
    path = tmp_path / "model.gguf"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(error) as err:
        convert_gguf(path, tmp_path / "out")
    assert text in str(err.value) and str(path) in str(err.value)
    assert not (tmp_path / "out").exists()


def test_mapping_table_covers_every_param_once():
    for config in (CONFIG, dataclasses.replace(CONFIG, architecture="qwen2", attention_bias=True)):
        names = [m.hf_name for m in tensor_mappings(config)]
        assert len(names) == len(set(names))
        shapes = jax.eval_shape(functools.partial(init_params, config), jax.random.key(0))
        assert len(names) == len(jax.tree.leaves(shapes))


def test_find_smollm2_gguf_locates_the_shipped_file():
    path = find_smollm2_gguf()
    assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.getsize(path) > 50_000_000
