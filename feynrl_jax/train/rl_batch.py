"""From rollouts to a token-aligned `TrainBatch`.

An engine returns prompts and completions side by side (`Rollouts`: `prompt_ids [N, P]`, `completion_ids
[N, C]`, per-completion-token arrays `[N, C]`). The train step reads one row per sample, prompt and completion
concatenated, every per-token array aligned with `tokens` (docs/CONTRACTS.md): the completion token `j` of row
`i` sits at column `prompt_lengths[i] + j`, and that is where its mask, advantage and log-probabilities go.

Rows are padded to a fixed `seq_len` so that every RL step has the same shapes and the step compiles once.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from feynrl_jax.losses import TrainBatch
from feynrl_jax.rollout.types import Rollouts


def completion_columns(rollouts: Rollouts, seq_len: int) -> np.ndarray:
    """`[N, C]` int: the column of each completion token in the concatenated row.

    Raises:
      ValueError: when a prompt plus its completion does not fit in `seq_len`.
    """
    lengths = rollouts.prompt_lengths.astype(np.int64) + rollouts.completion_lengths
    if lengths.max(initial=0) > seq_len:
        row = int(np.argmax(lengths))
        raise ValueError(
            f"rollout row {row} has {int(lengths[row])} tokens (prompt + completion), more than seq_len={seq_len}; "
            "raise data.max_seq_len or lower rollout.max_new_tokens / data.max_prompt_len"
        )
    c = rollouts.completion_ids.shape[1]
    return rollouts.prompt_lengths.astype(np.int64)[:, None] + np.arange(c)[None, :]


def scatter_completion(values: np.ndarray, rollouts: Rollouts, seq_len: int) -> np.ndarray:
    """Places a completion-aligned `[N, C]` array at its token columns of an `[N, seq_len]` float32 array.

    Padding completion positions (mask 0) are dropped, so the result is 0 outside the completion.
    """
    columns = completion_columns(rollouts, seq_len)
    out = np.zeros((values.shape[0], seq_len), np.float32)
    valid = rollouts.completion_mask > 0
    rows = np.broadcast_to(np.arange(values.shape[0])[:, None], columns.shape)
    out[rows[valid], columns[valid]] = values[valid]
    return out


def rollout_tokens(rollouts: Rollouts, seq_len: int, pad_id: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`(tokens, positions, segment_ids)`, each `[N, seq_len]` int32, prompt and completion concatenated."""
    n = rollouts.prompt_ids.shape[0]
    tokens = np.full((n, seq_len), pad_id, np.int32)
    for i in range(n):
        p = int(rollouts.prompt_lengths[i])
        tokens[i, :p] = rollouts.prompt_ids[i, :p]
    columns = completion_columns(rollouts, seq_len)
    valid = rollouts.completion_mask > 0
    rows = np.broadcast_to(np.arange(n)[:, None], columns.shape)
    tokens[rows[valid], columns[valid]] = rollouts.completion_ids[valid]
    lengths = rollouts.prompt_lengths + rollouts.completion_lengths
    segment_ids = (np.arange(seq_len)[None, :] < lengths[:, None]).astype(np.int32)
    positions = np.broadcast_to(np.arange(seq_len, dtype=np.int32), (n, seq_len)).copy()
    return tokens, positions, segment_ids


def rollouts_to_batch(
    rollouts: Rollouts,
    advantages: np.ndarray,
    *,
    seq_len: int,
    pad_id: int,
    old_logprobs: np.ndarray | None = None,
    ref_logprobs: np.ndarray | None = None,
    values: np.ndarray | None = None,
    returns: np.ndarray | None = None,
) -> TrainBatch:
    """Builds the train batch of an RL step (host numpy arrays).

    Args:
      rollouts: the sampled completions.
      advantages: `[N, C]` completion-aligned advantages (an estimator of `feynrl_jax.losses.advantages`).
      seq_len: row length T of the batch; prompt + completion must fit.
      pad_id: the token id written on padding.
      old_logprobs: `[N, T]` token-aligned log-probabilities under the policy the ratio is taken against
        (recomputed by the trainer), or None to use the engine's behaviour log-probabilities.
      ref_logprobs, values, returns: optional `[N, T]` token-aligned arrays (reference model, critic).

    Returns:
      A `TrainBatch` of `[N, T]` arrays; `loss_mask` is the completion mask at the completion's columns and
      `behavior_logprobs` always holds the engine's log-probabilities (for off-policy corrections).
    """
    tokens, positions, segment_ids = rollout_tokens(rollouts, seq_len, pad_id)
    behavior = scatter_completion(rollouts.behavior_logprobs, rollouts, seq_len)
    return TrainBatch(
        tokens=tokens,
        positions=positions,
        segment_ids=segment_ids,
        loss_mask=scatter_completion(rollouts.completion_mask, rollouts, seq_len),
        advantages=scatter_completion(np.asarray(advantages, np.float32), rollouts, seq_len),
        old_logprobs=behavior if old_logprobs is None else np.asarray(old_logprobs, np.float32),
        ref_logprobs=ref_logprobs,
        behavior_logprobs=behavior,
        values=values,
        returns=returns,
    )


