"""``check_loss``: runs the loss contract on hypothesis-drawn examples and names the property that fails.

The contract (docs/CONTRACTS.md, "Checking a loss"); each check's name is what a failure and the report show:

* ``jit``: the loss (and its gradient) runs under ``jax.jit``.
* ``finite``: finite total, denominator and value, a positive denominator (the first pair of every example
  has valid tokens) and finite gradients wrt ``logprobs``, ``entropy`` and ``values``.
* ``metrics``: every metric name starts with ``loss/`` and every metric value is finite.
* ``masked_gradient``: positions with ``loss_mask`` 0 get exactly zero gradient.
* ``masked_inputs``: other garbage at the masked positions changes neither the loss nor the gradients.
* ``zero_mask``: an all-zero mask gives exactly zero total, denominator and value, exactly zero gradients and
  finite metrics.
* ``eager``: jit equals eager (on the first example: eager runs op by op, compiling each op for its shapes).
* ``no_retrace``: a call with new values and already-seen shapes does not retrace.
* ``micro_batches``: cutting the rows into micro-batches, the sum of their ``LossSum``s is the whole batch's,
  ``combine_metrics`` of their metrics gives its metric values, and ``sum_k grad(total_k) / sum_k denom_k``
  is its gradient (exact gradient accumulation). Skipped with ``accumulates=False``.
* ``padding``: right-padding wider with masked garbage changes neither the loss, the metrics nor any
  sequence's per-token gradients.
* ``packing``: sequences packed several per row (segment ids 1, 2, ...) give the unpacked loss, metrics and
  per-token gradients.
* ``ratio_one``: with ``old_logprobs == behavior_logprobs == logprobs`` and one advantage per sequence, the
  gradient of the loss value wrt ``logprobs`` is the REINFORCE gradient ``-d agg(A * logprobs)`` of the given
  aggregation mode, computed independently in NumPy. Skipped with ``ratio_one=None``.
* ``depends_on_logprobs``: the gradient wrt ``logprobs`` is non-zero on some example.

Tolerances: float32 with ``rtol=1e-5`` everywhere, ``atol=1e-7`` for per-token gradients and ``atol=1e-6`` for
scalars (totals, values, metrics: sums of many terms near zero). Two layouts of one example compute the same
numbers and differ only in summation order, so a difference beyond this is a defect, not rounding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection
from typing import Any

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np

from feynrl_jax.losses import AGGREGATIONS, LossSum, combine_metrics, compute_metrics
from feynrl_jax.testing.strategies import INPUT_FIELDS, LossExample, LossInputs, loss_examples

CHECKS: dict[str, str] = {
    "jit": "the loss and its gradient run under jax.jit",
    "finite": "finite loss, positive denominator and finite gradients wrt logprobs, entropy and values",
    "metrics": "metric names start with 'loss/' and metric values are finite",
    "masked_gradient": "masked positions get exactly zero gradient",
    "masked_inputs": "garbage at masked positions changes neither the loss nor the gradients",
    "zero_mask": "an all-zero mask gives zero total, denominator and value and exactly zero gradients",
    "eager": "jit equals eager (first example)",
    "no_retrace": "a call with new values and already-seen shapes does not retrace",
    "micro_batches": "micro-batch LossSums, metrics and gradients add up to the whole batch's",
    "padding": "right-padding with masked garbage changes neither the loss, metrics nor per-token gradients",
    "packing": "packed (several sequences per row, segment ids 1, 2, ...) equals unpacked",
    "ratio_one": "at ratio one the policy gradient is the REINFORCE gradient of the aggregation mode",
    "depends_on_logprobs": "the gradient wrt logprobs is non-zero on some example",
}
RTOL = 1e-5
GRAD_ATOL = 1e-7
SCALAR_ATOL = 1e-6


class LossContractError(AssertionError):
    """A loss broke a property of the contract.

    Attributes:
        check: the property's name (a key of ``CHECKS``).
        field: what differed or failed (e.g. ``"gradient wrt logprobs"``), or None.
        example: the drawn :class:`LossExample` (rebuild its layouts to debug), or None.
    """

    def __init__(self, check: str, detail: str, *, field: str | None = None, example: LossExample | None = None):
        self.check, self.field, self.example = check, field, example
        lines = [f"check_loss: property {check!r} failed ({CHECKS.get(check, check)})"]
        lines[0] += f": {field}" if field else ""
        lines.append(detail.strip())
        if example is not None:
            lines.append(f"Example: {example.describe()}.")
            lines.append(
                "Reproduce: check_loss with the same seed and options draws the same examples; "
                "`error.example.unpacked()` (or .padded(), .packed(), .micro_batches(), .ratio_one()) rebuilds "
                "the inputs."
            )
        super().__init__("\n".join(line for line in lines if line))


@dataclasses.dataclass(frozen=True)
class LossCheckReport:
    """What :func:`check_loss` verified.

    Attributes:
        passed: the checks that ran and passed, in contract order.
        skipped: check name -> why it did not run.
        notes: check name -> what a check that ran left out (e.g. batch-level metrics).
        examples: how many drawn examples every check ran on.
        shapes: the distinct ``[B, T]`` input shapes the jitted loss compiled for.
    """

    passed: tuple[str, ...]
    skipped: dict[str, str]
    notes: dict[str, str]
    examples: int
    shapes: tuple[tuple[int, int], ...]

    def __str__(self) -> str:
        lines = [
            f"check_loss: {len(self.passed)} checks passed on {self.examples} examples (shapes {list(self.shapes)})"
        ]
        for name in self.passed:
            note = f" ({self.notes[name]})" if name in self.notes else ""
            lines.append(f"  passed   {name}: {CHECKS[name]}{note}")
        lines += [f"  skipped  {name}: {why}" for name, why in self.skipped.items()]
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class _Outcome:
    """One call's results as host arrays."""

    total: float
    denom: float
    value: float
    metrics: dict[str, Any]  # name -> Metric (device arrays), for combine_metrics
    metric_values: dict[str, float]
    grads: dict[str, np.ndarray]  # input name -> [B, T]


