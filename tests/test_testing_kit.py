"""The public kit (`feynrl_jax.testing.check_loss`) finds real defects and names the property each one breaks.

Each mutant is a small loss written here the way a user would (on `feynrl_jax.losses.aggregate`), with one defect;
a correct REINFORCE passes and its report lists the checks.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings

from feynrl_jax.losses import LossSum, TrainBatch, aggregate
from feynrl_jax.losses import metrics as metrics_lib
from feynrl_jax.testing import (
    CHECKS,
    LossCheckReport,
    LossContractError,
    check_loss,
    loss_examples,
    loss_inputs,
    train_batches,
)

FEW = dict(max_examples=3)


def reinforce(logprobs, batch, *, entropy=None, values=None, loss_agg="seq_mean_token_mean", scale=1.0):
    """A user's REINFORCE: ``-A log pi`` per token, aggregated per sequence."""
    del values
    per_token = -scale * batch.advantages * logprobs
    loss = aggregate(per_token, batch.loss_mask, batch.segment_ids, mode=loss_agg)
    metrics = {"loss/policy": metrics_lib.mean_metric(per_token, batch.loss_mask)}
    if entropy is not None:
        metrics["loss/entropy"] = metrics_lib.mean_metric(entropy, batch.loss_mask)
    return loss, metrics


def test_a_correct_loss_passes_and_the_report_lists_the_checks():
    report = check_loss(reinforce, ratio_one="seq_mean_token_mean", **FEW)
    assert isinstance(report, LossCheckReport)
    assert report.passed == tuple(CHECKS) and report.skipped == {}
    assert report.examples == 3 and (4, 8) in report.shapes
    assert "passed   packing" in str(report)


def test_skipped_checks_are_reported_with_the_reason():
    report = check_loss(reinforce, checks=["padding"], max_examples=1)
    assert report.passed == ("jit", "padding")
    assert set(report.skipped) == set(CHECKS) - {"jit", "padding"}
    assert "not selected" in report.skipped["packing"]
    report = check_loss(reinforce, accumulates=False, max_examples=1)
    assert "accumulates=False" in report.skipped["micro_batches"] and "ratio_one=None" in report.skipped["ratio_one"]
    assert "skipped  micro_batches" in str(report)


def reads_masked_positions(logprobs, batch, **kwargs):
    loss, metrics = reinforce(logprobs, batch, **kwargs)
    return LossSum(loss.total + 1e-3 * jnp.sum(batch.advantages), loss.denom), metrics


def per_row_normalised(logprobs, batch, **kwargs):
    loss, metrics = reinforce(logprobs, batch, loss_agg="token_mean", **kwargs)
    rows = batch.loss_mask.shape[0]
    return LossSum(loss.total / rows, loss.denom / rows), metrics


def branches_in_python(logprobs, batch, **kwargs):
    if float(jnp.sum(batch.loss_mask)) > 0:  # reads a value on the host: fails under jit
        return reinforce(logprobs, batch, **kwargs)
    return LossSum(jnp.zeros(()), jnp.zeros(())), {}


def nan_gradient(logprobs, batch, **kwargs):
    loss, metrics = reinforce(logprobs, batch, **kwargs)
    # sqrt(-logprobs) has an infinite derivative at the first token (logprob 0): 0 * inf is NaN even where masked.
    extra = aggregate(jnp.sqrt(-logprobs), batch.loss_mask, batch.segment_ids, mode="seq_mean_token_mean")
    return loss + LossSum(1e-3 * extra.total, 0.0 * extra.denom), metrics


def ignores_segment_ids(logprobs, batch, **kwargs):
    # A row is taken as one sequence: wrong as soon as a row holds several packed sequences.
    return reinforce(logprobs, dataclasses.replace(batch, segment_ids=jnp.ones_like(batch.segment_ids)), **kwargs)


def twice_the_policy_gradient(logprobs, batch, **kwargs):
    return reinforce(logprobs, batch, scale=2.0, **kwargs)


def nonzero_at_zero_mask(logprobs, batch, **kwargs):
    loss, metrics = reinforce(logprobs, batch, **kwargs)
    return LossSum(loss.total, loss.denom + 1.0), metrics


_CALLS = itertools.count()


def returns_stale_values(logprobs, batch, **kwargs):
    # Python-side state: the scale is read on the host at every call, so jit bakes in the first trace's value.
    scale = 1.0 + next(_CALLS)
    return reinforce(logprobs, batch, scale=scale, **kwargs)


def no_logprob_gradient(logprobs, batch, **kwargs):
    return reinforce(jax.lax.stop_gradient(logprobs), batch, **kwargs)


def metric_outside_the_namespace(logprobs, batch, **kwargs):
    loss, metrics = reinforce(logprobs, batch, **kwargs)
    return loss, {"policy": metrics["loss/policy"]}


def gradient_on_masked_tokens(logprobs, batch, **kwargs):
    loss, metrics = reinforce(logprobs, batch, **kwargs)
    return LossSum(loss.total + 1e-3 * jnp.sum(logprobs), loss.denom), metrics


def scaled_by_the_row_width(logprobs, batch, **kwargs):
    # Normalising by the padded width T: right-padding changes the loss.
    loss, metrics = reinforce(logprobs, batch, **kwargs)
    return LossSum(loss.total * logprobs.shape[1], loss.denom), metrics