def last_token_columns(rollouts: Rollouts) -> np.ndarray:
    """`[N]` int: the column of each row's last completion token in the concatenated row (-1 when empty)."""
    return rollouts.prompt_lengths.astype(np.int64) + rollouts.completion_lengths - 1


def sequence_reward_at_last_token(rewards: np.ndarray, rollouts: Rollouts, seq_len: int) -> np.ndarray:
    """`[N, seq_len]` float32 per-token rewards: each row's sequence reward on its last completion token.

    This is the per-token reward GAE consumes (`feynrl_jax.losses.advantages.gae`); a row without completion
    tokens gets none.
    """
    n = rollouts.prompt_ids.shape[0]
    out = np.zeros((n, seq_len), np.float32)
    columns = last_token_columns(rollouts)
    valid = rollouts.completion_lengths > 0
    out[np.arange(n)[valid], columns[valid]] = np.asarray(rewards, np.float32)[valid]
    return out


def concat_rollouts(parts: list[Rollouts]) -> Rollouts:
    """Stacks rollouts of several `generate` calls (workers, refill draws) into one record.

    Prompts are re-padded to the widest part; group ids are renumbered so that groups stay distinct and
    consecutive in order. Every part must have the same completion width C.

    Raises:
        ValueError: on an empty list or parts with different completion widths.
    """
    if not parts:
        raise ValueError("concat_rollouts needs at least one Rollouts")
    widths = {p.completion_ids.shape[1] for p in parts}
    if len(widths) != 1:
        raise ValueError(f"concat_rollouts: parts have different completion widths {sorted(widths)}")
    prompt_width = max(p.prompt_ids.shape[1] for p in parts)
    prompt_ids, group_ids, offset = [], [], 0
    for part in parts:
        padded = np.zeros((part.prompt_ids.shape[0], prompt_width), np.int32)
        padded[:, : part.prompt_ids.shape[1]] = part.prompt_ids
        prompt_ids.append(padded)
        _, dense = np.unique(part.group_id, return_inverse=True)
        group_ids.append(dense.astype(np.int32) + offset)
        offset += int(dense.max(initial=-1)) + 1
    stack = lambda name: np.concatenate([getattr(p, name) for p in parts])  # noqa: E731
    return Rollouts(
        prompt_ids=np.concatenate(prompt_ids),
        prompt_lengths=stack("prompt_lengths"),
        completion_ids=stack("completion_ids"),
        completion_mask=stack("completion_mask"),
        behavior_logprobs=stack("behavior_logprobs"),
        finish_reason=stack("finish_reason"),
        group_id=np.concatenate(group_ids),
        policy_version=stack("policy_version"),
    )


def select_rows(rollouts: Rollouts, rows: np.ndarray) -> Rollouts:
    """The rollouts of `rows` (`[M]` int indices, or an `[N]` bool mask), in that order."""
    return Rollouts(**{f.name: getattr(rollouts, f.name)[rows] for f in dataclasses.fields(Rollouts)})


def constant_reward_groups(rewards: np.ndarray, group_id: np.ndarray) -> np.ndarray:
    """`[N]` bool: rows whose group's rewards are all equal (no learning signal for group baselines).

    DAPO's dynamic sampling (Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale",
    arXiv:2503.14476) drops these groups and samples more prompts.
    """
    rewards = np.asarray(rewards, np.float64)
    out = np.zeros(rewards.shape[0], bool)
    for gid in np.unique(group_id):
        rows = group_id == gid
        out[rows] = np.ptp(rewards[rows]) == 0.0
    return out