def reinforce_gradient(
    mask: np.ndarray, advantages: np.ndarray, segment_ids: np.ndarray, mode: str, max_tokens: float | None
) -> np.ndarray:
    """``d/dlogprobs`` of ``-agg(A * logprobs)``, the policy gradient at ratio one, in NumPy float64.

    Args:
        mask: [B, T] loss mask.
        advantages: [B, T] advantages.
        segment_ids: [B, T] segment ids (a sequence is a run of one non-zero id in a row).
        mode: aggregation mode (a key of ``AGGREGATIONS``).
        max_tokens: the constant normaliser of ``seq_mean_token_sum``.

    Returns:
        [B, T] float64 gradient of the loss value (``total / denom``).
    """
    mask, adv = mask.astype(np.float64), advantages.astype(np.float64)
    if mode == "token_mean":
        return -(mask * adv) / max(mask.sum(), 1.0)
    runs = []
    for r, row in enumerate(segment_ids):
        # Run boundaries: the row's ends and every change of segment id; a run of id 0 is padding.
        bounds = np.flatnonzero(np.r_[True, row[1:] != row[:-1], True])
        runs += [(r, slice(a, b)) for a, b in zip(bounds[:-1], bounds[1:]) if row[a] != 0]
    runs = [(r, s) for r, s in runs if mask[r, s].sum() > 0]
    grad = np.zeros_like(mask)
    for r, s in runs:
        scale = mask[r, s].sum() if mode == "seq_mean_token_mean" else max_tokens
        grad[r, s] = -(mask[r, s] * adv[r, s]) / (scale * len(runs))
    return grad


