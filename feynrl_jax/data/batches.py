"""Batch builders for the SFT, DPO and RL loops.

Each builder draws examples from an :class:`~feynrl_jax.data.mixture.ExampleStream`, tokenises them, drops
(and counts) those over the length budget, and assembles fixed-shape host batches:

- :class:`SFTBatches` -> :class:`~feynrl_jax.data.packing.TokenBatch` ``[B, T]``, optionally packed.
- :class:`DPOBatches` -> :class:`~feynrl_jax.data.packing.TokenBatch` ``[2P, T]``: row ``2i`` is prompt + chosen,
  row ``2i+1`` prompt + rejected, the mask on the response (Rafailov et al., 2023, "Direct Preference
  Optimization").
- :class:`PromptBatches` -> :class:`PromptBatch` (prompt token ids and the example dicts, for rollouts).

A builder's state is its stream's state (:meth:`get_state` / :meth:`set_state`, a JSON-serialisable dict):
a batch never holds an example back, so restoring the state continues with exactly the next batch.

Every row a builder does not train on is counted by source and reason (bad rows dropped when a file was read
under ``data.on_bad_row="skip"``, examples over the length budget) and logged by the stream;
:meth:`~_Batches.skipped` gives the counters as metrics, :meth:`~_Batches.metrics` adds the examples taken.
A source that yields nothing usable fails with a ``DataError`` naming it (see :mod:`feynrl_jax.data.mixture`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from feynrl_jax.data.examples import DataError
from feynrl_jax.data.mixture import ExampleStream, MixtureSource, Skip
from feynrl_jax.data.packing import RowPacker, TokenBatch
from feynrl_jax.data.tokenization import (
    TokenizedSequence,
    render_prompt,
    tokenize_prompt,
    tokenize_prompt_response,
    tokenize_sft_example,
)


def _where(example: Mapping[str, Any]) -> str:
    return f"data source {example.get('source')!r}, row {example.get('row')}"


def _pad_id(tokenizer: Any) -> int:
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    if pad is None:
        raise DataError("the tokenizer has neither a pad nor an EOS token to pad batches with")
    return int(pad)


class _Batches:
    """Shared plumbing: the stream, its state and the skip metrics."""

    stream: ExampleStream

    def __iter__(self):
        return self

    def get_state(self) -> dict[str, Any]:
        """The iterator state (JSON-serialisable) for a checkpoint."""
        return self.stream.get_state()

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Restores a state from :meth:`get_state`."""
        self.stream.set_state(state)

    def skip_counts(self) -> dict[str, int]:
        """Rows skipped so far by reason, all sources together (bad rows and length-budget skips)."""
        totals: dict[str, int] = {}
        for counts in self.stream.skip_counts().values():
            for reason, n in counts.items():
                totals[reason] = totals.get(reason, 0) + n
        return totals

    def skipped(self) -> dict[str, float]:
        """Skip counters since the run started (cumulative), as metrics under ``train/data/``.

        Returns:
            ``{"train/data/skipped_rows": total, "train/data/skipped_rows/<reason>": n,
            "train/data/skipped_rows/<source>/<reason>": n}``; the total is always there (0 when nothing was
            skipped), the others only for reasons that occurred.
        """
        by_source = self.stream.skip_counts()
        out = {"train/data/skipped_rows": float(sum(sum(c.values()) for c in by_source.values()))}
        out.update({f"train/data/skipped_rows/{reason}": float(n) for reason, n in self.skip_counts().items()})
        for source, counts in by_source.items():
            out.update({f"train/data/skipped_rows/{source}/{reason}": float(n) for reason, n in counts.items()})
        return out

    def metrics(self) -> dict[str, float]:
        """Counters under ``train/data/``: :meth:`skipped` plus the examples taken per source
        (``train/data/taken_<source>``)."""
        out = self.skipped()
        out.update({f"train/data/taken_{source}": float(n) for source, n in self.stream.taken.items()})
        return out


