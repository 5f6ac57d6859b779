"""The contract every registered loss passes (one table; adding an algorithm adds a row).

For every row: the loss runs under ``jax.jit`` (and eagerly, with the same result); gradients are finite on
random inputs; an all-zero mask gives zero loss and zero gradient; right-padding with masked tokens changes
neither loss nor gradient; two sequences packed into one row (with segment ids) give the same loss and
gradients as the unpacked rows; a second call with the same shapes does not retrace. Padding and prompt
positions hold random garbage, so a loss that reads a masked position fails. Comparisons are float32 with
``rtol=1e-5`` (only the summation order differs).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from feynrl_jax.losses import ALGORITHMS, LossSum, TrainBatch

# (row id, registry name, hyperparameter overrides). Every registry entry appears with its defaults; extra rows
# exercise the optional paths (off-policy corrections, dual clip, two-sided CISPO, cDPO, length normalisation).
CASES = [(name, name, {}) for name in ALGORITHMS] + [
    ("grpo+tis", "grpo", {"tis_cap": 2.0}),
    ("ppo+decoupled+dual_clip", "ppo", {"decoupled": True, "tis_cap": 5.0, "dual_clip": 3.0}),
    ("cispo+two_sided+tis", "cispo", {"clip_low": 0.2, "tis_cap": 2.0}),
    ("p3o+kl+decoupled", "p3o", {"kl_coef": 0.1, "decoupled": True}),
    ("gspo+token_mean+kl", "gspo", {"loss_agg": "token_mean", "kl_coef": 0.05}),
    ("dpo+cdpo+length_norm", "dpo", {"label_smoothing": 0.1, "length_normalize": True}),
    ("sft+seq_mean_token_sum", "sft", {"loss_agg": "seq_mean_token_sum", "max_tokens": 16.0}),
]
IDS = [case[0] for case in CASES]

FLOAT_FIELDS = ("advantages", "old_logprobs", "ref_logprobs", "behavior_logprobs", "values", "returns")
INPUT_FIELDS = ("logprobs", "entropy", "critic")


def _random_sequences(rng: np.random.Generator, lengths, prompt_lengths) -> list[dict[str, np.ndarray]]:
    """Per-sequence arrays; prompt tokens (and the first token) carry garbage and mask 0."""
    seqs = []
    for length, prompt in zip(lengths, prompt_lengths):
        mask = np.zeros(length, np.float32)
        mask[prompt:] = 1.0
        logprobs = -rng.uniform(0.05, 3.0, length).astype(np.float32)
        seq = {
            "tokens": rng.integers(1, 100, length).astype(np.int32),
            "loss_mask": mask,
            "advantages": (rng.normal() + 0.3 * rng.normal(size=length)).astype(np.float32),
            "logprobs": logprobs,
            "old_logprobs": logprobs + 0.3 * rng.normal(size=length).astype(np.float32),
            "ref_logprobs": logprobs + 0.3 * rng.normal(size=length).astype(np.float32),
            "behavior_logprobs": logprobs + 0.3 * rng.normal(size=length).astype(np.float32),
            "values": rng.normal(size=length).astype(np.float32),
            "returns": rng.normal(size=length).astype(np.float32),
            "entropy": rng.uniform(0.0, 3.0, length).astype(np.float32),
            "critic": rng.normal(size=length).astype(np.float32),
        }
        # The first token of every sequence has no prediction: logprob 0, mask 0 (token alignment contract).
        seq["logprobs"][0] = 0.0
        seqs.append(seq)
    return seqs


def _layout(seqs, rows: list[list[int]], width: int, rng: np.random.Generator):
    """Places sequences into rows (each row a list of sequence indices, packed left to right).

    Returns (inputs dict of [B, T] arrays, batch fields dict, positions of each sequence as (row, start)).
    Free positions are padding: segment id 0, mask 0, random garbage elsewhere.
    """
    b = len(rows)
    garbage = lambda: rng.normal(size=(b, width)).astype(np.float32) * 5.0  # noqa: E731
    arrays = {name: garbage() for name in FLOAT_FIELDS + INPUT_FIELDS}
    arrays["logprobs"] = -np.abs(arrays["logprobs"])
    arrays["entropy"] = np.abs(arrays["entropy"])
    arrays["tokens"] = rng.integers(1, 100, (b, width)).astype(np.int32)
    arrays["loss_mask"] = np.zeros((b, width), np.float32)
    arrays["segment_ids"] = np.zeros((b, width), np.int32)
    arrays["positions"] = np.zeros((b, width), np.int32)
    where = {}
    for r, members in enumerate(rows):
        start = 0
        for segment, k in enumerate(members, start=1):
            n = len(seqs[k]["tokens"])
            for name, value in seqs[k].items():
                arrays[name][r, start : start + n] = value
            arrays["segment_ids"][r, start : start + n] = segment
            arrays["positions"][r, start : start + n] = np.arange(n)
            where[k] = (r, start, n)
            start += n
        assert start <= width
    return arrays, where


def _to_batch(arrays) -> tuple[TrainBatch, dict[str, jax.Array]]:
    batch = TrainBatch(
        tokens=jnp.asarray(arrays["tokens"]),
        positions=jnp.asarray(arrays["positions"]),
        segment_ids=jnp.asarray(arrays["segment_ids"]),
        loss_mask=jnp.asarray(arrays["loss_mask"]),
        **{name: jnp.asarray(arrays[name]) for name in FLOAT_FIELDS},
    )
    inputs = {name: jnp.asarray(arrays[name]) for name in INPUT_FIELDS}
    return batch, inputs


def _objective(case):
    """A jitted ``(inputs, batch) -> (loss value, LossSum, grads wrt inputs)`` and a trace counter."""
    _, name, overrides = case
    algorithm = ALGORITHMS[name]
    loss_fn = algorithm.make_loss(**overrides)
    traces = []

    def total(inputs, batch):
        traces.append(1)
        loss, metrics = loss_fn(inputs["logprobs"], batch, entropy=inputs["entropy"], values=inputs["critic"])
        return loss.total, (loss, metrics)

    def run(inputs, batch):
        grads, (loss, metrics) = jax.grad(total, has_aux=True)(inputs, batch)
        return loss, metrics, grads

    return jax.jit(run), run, traces


LENGTHS = [9, 6, 11, 5, 8, 7, 10, 4]
PROMPTS = [3, 2, 4, 1, 3, 3, 5, 2]
WIDTH = 12


@pytest.fixture(scope="module")
def sequences():
    return _random_sequences(np.random.default_rng(0), LENGTHS, PROMPTS)


def _unpacked(seqs, width=WIDTH, seed=1):
    return _layout(seqs, [[k] for k in range(len(seqs))], width, np.random.default_rng(seed))


def _packed(seqs, seed=2):
    rows = [[2 * r, 2 * r + 1] for r in range(len(seqs) // 2)]
    return _layout(seqs, rows, 2 * WIDTH, np.random.default_rng(seed))


def _per_sequence(grads, where):
    """Gradients of each sequence's own tokens, keyed by sequence index."""
    out = {}
    for k, (r, start, n) in where.items():
        out[k] = {name: np.asarray(g)[r, start : start + n] for name, g in grads.items()}
    return out