class _Harness:
    """Holds the jitted and eager objective, the trace counter and the checks selected."""

    def __init__(
        self,
        loss_fn,
        selected: set[str],
        ratio_one: str | None,
        max_tokens: float | None,
        batch_level_metrics: Collection[str],
    ):
        self.selected, self.ratio_one, self.max_tokens = selected, ratio_one, max_tokens
        self.batch_level_metrics = frozenset(batch_level_metrics)
        self.traces = 0
        self.signatures: set[Any] = set()
        self.shapes: list[tuple[int, int]] = []
        self.nonzero_logprob_gradient = False
        self.eager_example: str | None = None
        self.examples = 0

        def objective(logprobs, entropy, values, batch):
            loss, metrics = loss_fn(logprobs, batch, entropy=entropy, values=values)
            return loss.total, (loss, metrics)

        def run(logprobs, entropy, values, batch):
            grads, (loss, metrics) = jax.grad(objective, argnums=(0, 1, 2), has_aux=True)(
                logprobs, entropy, values, batch
            )
            return loss, metrics, grads

        def traced(*args):
            self.traces += 1
            return run(*args)

        self.jitted, self.eager = jax.jit(traced), run

    # --- calling --------------------------------------------------------------------------------------------

    def call(self, inputs: LossInputs, example: LossExample, *, eager: bool = False) -> _Outcome:
        args = (inputs.logprobs, inputs.entropy, inputs.values, inputs.batch)
        check = "eager" if eager else "jit"
        signature = (
            jax.tree_util.tree_structure(args),
            tuple((a.shape, a.dtype) for a in jax.tree_util.tree_leaves(args)),
        )
        before = self.traces
        try:
            loss, metrics, grads = (self.eager if eager else self.jitted)(*args)
            if not isinstance(loss, LossSum):
                raise TypeError(f"the loss must return (LossSum, metrics), got {type(loss).__name__} first")
            outcome = _Outcome(
                total=float(loss.total),
                denom=float(loss.denom),
                value=float(loss.value),
                metrics=dict(metrics),
                metric_values={name: float(v) for name, v in compute_metrics(metrics).items()},
                grads={name: np.asarray(g) for name, g in zip(INPUT_FIELDS, grads)},
            )
        except LossContractError:
            raise
        except Exception as error:  # any failure of the user's loss is reported as the property
            raise LossContractError(
                check,
                f"calling the loss on the {inputs.name} layout {list(inputs.shape)} raised {error!r}",
                example=example,
            ) from error
        if not eager:
            if self.traces > before and signature in self.signatures and "no_retrace" in self.selected:
                raise LossContractError(
                    "no_retrace",
                    f"the {inputs.name} layout {list(inputs.shape)} retraced with already-seen shapes",
                    example=example,
                )
            if signature not in self.signatures:
                self.signatures.add(signature)
                self.shapes.append(inputs.shape)
        return outcome

    # --- comparisons ------------------------------------------------------------------------------------------

    @staticmethod
    def close(check, field, actual, expected, example, *, atol, exact=False):
        try:
            if exact:
                np.testing.assert_array_equal(actual, expected)
            else:
                np.testing.assert_allclose(actual, expected, rtol=RTOL, atol=atol)
        except AssertionError as error:
            raise LossContractError(check, str(error), field=field, example=example) from None

    def same_loss(self, check, out: _Outcome, base: _Outcome, layout: str, example) -> None:
        for name in ("total", "denom", "value"):
            self.close(
                check,
                f"loss {name} ({layout} vs unpacked)",
                getattr(out, name),
                getattr(base, name),
                example,
                atol=SCALAR_ATOL,
            )
        if out.metric_values.keys() != base.metric_values.keys():
            raise LossContractError(
                check,
                f"metric names differ: {sorted(out.metric_values.keys() ^ base.metric_values.keys())}",
                field=f"metrics ({layout} vs unpacked)",
                example=example,
            )
        for name, value in out.metric_values.items():
            self.close(
                check,
                f"metric {name} ({layout} vs unpacked)",
                value,
                base.metric_values[name],
                example,
                atol=SCALAR_ATOL,
            )

    def same_gradients(self, check, out: _Outcome, base: _Outcome, label: str, example) -> None:
        for name in INPUT_FIELDS:
            self.close(check, f"gradient wrt {name}{label}", out.grads[name], base.grads[name], example, atol=GRAD_ATOL)

    def same_sequence_gradients(self, check, out, layout: LossInputs, base, base_layout: LossInputs, example):
        masks = layout.per_sequence(layout.batch.loss_mask)
        for name in INPUT_FIELDS:
            pairs = zip(layout.per_sequence(out.grads[name]), base_layout.per_sequence(base.grads[name]), masks)
            for k, (g, g0, m) in enumerate(pairs):
                self.close(
                    check,
                    f"gradient wrt {name}, sequence {k} ({layout.name} vs unpacked)",
                    g * m,
                    g0 * m,
                    example,
                    atol=GRAD_ATOL,
                )

    # --- the checks -------------------------------------------------------------------------------------------

    def check_example(self, example: LossExample) -> None:
        self.examples += 1
        selected = self.selected
        base_layout = example.unpacked()
        base = self.call(base_layout, example)
        self.check_single(base, base_layout, example)
        self.nonzero_logprob_gradient |= bool(np.any(base.grads["logprobs"] != 0))

        if "masked_inputs" in selected:
            other = example.unpacked(garbage=1)
            out = self.call(other, example)
            self.same_loss("masked_inputs", out, base, "other masked garbage", example)
            self.same_gradients("masked_inputs", out, base, "", example)

        if "zero_mask" in selected:
            batch = dataclasses.replace(base_layout.batch, loss_mask=jnp.zeros_like(base_layout.batch.loss_mask))
            out = self.call(dataclasses.replace(base_layout, batch=batch, name="zero-mask"), example)
            for name in ("total", "denom", "value"):
                self.close("zero_mask", f"loss {name}", getattr(out, name), 0.0, example, atol=0, exact=True)
            for name in INPUT_FIELDS:
                self.close("zero_mask", f"gradient wrt {name}", out.grads[name], 0.0, example, atol=0, exact=True)
            for name, value in out.metric_values.items():
                if not np.isfinite(value):
                    raise LossContractError("zero_mask", f"value {value}", field=f"metric {name}", example=example)

        # Op by op is slow: the first example only (and again when hypothesis replays it to report a failure).
        self.eager_example = self.eager_example or example.describe()
        if "eager" in selected and example.describe() == self.eager_example:
            out = self.call(base_layout, example, eager=True)
            for name in ("total", "denom", "value"):
                self.close(
                    "eager",
                    f"loss {name} (eager vs jit)",
                    getattr(out, name),
                    getattr(base, name),
                    example,
                    atol=SCALAR_ATOL,
                )
            self.same_gradients("eager", out, base, " (eager vs jit)", example)

        if "micro_batches" in selected:
            self.check_micro_batches(example, base, base_layout)

        for check, layout in (("padding", example.padded), ("packing", example.packed)):
            if check in selected:
                inputs = layout()
                out = self.call(inputs, example)
                self.check_single(out, inputs, example)
                self.same_loss(check, out, base, inputs.name, example)
                self.same_sequence_gradients(check, out, inputs, base, base_layout, example)

        if "ratio_one" in selected:
            ratio_one = example.ratio_one()
            for inputs in (ratio_one.unpacked(), ratio_one.packed()):
                self.check_ratio_one(self.call(inputs, example), inputs, example)

    def check_single(self, out: _Outcome, inputs: LossInputs, example) -> None:
        """The checks on one call: finite values and gradients, metrics, zero gradient at masked positions."""
        where = f" ({inputs.name} layout {list(inputs.shape)})"
        if "finite" in self.selected:
            for name in ("total", "denom", "value"):
                if not np.isfinite(getattr(out, name)):
                    raise LossContractError(
                        "finite", f"{getattr(out, name)}", field=f"loss {name}{where}", example=example
                    )
            if not out.denom > 0:
                raise LossContractError(
                    "finite",
                    f"denominator {out.denom} on a batch with valid tokens",
                    field=f"loss denom{where}",
                    example=example,
                )
            for name, grad in out.grads.items():
                bad = np.argwhere(~np.isfinite(grad))
                if bad.size:
                    raise LossContractError(
                        "finite",
                        f"{len(bad)} non-finite entries, first at [row, col] {bad[0].tolist()}: {grad[tuple(bad[0])]}",
                        field=f"gradient wrt {name}{where}",
                        example=example,
                    )
        if "metrics" in self.selected:
            for name, value in out.metric_values.items():
                if not name.startswith("loss/"):
                    raise LossContractError("metrics", f"metric {name!r} is not under 'loss/'", example=example)
                if not np.isfinite(value):
                    raise LossContractError("metrics", f"value {value}", field=f"metric {name}{where}", example=example)
        if "masked_gradient" in self.selected:
            masked = np.asarray(inputs.batch.loss_mask) == 0
            for name, grad in out.grads.items():
                self.close(
                    "masked_gradient",
                    f"gradient wrt {name} at masked positions{where}",
                    grad[masked],
                    0.0,
                    example,
                    atol=0,
                    exact=True,
                )

    def check_micro_batches(self, example: LossExample, base: _Outcome, base_layout: LossInputs) -> None:
        parts = example.micro_batches()
        outs = [self.call(part, example) for part in parts]
        total, denom = sum(o.total for o in outs), sum(o.denom for o in outs)
        field = f"sum over micro-batches cut at rows {list(example.cuts)}"
        self.close("micro_batches", f"loss total ({field})", total, base.total, example, atol=SCALAR_ATOL)
        self.close("micro_batches", f"loss denom ({field})", denom, base.denom, example, atol=SCALAR_ATOL)
        value = total / denom if denom else 0.0
        self.close("micro_batches", f"loss value ({field})", value, base.value, example, atol=SCALAR_ATOL)
        # Denominators do not depend on the inputs, so the accumulated gradient is sum(grad total_k) / sum(denom_k).
        mask = np.asarray(base_layout.batch.loss_mask)
        for name in INPUT_FIELDS:
            grad = np.concatenate([o.grads[name] for o in outs]) / denom
            self.close(
                "micro_batches",
                f"gradient wrt {name} ({field})",
                grad * mask,
                base.grads[name] / base.denom * mask,
                example,
                atol=GRAD_ATOL,
            )
        metrics = outs[0].metrics
        try:
            for o in outs[1:]:
                metrics = combine_metrics(metrics, o.metrics)
        except ValueError as error:
            raise LossContractError("micro_batches", str(error), field="combine_metrics", example=example) from None
        for name, value in compute_metrics(metrics).items():
            if name in self.batch_level_metrics:
                continue
            self.close(
                "micro_batches",
                f"metric {name} (combine_metrics over micro-batches)",
                float(value),
                base.metric_values[name],
                example,
                atol=SCALAR_ATOL,
            )

    def check_ratio_one(self, out: _Outcome, inputs: LossInputs, example: LossExample) -> None:
        batch = inputs.batch
        mask = np.asarray(batch.loss_mask)
        expected = reinforce_gradient(
            mask, np.asarray(batch.advantages), np.asarray(batch.segment_ids), self.ratio_one, self.max_tokens
        )
        actual = out.grads["logprobs"] / out.denom if out.denom else out.grads["logprobs"]
        self.close(
            "ratio_one",
            f"d loss value / d logprobs vs REINFORCE with loss_agg={self.ratio_one!r} "
            f"({inputs.name} layout {list(inputs.shape)})",
            actual * mask,
            expected * mask,
            example,
            atol=GRAD_ATOL,
        )