class SFTBatches(_Batches):
    """Supervised fine-tuning batches ``[batch_size, max_seq_len]`` from a mixture.

    Args:
        sources: name -> :class:`MixtureSource` of examples with ``prompt`` + ``response`` or ``messages``.
        tokenizer: a ``transformers`` tokenizer.
        batch_size: B rows per batch.
        max_seq_len: T; a sequence longer than T is skipped and counted as "sequence_too_long" (never
            truncated: a cut response would teach the model never to stop).
        max_prompt_len: a prompt longer than this is skipped and counted as "prompt_too_long".
        packing: pack several sequences per row (``segment_ids`` 1, 2, ...); otherwise one per row.
        seed: the mixture seed.
        use_chat_template: render with the tokenizer's chat template when it has one.
        system_prompt: prepended as a system turn when non-empty.
        shuffle, num_epochs: see :class:`ExampleStream`.
    """

    def __init__(
        self,
        sources: Mapping[str, MixtureSource],
        tokenizer: Any,
        *,
        batch_size: int,
        max_seq_len: int,
        max_prompt_len: int,
        packing: bool,
        seed: int,
        use_chat_template: bool = True,
        system_prompt: str = "",
        shuffle: bool = True,
        num_epochs: int | None = None,
    ):
        self.tokenizer, self.batch_size, self.max_seq_len = tokenizer, batch_size, max_seq_len
        self.max_prompt_len, self.packing, self.use_chat_template = max_prompt_len, packing, use_chat_template
        self.system_prompt = system_prompt
        self.pad_id = _pad_id(tokenizer)
        self.stream = ExampleStream(
            sources, seed=seed, shuffle=shuffle, num_epochs=num_epochs, transform=self._tokenize
        )

    def _tokenize(self, example: dict[str, Any]) -> TokenizedSequence | Skip:
        try:
            sequence = tokenize_sft_example(
                self.tokenizer, example, use_chat_template=self.use_chat_template, system_prompt=self.system_prompt
            )
        except DataError as error:
            raise DataError(f"{_where(example)}: {error}") from error
        if sequence.prompt_length > self.max_prompt_len:
            return Skip("prompt_too_long", sequence.prompt_length, f"data.max_prompt_len={self.max_prompt_len}")
        if len(sequence) > self.max_seq_len:
            return Skip("sequence_too_long", len(sequence), f"data.max_seq_len={self.max_seq_len}")
        return sequence

    def __next__(self) -> TokenBatch:
        packer = RowPacker(self.batch_size, self.max_seq_len, self.pad_id, packing=self.packing)
        while True:
            try:
                sequence = self.stream.peek()
            except StopIteration:
                if packer.empty:
                    raise
                break
            if not packer.try_add(sequence):
                break
            next(self.stream)
        return packer.batch()


class DPOBatches(_Batches):
    """Preference-pair batches ``[2 * pairs_per_batch, max_seq_len]``, chosen rows even, rejected rows odd.

    Args:
        sources: name -> :class:`MixtureSource` of examples with ``prompt``, ``chosen`` and ``rejected``.
        tokenizer: a ``transformers`` tokenizer.
        pairs_per_batch: P pairs, i.e. 2P rows.
        max_seq_len: T; a pair with either side longer is skipped ("sequence_too_long").
        max_prompt_len: a longer prompt is skipped ("prompt_too_long").
        seed, use_chat_template, system_prompt, shuffle, num_epochs: as in :class:`SFTBatches`.
    """

    def __init__(
        self,
        sources: Mapping[str, MixtureSource],
        tokenizer: Any,
        *,
        pairs_per_batch: int,
        max_seq_len: int,
        max_prompt_len: int,
        seed: int,
        use_chat_template: bool = True,
        system_prompt: str = "",
        shuffle: bool = True,
        num_epochs: int | None = None,
    ):
        self.tokenizer, self.pairs_per_batch, self.max_seq_len = tokenizer, pairs_per_batch, max_seq_len
        self.max_prompt_len, self.use_chat_template = max_prompt_len, use_chat_template
        self.system_prompt = system_prompt
        self.pad_id = _pad_id(tokenizer)
        self.stream = ExampleStream(
            sources, seed=seed, shuffle=shuffle, num_epochs=num_epochs, transform=self._tokenize
        )

    def _tokenize(self, example: dict[str, Any]) -> tuple[TokenizedSequence, TokenizedSequence] | Skip:
        for field in ("chosen", "rejected"):
            if field not in example:
                raise DataError(f"{_where(example)}: a DPO example needs {field!r}")
        try:
            chosen, rejected = (
                tokenize_prompt_response(
                    self.tokenizer,
                    example["prompt"],
                    example[f],
                    use_chat_template=self.use_chat_template,
                    system_prompt=self.system_prompt,
                )
                for f in ("chosen", "rejected")
            )
        except DataError as error:
            raise DataError(f"{_where(example)}: {error}") from error
        if chosen.prompt_length > self.max_prompt_len:
            return Skip("prompt_too_long", chosen.prompt_length, f"data.max_prompt_len={self.max_prompt_len}")
        longest = max(len(chosen), len(rejected))
        if longest > self.max_seq_len:
            return Skip("sequence_too_long", longest, f"data.max_seq_len={self.max_seq_len}")
        return chosen, rejected

    def __next__(self) -> TokenBatch:
        packer = RowPacker(2 * self.pairs_per_batch, self.max_seq_len, self.pad_id, packing=False)
        for pair in range(self.pairs_per_batch):
            try:
                chosen, rejected = next(self.stream)
            except StopIteration:
                if pair == 0:
                    raise
                break
            packer.try_add(chosen)
            packer.try_add(rejected)
        return packer.batch()