def _value(loss: LossSum) -> float:
    return float(loss.value)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_contract(case, sequences):
    run, eager, traces = _objective(case)

    arrays, where = _unpacked(sequences)
    batch, inputs = _to_batch(arrays)
    loss, metrics, grads = run(inputs, batch)
    assert float(loss.denom) > 0
    assert np.isfinite(float(loss.total)) and np.isfinite(_value(loss))
    for name, g in grads.items():
        assert np.all(np.isfinite(np.asarray(g))), f"non-finite gradient wrt {name}"
    assert float(jnp.abs(grads["logprobs"]).sum()) > 0, "the loss does not depend on logprobs"
    for metric_name, metric in metrics.items():
        assert metric_name.startswith("loss/")
        assert np.isfinite(float(metric.value)), metric_name
    # Masked positions get exactly zero gradient.
    mask = np.asarray(batch.loss_mask)
    for name, g in grads.items():
        np.testing.assert_array_equal(np.asarray(g)[mask == 0], 0.0, err_msg=f"gradient wrt masked {name}")

    # A second call with the same shapes and new values does not retrace.
    arrays2, _ = _unpacked(_random_sequences(np.random.default_rng(7), LENGTHS, PROMPTS), seed=3)
    batch2, inputs2 = _to_batch(arrays2)
    loss2, _, _ = run(inputs2, batch2)
    assert len(traces) == 1
    assert _value(loss2) != _value(loss)

    # All-zero mask: zero loss (total, denom and value) and zero gradient.
    zero_batch = dataclasses.replace(batch, loss_mask=jnp.zeros_like(batch.loss_mask))
    zloss, zmetrics, zgrads = run(inputs, zero_batch)
    assert float(zloss.total) == 0.0 and float(zloss.denom) == 0.0 and _value(zloss) == 0.0
    for name, g in zgrads.items():
        np.testing.assert_array_equal(np.asarray(g), 0.0, err_msg=f"zero-mask gradient wrt {name}")
    for metric_name, metric in zmetrics.items():
        assert np.isfinite(float(metric.value)), metric_name

    # The other layouts run eagerly (one jit compile per row keeps the table fast); eager matches jit.
    eloss, _, egrads = eager(inputs, batch)
    assert len(traces) == 2
    np.testing.assert_allclose(_value(eloss), _value(loss), rtol=1e-5)
    for name in grads:
        np.testing.assert_allclose(egrads[name], grads[name], rtol=1e-5, atol=1e-7, err_msg=f"eager {name}")

    # Right-padding with masked garbage changes neither the loss nor the gradient.
    padded, padded_where = _unpacked(sequences, width=WIDTH + 5, seed=4)
    pbatch, pinputs = _to_batch(padded)
    ploss, _, pgrads = eager(pinputs, pbatch)
    np.testing.assert_allclose(_value(ploss), _value(loss), rtol=1e-5)
    np.testing.assert_allclose(float(ploss.denom), float(loss.denom))
    base = _per_sequence(grads, where)
    for k, g in _per_sequence(pgrads, padded_where).items():
        for name in g:
            np.testing.assert_allclose(g[name], base[k][name], rtol=1e-5, atol=1e-7, err_msg=f"padded {name}")

    # Packed (two sequences per row, segment ids 1 and 2) equals unpacked.
    packed, packed_where = _packed(sequences)
    kbatch, kinputs = _to_batch(packed)
    kloss, _, kgrads = eager(kinputs, kbatch)
    np.testing.assert_allclose(_value(kloss), _value(loss), rtol=1e-5)
    np.testing.assert_allclose(float(kloss.denom), float(loss.denom))
    for k, g in _per_sequence(kgrads, packed_where).items():
        for name in g:
            np.testing.assert_allclose(g[name], base[k][name], rtol=1e-5, atol=1e-7, err_msg=f"packed {name}")


