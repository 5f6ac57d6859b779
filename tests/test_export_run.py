"""`export_run`: a run's latest orbax checkpoint -> a Hugging Face folder that transformers loads with our logits."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from feynrl_jax.checkpoints.train_state import RunProgress, TrainCheckpointer
from feynrl_jax.config.base import base_config
from feynrl_jax.models import forward, init_params, logits
from feynrl_jax.train import run_setup
from feynrl_jax.train.export import export_run
from feynrl_jax.train.optimizer import make_optimizer
from feynrl_jax.train.state import create_train_state


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from feynrl_jax.data.toy_tokenizer import build_toy_tokenizer

    path = tmp_path_factory.mktemp("tok") / "tokenizer"
    build_toy_tokenizer(["What is 2 plus 3? 2 plus 3 is 5."], vocab_size=280).save_pretrained(path)
    return str(path)


def _run_with_checkpoints(run_dir, tokenizer_dir, steps):
    """A run folder whose checkpoints hold a TrainState of a tiny random model, as the loops write it."""
    config = base_config()
    config.paradigm = "sft"
    config.run_dir = str(run_dir)
    config.model.random_init = True
    config.model.tokenizer = tokenizer_dir
    arch = config.model.arch
    arch.vocab_size, arch.hidden_size, arch.intermediate_size, arch.num_layers = 288, 32, 64, 2
    arch.num_heads, arch.num_kv_heads, arch.head_dim, arch.tie_word_embeddings = 4, 2, 8, False
    source = run_setup.resolve_model_source(config.model, str(run_dir))
    model_config = run_setup.model_config(config.model, source, run_setup.load_run_tokenizer(source))
    optimizer, _ = make_optimizer(1e-3, schedule="constant")
    saved = {}
    with TrainCheckpointer(run_dir, save_every=1, keep=2) as ckpt:
        for step in steps:
            params = init_params(model_config, jax.random.key(step))
            ckpt.save(
                create_train_state(params, optimizer),
                RunProgress(step, jax.random.key(0), {}, step, run_setup.config_dict(config)),
            )
            saved[step] = params
    return model_config, saved


def test_export_loads_in_transformers_with_our_logits(tmp_path, tokenizer_dir):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_config, saved = _run_with_checkpoints(tmp_path / "run", tokenizer_dir, steps=(1, 2))
    out = export_run(tmp_path / "run", tmp_path / "export")
    assert out == str(tmp_path / "export")
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["feynrl_jax"]["step"] == 2  # the latest checkpoint

    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(out, local_files_only=True)
    ids = tokenizer("What is 2 plus 3? 2 plus 3 is 5.")["input_ids"]
    tokens = np.asarray([ids], np.int32)
    positions = np.arange(tokens.shape[1], dtype=np.int32)[None]
    hidden, _ = forward(saved[2], jnp.asarray(tokens), jnp.asarray(positions), config=model_config)
    ours = np.asarray(logits(saved[2], hidden, config=model_config))
    with torch.no_grad():
        theirs = model(torch.tensor(tokens, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=1e-4)
    # A different step's params give different logits, so the comparison is not vacuous.
    hidden1, _ = forward(saved[1], jnp.asarray(tokens), jnp.asarray(positions), config=model_config)
    assert np.abs(np.asarray(logits(saved[1], hidden1, config=model_config)) - theirs).max() > 1e-2


def test_export_of_an_explicit_step_and_errors(tmp_path, tokenizer_dir):
    model_config, saved = _run_with_checkpoints(tmp_path / "run", tokenizer_dir, steps=(3, 4))
    out = export_run(tmp_path / "run", tmp_path / "export3", step=3)
    from safetensors.numpy import load_file

    tensors = load_file(os.path.join(out, "model.safetensors"))
    np.testing.assert_array_equal(tensors["model.embed_tokens.weight"], np.asarray(saved[3]["embed"]["embedding"]))
    with pytest.raises(FileNotFoundError, match="no checkpoint folder"):
        export_run(tmp_path / "nothing_here", tmp_path / "x")
    with pytest.raises(FileNotFoundError, match="step 9 not found"):
        export_run(tmp_path / "run", tmp_path / "x", step=9)