@pytest.mark.parametrize(
    "loss_fn, check, field",
    [
        (reads_masked_positions, "masked_inputs", "loss total"),
        (per_row_normalised, "micro_batches", "loss total"),
        (branches_in_python, "jit", None),
        (nan_gradient, "finite", "gradient wrt logprobs"),
        (ignores_segment_ids, "packing", None),
        (twice_the_policy_gradient, "ratio_one", "REINFORCE"),
        (nonzero_at_zero_mask, "zero_mask", "loss denom"),
        (returns_stale_values, "eager", "(eager vs jit)"),
        (no_logprob_gradient, "depends_on_logprobs", None),
        (metric_outside_the_namespace, "metrics", None),
        (gradient_on_masked_tokens, "masked_gradient", None),
        (scaled_by_the_row_width, "padding", None),
    ],
    ids=lambda v: getattr(v, "__name__", None) if callable(v) else None,
)
def test_a_defect_is_named(loss_fn, check, field):
    with pytest.raises(LossContractError) as caught:
        # ratio_one would also catch a loss without a logprob gradient; leave that one to its own check.
        ratio_one = None if check == "depends_on_logprobs" else "seq_mean_token_mean"
        check_loss(loss_fn, ratio_one=ratio_one, **FEW)
    error = caught.value
    assert isinstance(error, AssertionError)
    assert error.check == check, str(error)
    assert f"property {check!r} failed" in str(error)
    if field is not None:
        assert field in error.field
    if check != "depends_on_logprobs":
        assert error.example is not None and "value seed" in str(error)


def test_a_retrace_with_seen_shapes_is_named():
    # A loss whose jit cache key changes with a global (the x64 switch) retraces with shapes it has seen.
    flips = itertools.count()

    def flipping(logprobs, batch, **kwargs):
        jax.config.update("jax_default_matmul_precision", ("highest", "float32")[next(flips) % 2])
        return reinforce(logprobs, batch, **kwargs)

    try:
        with pytest.raises(LossContractError) as caught:
            check_loss(flipping, checks=["no_retrace", "masked_inputs"], max_examples=2)
    finally:
        jax.config.update("jax_default_matmul_precision", None)
    assert caught.value.check == "no_retrace"


def with_batch_level_metric(logprobs, batch, **kwargs):
    loss, metrics = reinforce(logprobs, batch, **kwargs)
    # The batch's largest advantage, weighted like a mean: it does not combine over micro-batches.
    largest = jnp.max(jnp.where(batch.loss_mask > 0, batch.advantages, -jnp.inf))
    largest = jnp.where(jnp.isfinite(largest), largest, 0.0)
    return loss, metrics | {"loss/top": metrics_lib.scalar_metric(largest, jnp.sum(batch.loss_mask))}


def test_batch_level_metrics_are_left_out_of_micro_batches_and_noted():
    with pytest.raises(LossContractError, match="loss/top") as caught:
        check_loss(with_batch_level_metric, checks=["micro_batches"], max_examples=3)
    assert caught.value.check == "micro_batches"
    report = check_loss(with_batch_level_metric, checks=["micro_batches"], batch_level_metrics=["loss/top"], **FEW)
    assert "loss/top" in report.notes["micro_batches"] and "loss/top" in str(report)


def test_bad_options_are_rejected():
    with pytest.raises(ValueError, match="unknown check"):
        check_loss(reinforce, checks=["packed"])
    with pytest.raises(ValueError, match="max_tokens"):
        check_loss(reinforce, ratio_one="seq_mean_token_sum")
    with pytest.raises(ValueError, match="aggregation mode"):
        check_loss(reinforce, ratio_one="sum")
    with pytest.raises(ValueError, match="even"):
        check_loss(reinforce, num_sequences=(3,))


@settings(max_examples=10, deadline=None)
@given(loss_examples(num_sequences=(2, 4, 6), max_length=5))
def test_layouts_hold_the_same_sequences(example):
    base = example.unpacked()
    for layout in (example.unpacked(garbage=1), example.padded(), example.packed()):
        assert len(layout.spans) == example.num_sequences
        fields = lambda x: (x.batch.loss_mask, x.batch.advantages, x.batch.old_logprobs, x.logprobs, x.values)  # noqa: E731
        for a_field, b_field in zip(fields(layout), fields(base)):
            masks = base.per_sequence(base.batch.loss_mask)
            for a, b, m in zip(layout.per_sequence(a_field), base.per_sequence(b_field), masks):
                np.testing.assert_array_equal(a * m, b * m)
        segment_ids = np.asarray(layout.batch.segment_ids)
        for row, start, n in layout.spans:
            assert np.all(segment_ids[row, start : start + n] == segment_ids[row, start])
            assert (
                np.asarray(layout.logprobs)[row, start] == 0.0 and np.asarray(layout.batch.loss_mask)[row, start] == 0
            )
    assert np.all(np.asarray(base.logprobs) <= 0)
    assert all(np.asarray(base.batch.loss_mask)[k].sum() > 0 for k in (0, 1))
    parts = example.micro_batches()
    assert sum(p.shape[0] for p in parts) == example.num_sequences and all(p.shape[0] % 2 == 0 for p in parts)


@settings(max_examples=5, deadline=None)
@given(loss_inputs(), train_batches(num_sequences=(2,), max_length=4))
def test_user_strategies_draw_loss_inputs_and_batches(inputs, batch):
    assert inputs.logprobs.shape == inputs.batch.tokens.shape == inputs.values.shape == inputs.entropy.shape
    assert isinstance(batch, TrainBatch) and batch.tokens.shape[1] in (4, 8)
