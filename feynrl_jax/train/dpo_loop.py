"""Direct preference optimisation: `feynrl-jax train --config=configs/dpo_<...>.py`.

Batches interleave pairs (row `2i` prompt + chosen, row `2i + 1` prompt + rejected, loss mask on the response);
the loss is the registry's `dpo` (Rafailov et al., 2023, "Direct Preference Optimization: Your Language Model is
Secretly a Reward Model"). The reference model is `algo.reference`: "initial" (the starting weights, frozen) or
a Hugging Face folder. Its log-probabilities come from the no-grad forward on the training mesh
(`feynrl_jax.train.frozen_logprobs`), either

- `algo.reference_mode = "per_batch"`: for every batch, just before the step (the reference stays in memory);
- `algo.reference_mode = "precompute"`: once for every pair of the training set before the first step, kept
  on the host keyed by the row's tokens; the reference weights are then freed.

Evaluation on held-out pairs (the `eval.split` sources) reports `eval/pref_accuracy` (the policy gives the
chosen response a higher log-likelihood than the rejected one), `eval/reward_accuracy` (the DPO implicit
reward `beta * (log pi - log pi_ref)` ranks them correctly; 0 before training, where every margin is 0),
`eval/reward_margin`, and generation accuracy on the held-out prompts (`eval/pass@k`, `eval/accuracy`).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any

import numpy as np
from ml_collections import ConfigDict

from feynrl_jax.checkpoints import load_hf
from feynrl_jax.data.from_config import build_mixture_from_config
from feynrl_jax.data.packing import TokenBatch
from feynrl_jax.losses import TrainBatch
from feynrl_jax.models import lora
from feynrl_jax.sharding import host_tree, place_tree
from feynrl_jax.train.frozen_logprobs import make_logprob_fn
from feynrl_jax.train.run_lock import RunLock
from feynrl_jax.train.sft_loop import generation_evaluation
from feynrl_jax.train.supervised_loop import RunContext, SupervisedTask, place, run_supervised, sft_train_batch

REFERENCE_MODES = ("per_batch", "precompute")


def _row_key(tokens: np.ndarray, loss_mask: np.ndarray) -> bytes:
    return hashlib.blake2b(tokens.tobytes() + loss_mask.tobytes(), digest_size=16).digest()


class ReferenceTable:
    """Reference log-probabilities of every training row, computed once (`algo.reference_mode="precompute"`).

    Rows are keyed by a hash of their tokens and loss mask, so a row finds its values whatever batch or epoch it
    comes back in.
    """

    def __init__(self):
        self._rows: dict[bytes, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def add(self, batch: TokenBatch, ref_logprobs: np.ndarray) -> None:
        """Stores `ref_logprobs [B, T]` for each row of `batch`."""
        for row in range(batch.tokens.shape[0]):
            self._rows[_row_key(batch.tokens[row], batch.loss_mask[row])] = ref_logprobs[row]

    def lookup(self, batch: TokenBatch) -> np.ndarray:
        """`[B, T]` reference log-probabilities of `batch`'s rows.

        Raises:
            KeyError: a row was not in the precomputed pass (names the row).
        """
        out = np.zeros(batch.tokens.shape, np.float32)
        for row in range(batch.tokens.shape[0]):
            key = _row_key(batch.tokens[row], batch.loss_mask[row])
            if key not in self._rows:
                raise KeyError(f"batch row {row} is not in the precomputed reference table ({len(self)} rows)")
            out[row] = self._rows[key]
        return out


def _reference_params(config: ConfigDict, context: RunContext) -> Any:
    reference = config.algo.reference
    if reference == "initial":  # with LoRA: the starting policy over the state's own frozen base arrays
        return context.initial_params() if context.lora_reference is None else context.lora_reference()
    if reference == "none":
        raise ValueError("DPO needs a reference model: set config.algo.reference to 'initial' or a model folder")
    shardings = context.train_step.state_shardings.params
    if context.lora_reference is not None:
        shardings = lora.base_params(shardings)
    params, _ = load_hf(reference, config=context.model_config.without_lora(), shardings=shardings)
    return params


def _pair_sums(logprobs: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-pair response log-likelihoods `[P]` of chosen and rejected rows, and which pairs are real."""
    sums = (logprobs * mask).sum(axis=1)
    counts = mask.sum(axis=1)
    valid = (counts[0::2] > 0) & (counts[1::2] > 0)
    return sums[0::2], sums[1::2], valid


