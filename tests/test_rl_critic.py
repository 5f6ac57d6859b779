"""The PPO critic: values aligned like log-probabilities (causal, entry 0 empty), and its step fits returns."""

import jax
import jax.numpy as jnp
import numpy as np

from feynrl_jax.losses import TrainBatch
from feynrl_jax.models import ModelConfig, init_params
from feynrl_jax.sharding import get_rules, make_mesh
from feynrl_jax.train.critic import critic_values, init_critic_params, make_critic_train_step, value_loss
from feynrl_jax.train.optimizer import make_optimizer

CONFIG = ModelConfig(
    architecture="llama",
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
    max_position_embeddings=64,
    tie_word_embeddings=True,
)


def critic():
    params = init_critic_params(init_params(CONFIG, jax.random.key(0)), CONFIG)
    params["value_head"]["kernel"] = jax.random.normal(jax.random.key(1), (CONFIG.hidden_size,))
    return params


def test_values_are_causal_and_shifted_by_one():
    params = critic()
    tokens = jnp.array([[3, 4, 5, 6, 7, 8]], jnp.int32)
    positions = jnp.arange(6, dtype=jnp.int32)[None]
    segments = jnp.ones_like(tokens)
    values = critic_values(params, tokens, positions, segments, config=CONFIG)
    assert values.shape == (1, 6) and float(values[0, 0]) == 0.0
    # values[:, t] = V(tokens[:, :t]): changing token 3 leaves values[:, :4] unchanged and moves values[:, 4].
    changed = critic_values(params, tokens.at[0, 3].set(9), positions, segments, config=CONFIG)
    np.testing.assert_array_equal(values[0, :4], changed[0, :4])
    assert float(jnp.abs(values[0, 4] - changed[0, 4])) > 0


def test_value_loss_is_clipped_around_the_old_values():
    mask = jnp.ones((1, 2))
    batch = TrainBatch(
        tokens=jnp.zeros((1, 2), jnp.int32),
        positions=jnp.zeros((1, 2), jnp.int32),
        segment_ids=jnp.ones((1, 2), jnp.int32),
        loss_mask=mask,
        advantages=jnp.zeros((1, 2)),
        old_logprobs=jnp.zeros((1, 2)),
        values=jnp.zeros((1, 2)),
        returns=jnp.ones((1, 2)),
    )
    # Moving V from 0 to 1 fits the return, but the clipped branch (0 + 0.2) still errs by 0.8: max of both.
    loss, metrics = value_loss(jnp.ones((1, 2)), batch, value_clip=0.2)
    np.testing.assert_allclose(loss.total / loss.denom, 0.5 * 0.8**2, rtol=1e-6)
    unclipped, _ = value_loss(jnp.ones((1, 2)), batch, value_clip=None)
    assert float(unclipped.total) == 0.0


def test_critic_step_fits_the_returns():
    mesh, rules = make_mesh(1, 1, 1, devices=jax.devices()[:1]), get_rules("dp")
    step = make_critic_train_step(
        CONFIG, make_optimizer(1e-2, schedule="constant")[0], mesh, rules, value_clip=None, grad_accum=1
    )
    state = step.init_state(critic())
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 64, (2, 8)), jnp.int32)
    mask = jnp.asarray(np.r_[[[0] * 4 + [1] * 4] * 2], jnp.float32)
    batch = TrainBatch(
        tokens=tokens,
        positions=jnp.broadcast_to(jnp.arange(8, dtype=jnp.int32), (2, 8)),
        segment_ids=jnp.ones((2, 8), jnp.int32),
        loss_mask=mask,
        advantages=jnp.zeros((2, 8)),
        old_logprobs=jnp.zeros((2, 8)),
        values=jnp.zeros((2, 8)),
        returns=mask * jnp.array([[1.0], [-1.0]]),
    )
    losses = []
    for _ in range(30):
        state, metrics = step(state, step.place_batch(batch))
        losses.append(float(metrics["train/loss"].value))
    assert losses[-1] < 0.1 * losses[0]