def check_loss(
    loss_fn: Callable[..., tuple[LossSum, dict[str, Any]]],
    *,
    max_examples: int = 10,
    seed: int = 0,
    accumulates: bool = True,
    batch_level_metrics: Collection[str] = (),
    ratio_one: str | None = None,
    max_tokens: float | None = None,
    checks: Collection[str] | None = None,
    num_sequences: tuple[int, ...] = (4,),
    max_length: int = 8,
) -> LossCheckReport:
    """Runs the loss contract on drawn examples; raises on the first property that fails.

    Every example is laid out unpacked, unpacked with other masked garbage, padded wider, packed and cut into
    micro-batches (see :mod:`feynrl_jax.testing.strategies`); the loss runs under one ``jax.jit`` that compiles
    once per input shape (three or four per sequence count of ``num_sequences``), and eagerly on the first example.

    Args:
        loss_fn: ``loss_fn(logprobs [B, T], batch, *, entropy [B, T], values [B, T]) -> (LossSum, metrics)``
            with its hyperparameters bound, e.g. ``ALGORITHMS["grpo"].make_loss(kl_coef=0.0)``.
        max_examples: how many examples hypothesis draws.
        seed: hypothesis's seed; the same seed and options draw the same examples.
        accumulates: False for a loss with batch-level statistics (e.g. P3O's ESS), whose micro-batches do not
            add up to the whole batch: skips ``micro_batches`` (the report says so).
        batch_level_metrics: names of metrics that are statistics of the whole batch given to the loss (e.g. an
            effective sample size), left out of the ``micro_batches`` comparison of combined metrics; the report
            lists them.
        ratio_one: the aggregation mode (``loss_agg``: "token_mean", "seq_mean_token_mean" or
            "seq_mean_token_sum") whose REINFORCE gradient the loss must equal at ratio one; None skips
            ``ratio_one``. Bind hyperparameters that add other logprob gradients to zero (e.g. ``kl_coef=0``).
        max_tokens: the constant normaliser of ``ratio_one="seq_mean_token_sum"``.
        checks: run only these checks (names of ``CHECKS``); None runs all that apply. ``jit`` always runs.
        num_sequences: the pool of (even) sequence counts per example; each count adds compiled shapes.
        max_length: the longest sequence, the unpacked width.

    Returns:
        A LossCheckReport listing the checks that passed and those skipped with the reason.

    Raises:
        LossContractError: an ``AssertionError`` naming the failed property, the field and the drawn example.
        ValueError: for unknown check names or a ``ratio_one`` mode without what it needs.
    """
    if checks is not None:
        unknown = sorted(set(checks) - set(CHECKS))
        if unknown:
            raise ValueError(f"unknown check(s) {unknown}; known: {list(CHECKS)}")
    if ratio_one is not None and ratio_one not in AGGREGATIONS:
        raise ValueError(f"ratio_one={ratio_one!r} is not an aggregation mode: {sorted(AGGREGATIONS)}")
    if (ratio_one == "seq_mean_token_sum") != (max_tokens is not None):
        raise ValueError("max_tokens is needed by ratio_one='seq_mean_token_sum' and by no other mode")
    if max_examples < 1:
        raise ValueError(f"max_examples must be at least 1, got {max_examples}")

    skipped = {}
    if checks is not None:
        skipped |= {name: f"not selected (checks={sorted(checks)})" for name in CHECKS if name not in {*checks, "jit"}}
    if not accumulates:
        skipped.setdefault("micro_batches", "accumulates=False: the loss has batch-level statistics")
    if ratio_one is None:
        skipped.setdefault("ratio_one", "ratio_one=None: no aggregation mode to reduce to")
    selected = {name for name in CHECKS if name not in skipped}
    notes = {}
    if batch_level_metrics and "micro_batches" in selected:
        notes["micro_batches"] = f"batch-level metrics {sorted(batch_level_metrics)} not compared"
    harness = _Harness(loss_fn, selected, ratio_one, max_tokens, batch_level_metrics)

    @hypothesis.settings(
        max_examples=max_examples,
        deadline=None,
        database=None,
        derandomize=False,
        phases=(hypothesis.Phase.explicit, hypothesis.Phase.generate),
        report_multiple_bugs=False,
        suppress_health_check=(hypothesis.HealthCheck.too_slow, hypothesis.HealthCheck.data_too_large),
    )
    @hypothesis.given(loss_examples(num_sequences=num_sequences, max_length=max_length))
    def run_examples(example):
        harness.check_example(example)

    try:
        hypothesis.seed(seed)(run_examples)()
    except hypothesis.errors.Flaky as error:
        raise LossContractError(
            "deterministic",
            "an example failed once and passed when hypothesis ran it again: the loss is not a pure function of "
            f"its inputs (Python-side state?). First failure: {error!r}",
        ) from error
    if "depends_on_logprobs" in selected and not harness.nonzero_logprob_gradient:
        raise LossContractError(
            "depends_on_logprobs", f"the gradient wrt logprobs was exactly zero on all {harness.examples} examples"
        )
    return LossCheckReport(
        passed=tuple(name for name in CHECKS if name in selected),
        skipped=skipped,
        notes=notes,
        examples=harness.examples,
        shapes=tuple(harness.shapes),
    )