class PreferenceEvaluator:
    """Preference accuracy of the policy on a fixed set of held-out pairs (and, optionally, generation accuracy).

    Args:
        batches: the held-out pair batches (one pass), each `[2P, T]`.
        logprob_fn: the no-grad `fn(params, tokens, positions, segment_ids) -> (logprobs, None)`.
        reference_params: the reference model's params (its log-probabilities are computed once, here).
        beta: DPO's beta (scales the reported implicit-reward margin).
        place: host `TrainBatch` -> placed `TrainBatch`.
        generation: a `GenerationEvaluator` on the held-out prompts, or None.
        reference_logprob_fn: `logprob_fn` of the reference model's architecture (a LoRA policy's base), or None:
            `logprob_fn`.
    """

    def __init__(
        self, batches, logprob_fn, reference_params, *, beta: float, place, generation=None, reference_logprob_fn=None
    ):
        self.batches = [place(sft_train_batch(b)) for b in batches]
        self.masks = [np.asarray(b.loss_mask) for b in batches]
        self.logprob_fn, self.beta, self.generation = logprob_fn, beta, generation
        reference_fn = reference_logprob_fn or logprob_fn
        self.reference = [self._logprobs(reference_params, b, reference_fn) for b in self.batches]

    def _logprobs(self, params: Any, batch: TrainBatch, fn=None) -> np.ndarray:
        lp, _ = (fn or self.logprob_fn)(params, batch.tokens, batch.positions, batch.segment_ids)
        return host_tree(lp)

    def __call__(self, params: Any, step: int) -> dict[str, float]:
        likelihood_wins, reward_wins, margins = [], [], []
        for batch, mask, ref in zip(self.batches, self.masks, self.reference):
            chosen, rejected, valid = _pair_sums(self._logprobs(params, batch), mask)
            ref_chosen, ref_rejected, _ = _pair_sums(ref, mask)
            margin = self.beta * ((chosen - ref_chosen) - (rejected - ref_rejected))
            likelihood_wins.append((chosen > rejected)[valid])
            reward_wins.append((margin > 0)[valid])
            margins.append(margin[valid])
        metrics = {
            "eval/pref_accuracy": float(np.concatenate(likelihood_wins).mean()),
            "eval/reward_accuracy": float(np.concatenate(reward_wins).mean()),
            "eval/reward_margin": float(np.concatenate(margins).mean()),
            "eval/num_pairs": float(sum(len(w) for w in likelihood_wins)),
        }
        if self.generation is not None:
            metrics.update(self.generation(params, step))
        return metrics

    def close(self) -> None:
        if self.generation is not None:
            self.generation.close()


def _held_out_pairs(config: ConfigDict, tokenizer: Any, pairs_per_batch: int) -> list[TokenBatch]:
    limit = config.eval.num_prompts
    batches = build_mixture_from_config(
        config.data,
        tokenizer,
        paradigm="dpo",
        batch_size=pairs_per_batch,
        split=config.eval.split,
        response_template=config.data.response_template,
        shuffle=False,
        num_epochs=1,
    )
    out, pairs = [], 0
    for batch in batches:
        out.append(batch)
        pairs += int((batch.loss_mask.sum(axis=1) > 0).sum()) // 2
        if limit and pairs >= limit:
            break
    return out


