"""Structure of the losses package: import rules, pytrees, metrics and aggregation edge cases."""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from feynrl_jax import losses
from feynrl_jax.losses import LossSum, Metric, TrainBatch, aggregate, combine_metrics, compute_metrics, sequences
from feynrl_jax.losses import metrics as metrics_lib

LOSSES_DIR = pathlib.Path(losses.__file__).parent
ALLOWED_THIRD_PARTY = {"jax", "numpy", "chex"}


def _imported_modules(path: pathlib.Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            names.add(node.module or "")
    return names


def test_losses_import_only_jax_numpy_chex_and_the_standard_library():
    files = sorted(LOSSES_DIR.glob("*.py"))
    assert len(files) >= 10
    for path in files:
        for name in _imported_modules(path):
            top = name.split(".")[0]
            if name.startswith("feynrl_jax."):
                assert name.startswith("feynrl_jax.losses"), f"{path.name} imports {name}"
                continue
            assert top in ALLOWED_THIRD_PARTY or top in sys.stdlib_module_names, f"{path.name} imports {name}"


def test_train_batch_is_a_frozen_pytree_with_optional_fields():
    x = jnp.zeros((2, 3))
    batch = TrainBatch(tokens=x, positions=x, segment_ids=x, loss_mask=x, advantages=x, old_logprobs=x)
    assert len(jax.tree_util.tree_leaves(batch)) == 6
    full = dataclasses.replace(batch, ref_logprobs=x, behavior_logprobs=x, values=x, returns=x)
    assert len(jax.tree_util.tree_leaves(full)) == 10
    doubled = jax.tree_util.tree_map(lambda a: a + 1, full)
    assert isinstance(doubled, TrainBatch) and float(doubled.returns.sum()) == 6.0
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch.tokens = x  # type: ignore[misc]


def test_sequence_index_numbers_packed_sequences_in_row_major_order():
    segment_ids = jnp.array([[1, 1, 2, 2, 0], [1, 1, 1, 0, 0], [3, 3, 7, 7, 7]])
    index = np.asarray(sequences.sequence_index(segment_ids))
    pad = segment_ids.size
    np.testing.assert_array_equal(index, [[0, 0, 1, 1, pad], [2, 2, 2, pad, pad], [3, 3, 4, 4, 4]])


def test_loss_sums_add_and_an_empty_loss_reads_zero():
    a, b = LossSum(jnp.array(3.0), jnp.array(2.0)), LossSum(jnp.array(1.0), jnp.array(2.0))
    assert float((a + b).value) == 1.0
    assert float(LossSum(jnp.array(0.0), jnp.array(0.0)).value) == 0.0
    assert jax.grad(lambda t: LossSum(t, jnp.array(0.0)).value)(1.0) == 0.0


def test_aggregation_modes_on_a_packed_row():
    per_token = jnp.array([[1.0, 2.0, 3.0, 4.0, 5.0, 9.0]])
    mask = jnp.array([[1.0, 1.0, 0.0, 1.0, 1.0, 0.0]])
    segment_ids = jnp.array([[1, 1, 1, 2, 2, 0]])
    np.testing.assert_allclose(aggregate(per_token, mask, segment_ids, mode="token_mean").value, 12.0 / 4.0)
    np.testing.assert_allclose(
        aggregate(per_token, mask, segment_ids, mode="seq_mean_token_mean").value, (1.5 + 4.5) / 2.0
    )
    np.testing.assert_allclose(
        aggregate(per_token, mask, segment_ids, mode="seq_mean_token_sum", max_tokens=10.0).value,
        (3.0 / 10.0 + 9.0 / 10.0) / 2.0,
    )


def test_metrics_combine_exactly_and_read_zero_when_empty():
    values = jnp.array([1.0, 5.0, -2.0, 4.0])
    mask_a, mask_b = jnp.array([1.0, 1.0, 0.0, 0.0]), jnp.array([0.0, 0.0, 1.0, 1.0])
    whole = jnp.ones(4)
    make = lambda m: {  # noqa: E731
        "mean": metrics_lib.mean_metric(values, m),
        "max": metrics_lib.max_metric(values, m),
        "min": metrics_lib.min_metric(values, m),
    }
    combined = compute_metrics(combine_metrics(make(mask_a), make(mask_b)))
    expected = compute_metrics(make(whole))
    assert {k: float(v) for k, v in combined.items()} == {k: float(v) for k, v in expected.items()}
    assert float(expected["mean"]) == 2.0 and float(expected["max"]) == 5.0 and float(expected["min"]) == -2.0
    empty = compute_metrics(make(jnp.zeros(4)))
    assert all(float(v) == 0.0 for v in empty.values())
    with pytest.raises(ValueError, match="mean"):
        combine_metrics({"mean": make(mask_a)["mean"]}, {"mean": make(mask_a)["max"]})
    with pytest.raises(ValueError, match="reduce"):
        Metric(jnp.array(0.0), jnp.array(0.0), "sum")


def test_last_metrics_keep_the_later_value():
    a, b = metrics_lib.last_metric(jnp.int32(3)), metrics_lib.last_metric(jnp.int32(4))
    combined = combine_metrics({"train/step": a}, {"train/step": b})["train/step"]
    assert int(combined.value) == 4 and combined.reduce == "last"


def test_updates_combine_by_type_not_by_name():
    """A step's updates: max of maxes, min of mins, the last counter and the plain mean of per-update values,
    whatever the names say (a mean named `_max`, a max named `_mean`, a counter named like a loss)."""
    mean = lambda v: metrics_lib.scalar_metric(jnp.float32(v), 1.0)  # noqa: E731 - an update's mean, weight 1
    records = [
        {
            "loss/ratio_max": mean(v),
            "loss/size_mean": Metric(jnp.float32(x), jnp.float32(n), "max"),
            "loss/spread_min": Metric(jnp.float32(x - 10), jnp.float32(n), "min"),
            "train/loss": metrics_lib.last_metric(jnp.float32(v)),
            "train/step": metrics_lib.last_metric(jnp.int32(i + 1)),
        }
        for i, (v, x, n) in enumerate([(1.0, 7.0, 3), (5.0, -1.0, 2), (3.5, 100.0, 0)])
    ]
    got = metrics_lib.combine_updates(records)
    assert got == {
        "loss/ratio_max": float(np.mean([1.0, 5.0, 3.5])),
        "loss/size_mean": 7.0,  # the third update has no valid entries: its 100 does not count
        "loss/spread_min": -11.0,
        "train/loss": 3.5,
        "train/step": 3.0,
    }
    # One record reads as its values; empty extremes and empty means read 0.
    assert metrics_lib.combine_updates(records[:1]) == {k: float(v) for k, v in compute_metrics(records[0]).items()}
    empty = {
        "a": metrics_lib.mean_metric(jnp.ones(2), jnp.zeros(2)),
        "b": metrics_lib.max_metric(jnp.ones(2), jnp.zeros(2)),
    }
    assert metrics_lib.combine_updates([empty, empty]) == {"a": 0.0, "b": 0.0}
    with pytest.raises(ValueError, match="different names"):
        metrics_lib.combine_updates([records[0], {"train/step": records[0]["train/step"]}])
    with pytest.raises(ValueError, match="'train/loss'"):
        metrics_lib.combine_updates([records[0], {**records[1], "train/loss": mean(1.0)}])


def test_metrics_are_pytrees_with_a_static_reduce():
    metric = metrics_lib.max_metric(jnp.array([1.0, 2.0]), jnp.ones(2))
    leaves, treedef = jax.tree_util.tree_flatten(metric)
    assert len(leaves) == 2
    assert jax.jit(lambda m: m)(metric).reduce == "max"
    assert jax.tree_util.tree_unflatten(treedef, leaves).reduce == "max"