def test_registry_records_are_consistent():
    expected = {"sft", "dpo", "ppo", "grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "cispo", "p3o", "gspo"}
    assert expected <= set(ALGORITHMS)
    for name, algorithm in ALGORITHMS.items():
        assert algorithm.name == name
        assert algorithm.paradigm in ("sft", "dpo", "rl")
        assert (algorithm.advantage_fn is None) == (algorithm.paradigm != "rl"), name
        hp = algorithm.hyperparameters
        if algorithm.paradigm == "rl":
            assert algorithm.needs_reference == (hp.get("kl_coef", 0.0) > 0), name
        assert algorithm.uses_entropy == (hp.get("entropy_coef", 0.0) > 0), name
        assert algorithm.needs_critic == (hp.get("vf_coef", 0.0) > 0), name
        with pytest.raises(dataclasses.FrozenInstanceError):
            algorithm.name = "other"  # type: ignore[misc]
    assert ALGORITHMS["dapo"].hyperparameters["clip_high"] > ALGORITHMS["dapo"].hyperparameters["clip_low"]
    assert ALGORITHMS["dr_grpo"].hyperparameters["loss_agg"] == "seq_mean_token_sum"


def test_make_loss_rejects_unknown_hyperparameter():
    with pytest.raises(ValueError, match="clip_hihg"):
        ALGORITHMS["grpo"].make_loss(clip_hihg=0.3)


def test_bad_inputs_name_the_field(sequences):
    arrays, _ = _unpacked(sequences)
    batch, inputs = _to_batch(arrays)
    with pytest.raises(ValueError, match="ref_logprobs"):
        ALGORITHMS["dpo"].make_loss()(inputs["logprobs"], dataclasses.replace(batch, ref_logprobs=None))
    with pytest.raises(ValueError, match="behavior_logprobs"):
        ALGORITHMS["grpo"].make_loss(tis_cap=2.0)(
            inputs["logprobs"], dataclasses.replace(batch, behavior_logprobs=None)
        )
    with pytest.raises(ValueError, match="batch.advantages"):
        ALGORITHMS["cispo"].make_loss()(
            inputs["logprobs"], dataclasses.replace(batch, advantages=batch.advantages[:, 1:])
        )
    with pytest.raises(ValueError, match="values"):
        ALGORITHMS["ppo"].make_loss()(inputs["logprobs"], batch, entropy=inputs["entropy"])
    with pytest.raises(ValueError, match="loss_agg"):
        ALGORITHMS["sft"].make_loss(loss_agg="sum")(inputs["logprobs"], batch)
    with pytest.raises(ValueError, match="max_tokens"):
        ALGORITHMS["sft"].make_loss(loss_agg="seq_mean_token_sum")(inputs["logprobs"], batch)