@dataclass(frozen=True)
class PromptBatch:
    """Prompts for a rollout engine.

    Attributes:
        prompt_ids: one list of token ids per prompt (unpadded; the engine pads).
        prompt_texts: the rendered prompt strings (what rewards receive as ``prompt``).
        examples: the example dicts (with ``answer`` and ``metadata`` for rewards).
    """

    prompt_ids: list[list[int]]
    prompt_texts: list[str]
    examples: list[dict[str, Any]]

    def __len__(self) -> int:
        return len(self.prompt_ids)


class PromptBatches(_Batches):
    """Batches of ``batch_size`` prompts for RL or evaluation; prompts over ``max_prompt_len`` are skipped.

    Args:
        sources: name -> :class:`MixtureSource` of examples with ``prompt``.
        tokenizer: a ``transformers`` tokenizer.
        batch_size: prompts per batch (the last batch of a finite stream may be smaller).
        max_prompt_len: a longer prompt is skipped and counted ("prompt_too_long").
        seed, use_chat_template, system_prompt, shuffle, num_epochs: as in :class:`SFTBatches`; for one exact
            evaluation pass use one source with ``shuffle=False, num_epochs=1``.
    """

    def __init__(
        self,
        sources: Mapping[str, MixtureSource],
        tokenizer: Any,
        *,
        batch_size: int,
        max_prompt_len: int,
        seed: int,
        use_chat_template: bool = True,
        system_prompt: str = "",
        shuffle: bool = True,
        num_epochs: int | None = None,
    ):
        self.tokenizer, self.batch_size, self.max_prompt_len = tokenizer, batch_size, max_prompt_len
        self.use_chat_template, self.system_prompt = use_chat_template, system_prompt
        self.stream = ExampleStream(
            sources, seed=seed, shuffle=shuffle, num_epochs=num_epochs, transform=self._tokenize
        )

    def _tokenize(self, example: dict[str, Any]) -> tuple[list[int], str, dict[str, Any]] | Skip:
        try:
            text = render_prompt(
                self.tokenizer,
                example["prompt"],
                use_chat_template=self.use_chat_template,
                system_prompt=self.system_prompt,
            )
            ids = tokenize_prompt(
                self.tokenizer,
                example["prompt"],
                use_chat_template=self.use_chat_template,
                system_prompt=self.system_prompt,
            )
        except DataError as error:
            raise DataError(f"{_where(example)}: {error}") from error
        if len(ids) > self.max_prompt_len:
            return Skip("prompt_too_long", len(ids), f"data.max_prompt_len={self.max_prompt_len}")
        return ids, text, example

    def __next__(self) -> PromptBatch:
        ids, texts, examples = [], [], []
        for _ in range(self.batch_size):
            try:
                prompt_ids, text, example = next(self.stream)
            except StopIteration:
                if not ids:
                    raise
                break
            ids.append(prompt_ids)
            texts.append(text)
            examples.append(example)
        return PromptBatch(ids, texts, examples)
