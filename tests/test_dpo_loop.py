"""The DPO loop end to end on a tiny random model: reference modes, training signal, held-out preference accuracy."""

import json

import numpy as np
import pytest

from feynrl_jax.config.base import add_data_source, base_config, data_source
from feynrl_jax.data.packing import TokenBatch
from feynrl_jax.tracking import read_metrics
from feynrl_jax.train import dpo_loop

STEPS = 8


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    from feynrl_jax.data.toy_tokenizer import build_toy_tokenizer

    root = tmp_path_factory.mktemp("dpo")
    train, test = [], []
    for i in range(48):
        a, b = i % 7 + 1, (i * 3) % 5 + 1
        # The preference is learnable from the surface: the chosen answer is right and calm, the rejected one
        # wrong and shouted; held-out pairs use other numbers.
        row = {"prompt": f"What is {a} plus {b}?", "chosen": f"It is {a + b}.", "rejected": f"It is {a + b + 1}!!"}
        (test if i % 4 == 0 else train).append(row)
    for name, rows in (("train", train), ("test", test)):
        with open(root / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    texts = [r["prompt"] + " " + r["chosen"] + " " + r["rejected"] for r in train + test]
    build_toy_tokenizer(texts, vocab_size=280).save_pretrained(root / "tokenizer")
    return root


def tiny_dpo_config(root, run_dir, reference_mode):
    config = base_config()
    config.paradigm = "dpo"
    config.run_dir = str(run_dir)
    config.model.random_init = True
    config.model.tokenizer = str(root / "tokenizer")
    arch = config.model.arch
    arch.vocab_size, arch.hidden_size, arch.intermediate_size = 288, 32, 64
    arch.num_heads, arch.num_kv_heads, arch.head_dim = 4, 2, 8
    add_data_source(config, "pairs", data_source("jsonl", path=str(root / "train.jsonl")))
    add_data_source(config, "pairs_test", data_source("jsonl", path=str(root / "test.jsonl"), split="test"))
    config.data.max_seq_len = 40
    config.data.max_prompt_len = 32
    config.algo.name = "dpo"
    config.algo.reference = "initial"
    config.algo.reference_mode = reference_mode
    config.optim.lr = 3e-3
    config.optim.schedule = "constant"
    config.train.steps = STEPS
    config.train.global_batch_size = 8  # pairs: 16 rows
    config.checkpoint.every_steps = 5
    config.tracking.progress_bar = False
    config.eval.reward = ""  # preference accuracy only (no generation)
    config.eval.num_prompts = 12
    return config


@pytest.mark.slow
def test_dpo_per_batch_and_precomputed_reference_train_identically_and_improve(data_dir, tmp_path):
    dpo_loop.run(tiny_dpo_config(data_dir, tmp_path / "per_batch", "per_batch"))
    dpo_loop.run(tiny_dpo_config(data_dir, tmp_path / "precompute", "precompute"))
    per_batch, precomputed = read_metrics(str(tmp_path / "per_batch")), read_metrics(str(tmp_path / "precompute"))
    assert [r["step"] for r in per_batch] == list(range(0, STEPS + 1))

    losses = np.array([r["train/loss"] for r in per_batch[1:]])
    np.testing.assert_allclose([r["train/loss"] for r in precomputed[1:]], losses, rtol=1e-5, atol=1e-6)
    assert losses[0] == pytest.approx(np.log(2.0), abs=1e-5), "policy == reference at step 1: loss is log 2"
    assert losses[-1] < 0.8 * losses[0]
    assert per_batch[-1]["loss/reward_accuracy"] == 1.0

    start, end = per_batch[0], per_batch[-1]
    assert start["eval/reward_margin"] == 0.0 and start["eval/reward_accuracy"] == 0.0
    assert start["eval/num_pairs"] == 12
    assert end["eval/reward_accuracy"] > 0.9
    assert end["eval/pref_accuracy"] > start["eval/pref_accuracy"]
    assert end["eval/reward_margin"] > 0.0


def test_reference_table_round_trip_and_unknown_rows():
    tokens = np.arange(12, dtype=np.int32).reshape(3, 4)
    mask = np.ones((3, 4), np.float32)
    batch = TokenBatch(tokens, np.zeros_like(tokens), np.ones_like(tokens), mask)
    values = np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)
    table = dpo_loop.ReferenceTable()
    table.add(batch, values)
    shuffled = TokenBatch(tokens[::-1].copy(), np.zeros_like(tokens), np.ones_like(tokens), mask)
    np.testing.assert_array_equal(table.lookup(shuffled), values[::-1])
    other = TokenBatch(tokens + 1, np.zeros_like(tokens), np.ones_like(tokens), mask)
    with pytest.raises(KeyError, match="not in the precomputed reference table"):
        table.lookup(other)


def test_dpo_rejects_bad_reference_settings(data_dir, tmp_path):
    config = tiny_dpo_config(data_dir, tmp_path / "bad", "sometimes")
    with pytest.raises(ValueError, match="reference_mode"):
        dpo_loop.run(config)