def make_dpo_task(config: ConfigDict, context: RunContext) -> SupervisedTask:
    """The DPO batches (`train.global_batch_size` pairs), reference log-probabilities and evaluation."""
    if config.algo.reference_mode not in REFERENCE_MODES:
        raise ValueError(
            f"config.algo.reference_mode must be one of {REFERENCE_MODES}, got {config.algo.reference_mode!r}"
        )
    step = context.train_step
    pairs = config.train.global_batch_size
    micro_pairs = config.train.micro_batch_size or pairs
    logprob_fn = make_logprob_fn(context.model_config, step.mesh, context.rules, chunk_rows=2 * micro_pairs)
    reference = _reference_params(config, context)
    # A reference without adapters (a LoRA policy's base, another model folder) runs the base model's program.
    reference_fn = logprob_fn
    if context.model_config.lora_rank and not lora.adapters_of(reference):
        reference_fn = make_logprob_fn(
            context.model_config.frozen_base(), step.mesh, context.rules, chunk_rows=2 * micro_pairs
        )
    batches = build_mixture_from_config(
        config.data,
        context.tokenizer,
        paradigm="dpo",
        batch_size=pairs,
        response_template=config.data.response_template,
    )

    def placed(batch: TokenBatch) -> TrainBatch:
        return place(step, sft_train_batch(batch))

    evaluator = None
    if config.eval.during_training:
        generation = None
        if config.eval.reward:
            generation = generation_evaluation(
                config, context.model_config, context.tokenizer, param_shardings=step.state_shardings.params
            )
        evaluator = PreferenceEvaluator(
            _held_out_pairs(config, context.tokenizer, pairs),
            logprob_fn,
            reference,
            beta=_beta(config),
            place=placed,
            generation=generation,
            reference_logprob_fn=reference_fn,
        )

    if config.algo.reference_mode == "per_batch":

        def to_train_batch(batch: TokenBatch) -> TrainBatch:
            train_batch = placed(batch)
            ref, _ = reference_fn(reference, train_batch.tokens, train_batch.positions, train_batch.segment_ids)
            return dataclasses.replace(train_batch, ref_logprobs=ref)

    else:
        table = ReferenceTable()
        one_pass = build_mixture_from_config(
            config.data,
            context.tokenizer,
            paradigm="dpo",
            batch_size=pairs,
            response_template=config.data.response_template,
            shuffle=False,
            num_epochs=1,
        )
        for batch in one_pass:
            train_batch = placed(batch)
            ref, _ = reference_fn(reference, train_batch.tokens, train_batch.positions, train_batch.segment_ids)
            table.add(batch, host_tree(ref))
        del reference  # the table replaces the reference model for training

        def to_train_batch(batch: TokenBatch) -> TrainBatch:
            train_batch = placed(batch)
            ref = place_tree(table.lookup(batch), train_batch.old_logprobs.sharding)
            return dataclasses.replace(train_batch, ref_logprobs=ref)

    return SupervisedTask(
        batches=batches,
        to_train_batch=to_train_batch,
        evaluate=evaluator,
        close=evaluator.close if evaluator is not None else (lambda: None),
    )


def _beta(config: ConfigDict) -> float:
    from feynrl_jax.config.derived import algorithm_hyperparameters
    from feynrl_jax.losses import get_algorithm

    return float(algorithm_hyperparameters(config, get_algorithm(config.algo.name).hyperparameters)["beta"])


def run(config: ConfigDict) -> dict[str, float]:
    """Trains `config` (paradigm "dpo") to `config.train.steps`, resuming from the run folder if it can.

    Returns:
        The last step's metrics, with the final evaluation's.
    """
    if config.paradigm != "dpo":
        raise ValueError(f"dpo_loop.run needs config.paradigm='dpo', got {config.paradigm!r}")
    with RunLock(config.run_dir):  # one run per run folder, for the whole run
        return run_supervised(config, make_dpo_task)
