"""AdamW, its schedule and clipping, the micro-batch split and the non-finite guard: pieces of the train step
that need no model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from feynrl_jax.train.microbatch import check_divisible, merge_microbatches, split_microbatches
from feynrl_jax.train.nonfinite import NonFiniteError, NonFiniteGuard
from feynrl_jax.train.optimizer import learning_rate_schedule, make_optimizer, weight_decay_mask
from feynrl_jax.train.state import TrainState, create_train_state


def test_warmup_then_cosine_schedule():
    lr = learning_rate_schedule(
        1e-3, warmup_steps=10, total_steps=110, schedule="cosine", final_learning_rate_ratio=0.1
    )
    np.testing.assert_allclose([float(lr(s)) for s in (0, 5, 10)], [0.0, 5e-4, 1e-3], rtol=1e-6)
    # Half-way through the decay: the cosine midpoint between the peak and the floor.
    np.testing.assert_allclose(float(lr(60)), 1e-4 + (1e-3 - 1e-4) * 0.5, rtol=1e-5)
    np.testing.assert_allclose(float(lr(110)), 1e-4, rtol=1e-5)
    constant = learning_rate_schedule(2e-5, warmup_steps=4, schedule="constant")
    np.testing.assert_allclose([float(constant(s)) for s in (2, 4, 1000)], [1e-5, 2e-5, 2e-5], rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(schedule="linear"), r"schedule must be one of \('cosine', 'constant'\)"),
        (dict(schedule="cosine", total_steps=5, warmup_steps=5), r"needs total_steps > warmup_steps"),
        (dict(schedule="constant", warmup_steps=-1), r"warmup_steps must be >= 0"),
        (dict(schedule="constant", final_learning_rate_ratio=2.0), r"final_learning_rate_ratio must be in"),
    ],
)
def test_schedule_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        learning_rate_schedule(1e-3, **kwargs)


def test_weight_decay_applies_to_matrices_only():
    params = {"embed": {"embedding": jnp.ones((4, 2))}, "norm": {"scale": jnp.ones(2)}, "q": {"bias": jnp.ones(2)}}
    assert weight_decay_mask(params) == {"embed": {"embedding": True}, "norm": {"scale": False}, "q": {"bias": False}}
    optimizer, _ = make_optimizer(0.1, schedule="constant", weight_decay=0.5, max_grad_norm=None)
    zero_grads = jax.tree.map(jnp.zeros_like, params)
    updates, _ = optimizer.update(zero_grads, optimizer.init(params), params)
    # With a zero gradient only decoupled weight decay moves a parameter: -lr * wd * p.
    np.testing.assert_allclose(updates["embed"]["embedding"], -0.05)
    np.testing.assert_array_equal(updates["norm"]["scale"], 0.0)


def test_gradients_are_clipped_to_the_global_norm():
    params = {"w": {"kernel": jnp.zeros(4)}}
    clipped, _ = make_optimizer(1.0, schedule="constant", max_grad_norm=1.0, b1=0.0, b2=0.0, eps=1e-12)
    grads = {"w": {"kernel": jnp.asarray([30.0, 40.0, 0.0, 0.0])}}
    state = clipped.init(params)
    # Adam with b1 = b2 = 0 returns about sign(g); clipping shows in the first moment of the state.
    updates, state = clipped.update(grads, state, params)
    adam_state = state[1][0]
    np.testing.assert_allclose(adam_state.mu["w"]["kernel"], [0.6, 0.8, 0.0, 0.0], rtol=1e-6)
    # A weight whose gradient is 0 does not move (0 / (0 + eps)); eps = 0 would make it 0 / 0, NaN.
    np.testing.assert_allclose(updates["w"]["kernel"], [-1.0, -1.0, 0.0, 0.0], rtol=1e-6)
    with pytest.raises(ValueError, match="max_grad_norm must be positive"):
        make_optimizer(1.0, schedule="constant", max_grad_norm=0.0)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"eps": 0.0}, "eps must be at least float32.s smallest normal number"),
        ({"eps": float("nan")}, "eps must be finite"),
        ({"weight_decay": float("inf")}, "weight_decay must be finite"),
        ({"learning_rate": float("inf")}, "learning_rate must be positive and finite"),
        ({"b2": 1.0}, r"b1 and b2 must be in \[0, 1\)"),
        ({"b1": 0.99999999}, r"b1 and b2 must be in \[0, 1\), also in float32"),
        ({"eps": 1e-45}, "eps must be at least float32's smallest normal number"),
        ({"max_grad_norm": float("nan")}, "max_grad_norm must be positive"),
    ],
)
def test_the_optimizer_refuses_settings_that_make_a_finite_gradient_give_non_finite_weights(kwargs, message):
    # The runs' train steps skip an update for a non-finite gradient or loss alone (check_updated=False): they rely
    # on the AdamW turning a finite gradient, params and state into finite ones (make_optimizer's docstring).
    with pytest.raises(ValueError, match=message):
        make_optimizer(**{"learning_rate": 1e-3, "schedule": "constant", **kwargs})


def test_train_state_is_a_pytree_with_zero_counters():
    optimizer = optax.adam(1e-3)
    state = create_train_state({"w": jnp.ones(3)}, optimizer)
    assert isinstance(state, TrainState) and int(state.step) == 0 and int(state.nonfinite_total) == 0
    leaves = jax.tree.leaves(state)
    assert len(leaves) == 1 + len(jax.tree.leaves(optimizer.init({"w": jnp.ones(3)}))) + 3
    doubled = jax.tree.map(lambda x: x * 2, state)
    assert isinstance(doubled, TrainState)


@pytest.mark.parametrize("num, rows_per_example", [(1, 1), (4, 1), (2, 2), (4, 2)])
def test_microbatch_split_round_trips_and_keeps_examples_together(num, rows_per_example):
    rows = np.arange(16)
    batch = {"tokens": np.stack([rows, rows * 10], axis=1), "mask": rows.astype(np.float32)}
    split = split_microbatches(batch, num, rows_per_example)
    assert split["tokens"].shape == (num, 16 // num, 2)
    for m in range(num):
        got = np.asarray(split["mask"][m]).astype(int)
        # Micro-batch m holds example units m, m + num, ...; each unit's rows stay adjacent and in order.
        units = got.reshape(-1, rows_per_example)
        assert np.all(units[:, 0] // rows_per_example % num == m)
        assert np.all(np.diff(units, axis=1) == 1)
    merged = merge_microbatches(split, rows_per_example)
    jax.tree.map(np.testing.assert_array_equal, jax.tree.map(np.asarray, merged), batch)


def test_microbatch_divisibility_error_names_every_factor():
    check_divisible(32, 4, 2, 4)
    with pytest.raises(ValueError, match=r"B must be a multiple of 4 x 2 x 8 = 64"):
        check_divisible(32, 4, 2, 8)


def test_guard_needs_the_step_metrics():
    guard = NonFiniteGuard(max_consecutive=0)
    guard.check({"train/nonfinite_streak": 0})
    with pytest.raises(NonFiniteError, match=r"for 1 consecutive steps \(limit 0, 3 skipped in total\)"):
        guard.check({"train/nonfinite_streak": 1, "train/nonfinite_total": 3})
    with pytest.raises(KeyError, match="train/nonfinite_streak"):
        guard.check({"train/loss": 1.0})
    # A written non-finite state stops the run at once, whatever the streak limit.
    guard = NonFiniteGuard(max_consecutive=5)
    guard.check({"train/nonfinite_streak": 0, "train/nonfinite_state": 0.0})
    with pytest.raises(NonFiniteError, match=r"update at step 4 wrote NaN .* nothing of it was saved"):
        guard.check({"train/nonfinite_streak": 0, "train/nonfinite_state": 1.0}, step=4)
    with pytest.raises(ValueError, match="max_consecutive must be >= 0"):
        NonFiniteGuard(-1)
