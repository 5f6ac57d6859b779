"""Advantage estimators.

Sequence-level estimators share one signature::

    fn(rewards [N] f32, group_id [N] int, completion_mask [N, C] f32, **hparams) -> advantages [N, C] f32

Rows of one group (the samples of one prompt) are consecutive; a group is a maximal run of equal
``group_id`` (so groups may have different sizes, e.g. after dynamic-sampling filters). The sequence advantage
is broadcast to every completion token (0 where ``completion_mask`` is 0). A group of one sample has no
baseline and gets advantage 0 from the group estimators.

* :func:`group_zscore` (GRPO, Shao et al. 2024, "DeepSeekMath"): ``(r - mean_g) / (std_g + eps)`` with the
  Bessel-corrected (``n - 1``) standard deviation; ``eps = 1e-6`` keeps groups whose rewards are all equal at
  advantage 0 instead of 0/0.
* :func:`group_mean` (Dr. GRPO, Liu et al. 2025): ``r - mean_g``, no division by the std (which biases
  towards too easy / too hard questions).
* :func:`rloo` (Ahmadian et al. 2024, "Back to Basics"): ``r_i - mean_{j != i} r_j = n / (n - 1) (r_i - mean_g)``.
* :func:`reinforce_pp` (Hu 2025, "REINFORCE++"): per-token return ``G_t = r - sum_{s >= t} penalty_s``
  (gamma = 1, the sequence reward arrives at the last token, an optional per-token penalty such as
  ``kl.kl_reward_penalty``), whitened over all valid tokens of the batch (Bessel-corrected std, ``eps``).

Token-level estimator (PPO with a critic):

* :func:`gae` (Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE"): per-token rewards,
  values and mask ``[B, T]`` plus ``done [B]``; computed with a reverse ``lax.scan`` over the valid tokens of
  each row (masked tokens are skipped, so prompts and padding may sit anywhere). After the last valid token the
  next value is 0 if ``done`` (a real stop) and otherwise the value at that last token (a truncated response
  bootstraps from its own value: the value of the state after it is not available). Rows must be unpacked.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from feynrl_jax.losses import sequences


def _check_sequence_inputs(name: str, rewards: jax.Array, group_id: jax.Array, completion_mask: jax.Array) -> None:
    n = rewards.shape[0]
    if rewards.ndim != 1:
        raise ValueError(f"{name}: rewards must be [N], got shape {rewards.shape}")
    if group_id.shape != (n,):
        raise ValueError(f"{name}: group_id has shape {group_id.shape}, expected ({n},) like rewards")
    if completion_mask.ndim != 2 or completion_mask.shape[0] != n:
        raise ValueError(f"{name}: completion_mask has shape {completion_mask.shape}, expected ({n}, C)")


def _group_stats(rewards: jax.Array, group_id: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-row group size, group mean and Bessel-corrected group variance (0 for groups of one). All [N]."""
    n = rewards.shape[0]
    previous = jnp.concatenate([group_id[:1], group_id[:-1]])
    starts = (group_id != previous).at[0].set(True)
    index = jnp.cumsum(starts.astype(jnp.int32)) - 1
    size = jax.ops.segment_sum(jnp.ones_like(rewards), index, num_segments=n)[index]
    mean = jax.ops.segment_sum(rewards, index, num_segments=n)[index] / size
    squares = jax.ops.segment_sum(jnp.square(rewards - mean), index, num_segments=n)[index]
    var = sequences.safe_divide(squares, size - 1)
    return size, mean, var


def _broadcast(sequence_advantages: jax.Array, completion_mask: jax.Array) -> jax.Array:
    return sequence_advantages[:, None] * completion_mask


def group_zscore(
    rewards: jax.Array, group_id: jax.Array, completion_mask: jax.Array, *, eps: float = 1e-6
) -> jax.Array:
    """GRPO advantages ``(r - mean_g) / (std_g + eps)`` (Bessel-corrected std), broadcast over the completion.

    Args:
        rewards: [N] sequence rewards.
        group_id: [N] group (prompt) ids; rows of a group are consecutive.
        completion_mask: [N, C] 1 on completion tokens.
        eps: added to the std.

    Returns:
        [N, C] advantages; 0 for groups of one sample.

    References:
        Shao et al. 2024, "DeepSeekMath", arXiv:2402.03300.
    """
    _check_sequence_inputs("group_zscore", rewards, group_id, completion_mask)
    size, mean, var = _group_stats(rewards, group_id)
    advantage = jnp.where(size > 1, (rewards - mean) / (jnp.sqrt(var) + eps), 0.0)
    return _broadcast(advantage, completion_mask)


def group_mean(rewards: jax.Array, group_id: jax.Array, completion_mask: jax.Array) -> jax.Array:
    """Dr. GRPO advantages ``r - mean_g``, broadcast over the completion.

    Args:
        rewards: [N]; group_id: [N]; completion_mask: [N, C] (see :func:`group_zscore`).

    Returns:
        [N, C] advantages; 0 for groups of one sample.

    References:
        Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective", arXiv:2503.20783.
    """
    _check_sequence_inputs("group_mean", rewards, group_id, completion_mask)
    size, mean, _ = _group_stats(rewards, group_id)
    return _broadcast(jnp.where(size > 1, rewards - mean, 0.0), completion_mask)


