"""Random RL train batches in the trainer's shared-prefix layout, for tests and benchmarks of a train step."""

from __future__ import annotations

import numpy as np

from feynrl_jax.losses import TrainBatch
from feynrl_jax.rollout.types import Rollouts
from feynrl_jax.train.shared_prefix import shared_prefix_rows


def shared_prefix_batch(
    vocab_size: int, groups: int, *, prompt: int, group: int, width: int, seed: int = 0, min_length: int | None = None
) -> TrainBatch:
    """`groups` groups of a `prompt`-token prompt and `group` completions, one row per group
    (`train.shared_prefix.shared_prefix_rows`), completion tokens scored with random advantages.

    Args:
        vocab_size: token ids are drawn from `[1, vocab_size)`.
        groups: rows of the batch.
        prompt: the prompt's tokens.
        group: completions per prompt.
        width: the most tokens of a completion.
        seed: the random draws' seed.
        min_length: None: every completion has `width` tokens; else each has a random length in
            `[min_length, width]`.

    Returns:
        A `TrainBatch` of `[groups, prompt + group * width]` arrays, old log-probabilities -4 on scored tokens.
    """
    rng = np.random.default_rng(seed)
    n = groups * group
    prompts = rng.integers(1, vocab_size, (groups, prompt))
    completions = rng.integers(1, vocab_size, (n, width))
    lengths = np.full(n, width) if min_length is None else rng.integers(min_length, width + 1, n)
    rollouts = Rollouts(
        prompt_ids=np.repeat(prompts, group, axis=0).astype(np.int32),
        prompt_lengths=np.full(n, prompt, np.int32),
        completion_ids=completions.astype(np.int32),
        completion_mask=(np.arange(width)[None] < lengths[:, None]).astype(np.float32),
        behavior_logprobs=np.full((n, width), -4.0, np.float32),
        finish_reason=np.zeros(n, np.int32),
        group_id=np.arange(n, dtype=np.int32) // group,
        policy_version=np.zeros(n, np.int32),
    )
    rows = shared_prefix_rows(rollouts, prompt_width=prompt, completion_width=group * width, pad_id=0)
    loss_mask = (rows.sample_row >= 0).astype(np.float32)
    advantages = rng.standard_normal(loss_mask.shape).astype(np.float32) * loss_mask
    return TrainBatch(rows.tokens, rows.positions, rows.segment_ids, loss_mask, advantages, -4.0 * loss_mask)
