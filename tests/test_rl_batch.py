"""Rollouts become token-aligned train batches: every completion value lands on its own token's column."""

import numpy as np
import pytest

from feynrl_jax.rollout.types import Rollouts
from feynrl_jax.train.rl_batch import rollouts_to_batch

PAD = 0


def make_rollouts() -> Rollouts:
    # Two prompts of lengths 3 and 1; completions of lengths 2 and 3 (C = 3).
    return Rollouts(
        prompt_ids=np.array([[11, 12, 13], [21, 0, 0]], np.int32),
        prompt_lengths=np.array([3, 1], np.int32),
        completion_ids=np.array([[31, 32, 0], [41, 42, 43]], np.int32),
        completion_mask=np.array([[1, 1, 0], [1, 1, 1]], np.float32),
        behavior_logprobs=np.array([[-0.1, -0.2, 0.0], [-0.3, -0.4, -0.5]], np.float32),
        finish_reason=np.array([0, 1], np.int32),
        group_id=np.array([0, 1], np.int32),
        policy_version=np.array([3, 3], np.int32),
    )


def test_values_land_on_their_token_columns():
    rollouts = make_rollouts()
    advantages = np.array([[1.0, 1.0, 9.0], [-2.0, -2.0, -2.0]], np.float32)
    batch = rollouts_to_batch(rollouts, advantages, seq_len=6, pad_id=PAD)
    np.testing.assert_array_equal(batch.tokens, [[11, 12, 13, 31, 32, 0], [21, 41, 42, 43, 0, 0]])
    np.testing.assert_array_equal(batch.segment_ids, [[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(batch.positions[0], np.arange(6))
    np.testing.assert_array_equal(batch.loss_mask, [[0, 0, 0, 1, 1, 0], [0, 1, 1, 1, 0, 0]])
    # The masked completion slot (advantage 9) is dropped, not written on padding.
    np.testing.assert_array_equal(batch.advantages, [[0, 0, 0, 1, 1, 0], [0, -2, -2, -2, 0, 0]])
    np.testing.assert_allclose(batch.old_logprobs, [[0, 0, 0, -0.1, -0.2, 0], [0, -0.3, -0.4, -0.5, 0, 0]])
    np.testing.assert_array_equal(batch.behavior_logprobs, batch.old_logprobs)
    assert batch.ref_logprobs is None


def test_recomputed_old_logprobs_are_kept_apart_from_behaviour():
    rollouts = make_rollouts()
    old = np.full((2, 6), -7.0, np.float32)
    batch = rollouts_to_batch(rollouts, np.zeros((2, 3)), seq_len=6, pad_id=PAD, old_logprobs=old)
    np.testing.assert_array_equal(batch.old_logprobs, old)
    assert batch.behavior_logprobs[0, 3] == pytest.approx(-0.1)


def test_too_long_row_is_named():
    with pytest.raises(ValueError, match="rollout row 0 has 5 tokens.*seq_len=4"):
        rollouts_to_batch(make_rollouts(), np.zeros((2, 3)), seq_len=4, pad_id=PAD)


def test_concat_renumbers_groups_and_repads_prompts():
    from feynrl_jax.train.rl_batch import concat_rollouts

    a = make_rollouts()
    b = Rollouts(
        prompt_ids=np.array([[5, 6, 7, 8]], np.int32),
        prompt_lengths=np.array([4], np.int32),
        completion_ids=np.array([[9, 0, 0]], np.int32),
        completion_mask=np.array([[1, 0, 0]], np.float32),
        behavior_logprobs=np.array([[-1.0, 0, 0]], np.float32),
        finish_reason=np.array([0], np.int32),
        group_id=np.array([0], np.int32),
        policy_version=np.array([4], np.int32),
    )
    both = concat_rollouts([a, b])
    assert both.prompt_ids.shape == (3, 4)
    np.testing.assert_array_equal(both.prompt_ids[0], [11, 12, 13, 0])
    np.testing.assert_array_equal(both.group_id, [0, 1, 2])
    np.testing.assert_array_equal(both.policy_version, [3, 3, 4])
    with pytest.raises(ValueError, match="completion widths"):
        concat_rollouts(
            [
                a,
                Rollouts(
                    **{
                        **b.__dict__,
                        "completion_ids": np.zeros((1, 2), np.int32),
                        "completion_mask": np.zeros((1, 2), np.float32),
                        "behavior_logprobs": np.zeros((1, 2), np.float32),
                    }
                ),
            ]
        )


def test_constant_reward_groups_and_row_selection():
    from feynrl_jax.train.rl_batch import constant_reward_groups, select_rows

    rewards = np.array([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    groups = np.array([0, 0, 1, 1, 2, 2])
    flat = constant_reward_groups(rewards, groups)
    np.testing.assert_array_equal(flat, [True, True, False, False, True, True])
    picked = select_rows(make_rollouts(), np.array([1]))
    np.testing.assert_array_equal(picked.prompt_ids, [[21, 0, 0]])
    assert picked.completion_lengths.tolist() == [3]


def test_sequence_reward_sits_on_the_last_completion_token():
    from feynrl_jax.train.rl_batch import sequence_reward_at_last_token

    token_rewards = sequence_reward_at_last_token(np.array([0.5, 2.0]), make_rollouts(), seq_len=6)
    np.testing.assert_array_equal(token_rewards, [[0, 0, 0, 0, 0.5, 0], [0, 0, 0, 2.0, 0, 0]])