def rloo(rewards: jax.Array, group_id: jax.Array, completion_mask: jax.Array) -> jax.Array:
    """RLOO advantages ``r_i - mean_{j != i} r_j``, broadcast over the completion.

    Args:
        rewards: [N]; group_id: [N]; completion_mask: [N, C] (see :func:`group_zscore`).

    Returns:
        [N, C] advantages; 0 for groups of one sample.

    References:
        Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from
        Human Feedback in LLMs", arXiv:2402.14740.
    """
    _check_sequence_inputs("rloo", rewards, group_id, completion_mask)
    size, mean, _ = _group_stats(rewards, group_id)
    advantage = sequences.safe_divide(size * (rewards - mean), size - 1)
    return _broadcast(advantage, completion_mask)


def reinforce_pp(
    rewards: jax.Array,
    group_id: jax.Array,
    completion_mask: jax.Array,
    *,
    token_penalty: jax.Array | None = None,
    eps: float = 1e-6,
) -> jax.Array:
    """REINFORCE++ advantages: per-token returns whitened over all valid tokens of the batch.

    Args:
        rewards: [N] sequence rewards (arriving at each sequence's last token).
        group_id: [N] group ids (unused: REINFORCE++ uses a global, not a per-group, baseline).
        completion_mask: [N, C] 1 on completion tokens.
        token_penalty: optional [N, C] per-token penalty (e.g. ``kl.kl_reward_penalty``), subtracted from the
            reward-to-go of every earlier token (gamma = 1).
        eps: added to the std.

    Returns:
        [N, C] advantages, with zero mean and unit (Bessel) std over the valid tokens of the batch.

    References:
        Hu 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language Models",
        arXiv:2501.03262.
    """
    _check_sequence_inputs("reinforce_pp", rewards, group_id, completion_mask)
    mask = completion_mask
    returns = rewards[:, None] * mask
    if token_penalty is not None:
        if token_penalty.shape != mask.shape:
            raise ValueError(f"reinforce_pp: token_penalty has shape {token_penalty.shape}, expected {mask.shape}")
        to_go = jnp.cumsum((token_penalty * mask)[:, ::-1], axis=1)[:, ::-1]
        returns = returns - to_go * mask
    count = jnp.sum(mask)
    mean = sequences.safe_divide(jnp.sum(returns * mask), count)
    var = sequences.safe_divide(jnp.sum(jnp.square(returns - mean) * mask), count - 1)
    return (returns - mean) / (jnp.sqrt(var) + eps) * mask


def gae(
    token_rewards: jax.Array,
    values: jax.Array,
    mask: jax.Array,
    done: jax.Array,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[jax.Array, jax.Array]:
    """Generalised advantage estimation over the valid tokens of each row, with a reverse ``lax.scan``.

    ``delta_t = r_t + gamma * V_next - V_t``, ``A_t = delta_t + gamma * lam * A_next``, where "next" is the next
    valid token of the row; after the last valid token ``V_next = 0`` if ``done`` else ``V_last`` (bootstrap).

    Args:
        token_rewards: [B, T] per-token rewards (e.g. the sequence reward at the last token minus a KL penalty).
        values: [B, T] critic values at rollout time.
        mask: [B, T] 1 on completion tokens.
        done: [B] bool, True where the response ended with a real stop, False where it was truncated.
        gamma: discount.
        lam: GAE lambda.

    Returns:
        (advantages [B, T], returns [B, T] = advantages + values), both 0 where ``mask`` is 0.

    References:
        Schulman et al. 2016, "High-Dimensional Continuous Control Using Generalized Advantage Estimation",
        arXiv:1506.02438.
    """
    if not (token_rewards.shape == values.shape == mask.shape) or token_rewards.ndim != 2:
        raise ValueError(
            f"gae: token_rewards {token_rewards.shape}, values {values.shape} and mask {mask.shape} must all be [B, T]"
        )
    if done.shape != token_rewards.shape[:1]:
        raise ValueError(f"gae: done has shape {done.shape}, expected ({token_rewards.shape[0]},)")
    dtype = jnp.promote_types(token_rewards.dtype, jnp.float32)
    rewards, values, mask = (x.astype(dtype) for x in (token_rewards, values, mask))
    valid = mask > 0
    terminal_value = jnp.where(done, 0.0, 1.0).astype(dtype)

    def step(carry, xs):
        next_value, next_advantage, has_next = carry
        r, v, m = xs
        bootstrap = terminal_value * v
        value_after = jnp.where(has_next, next_value, bootstrap)
        delta = r + gamma * value_after - v
        advantage = delta + gamma * lam * jnp.where(has_next, next_advantage, 0.0)
        carry = (
            jnp.where(m, v, next_value),
            jnp.where(m, advantage, next_advantage),
            has_next | m,
        )
        return carry, jnp.where(m, advantage, 0.0)

    b = rewards.shape[0]
    init = (jnp.zeros((b,), dtype), jnp.zeros((b,), dtype), jnp.zeros((b,), bool))
    _, advantages = jax.lax.scan(step, init, (rewards.T, values.T, valid.T), reverse=True)
    advantages = advantages.T
    return advantages, (advantages + values) * mask
