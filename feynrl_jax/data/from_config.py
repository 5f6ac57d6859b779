"""The edge where the ``data`` section of a config becomes sources and batch builders.

Everything below this module takes plain arguments; only these functions read ``config.data``
(``feynrl_jax/config/base.py`` documents the keys: ``sources.<name>`` with ``kind``, ``path``, ``task``,
``split``, ``weight``, ``size``, ``seed``, ``fields``; ``max_seq_len``, ``max_prompt_len``, ``packing``,
``on_bad_row``, ``shuffle_seed``, ``chat_template``, ``system_prompt``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from feynrl_jax.data.batches import DPOBatches, PromptBatches, SFTBatches
from feynrl_jax.data.examples import DataError
from feynrl_jax.data.file_sources import ExampleSource, read_jsonl, read_parquet
from feynrl_jax.data.mixture import MixtureSource

REQUIRED_FIELDS = {"sft": ("response",), "dpo": ("chosen", "rejected"), "rl": (), "eval": ()}
"""Fields every example must have, per paradigm (SFT examples with ``messages`` satisfy ``response``)."""


def _optional(value: Any) -> Any:
    return None if value in (None, "") else value


def build_source(
    name: str,
    source_cfg: Any,
    *,
    paradigm: str,
    on_bad_row: str,
    response_template: str | None = None,
) -> ExampleSource:
    """Reads one ``data.sources.<name>`` entry into an :class:`ExampleSource`.

    Args:
        name: the source's name (for error messages).
        source_cfg: the source's ConfigDict.
        paradigm: "sft", "dpo", "rl" or "eval"; decides the required fields.
        on_bad_row: "error" or "skip".
        response_template: for reasoning-gym sources in SFT (``response``) and DPO (``chosen``/``rejected``
            pairs, the rejected one stating a wrong answer), e.g. ``"The answer is {answer}."``.
    """
    if paradigm not in REQUIRED_FIELDS:
        raise DataError(f"unknown paradigm {paradigm!r}; expected one of {sorted(REQUIRED_FIELDS)}")
    required = REQUIRED_FIELDS[paradigm]
    kind, path, task = source_cfg.kind, _optional(source_cfg.path), _optional(source_cfg.task)
    columns = dict(source_cfg.fields)
    key = f"data.sources.{name}"

    def need(value: Any, field: str) -> Any:
        if value is None:
            raise DataError(f"{key}.{field} must be set for kind {kind!r}")
        return value

    if kind == "jsonl":
        return read_jsonl(need(path, "path"), required=required, on_bad_row=on_bad_row, columns=columns)
    if kind == "parquet":
        return read_parquet(need(path, "path"), required=required, on_bad_row=on_bad_row, columns=columns)
    if kind == "tfds":
        from feynrl_jax.data.tfds_source import read_tfds

        need(path, "path")
        location = path if task is None else task
        data_dir = None if task is None else path
        if task is None and not os.path.isfile(os.path.join(path, "dataset_info.json")):
            raise DataError(f"{key}.path={path!r} is not a prepared tfds data set folder; set {key}.task to a name")
        return read_tfds(
            location,
            split=source_cfg.split,
            data_dir=data_dir,
            required=required,
            on_bad_row=on_bad_row,
            columns=columns,
        )
    if kind == "reasoning_gym":
        from feynrl_jax.data.reasoning_gym_source import preference_pairs, reasoning_gym_source

        if paradigm in ("sft", "dpo") and response_template is None:
            raise DataError(f"{key}: a reasoning-gym source for {paradigm} needs a response_template")
        source = reasoning_gym_source(
            need(task, "task"),
            size=source_cfg.size,
            seed=source_cfg.seed,
            split=source_cfg.split,
            config=source_cfg.options.to_dict() or None,
            response_template=response_template if paradigm == "sft" else None,
        )
        if paradigm == "dpo":
            source = preference_pairs(source, response_template=response_template, seed=source_cfg.seed)
        return source
    if kind == "champ":
        from feynrl_jax.data.champ_source import champ_source

        if paradigm in ("sft", "dpo"):
            raise DataError(f"{key}: CHAMP problems have no responses; use them for rl or eval")
        categories = None if task is None else tuple(c.strip() for c in task.split(","))
        return champ_source(categories=categories, limit=source_cfg.size)
    raise DataError(f"{key}.kind={kind!r} is unknown; expected jsonl, parquet, tfds, reasoning_gym or champ")


def build_sources_from_config(
    data_cfg: Any, *, paradigm: str, split: str = "train", response_template: str | None = None
) -> dict[str, MixtureSource]:
    """All ``data.sources`` of one split, read and weighted.

    Args:
        data_cfg: the ``config.data`` section.
        paradigm: "sft", "dpo", "rl" or "eval".
        split: only sources whose ``split`` equals this are used ("train" for training, "test" for evaluation).
        response_template: see :func:`build_source`.

    Raises:
        DataError: no source has this split, or one cannot be read.
    """
    chosen: Mapping[str, Any] = {n: s for n, s in data_cfg.sources.items() if s.split == split}
    if not chosen:
        raise DataError(f"config.data.sources has no source with split={split!r} (sources: {sorted(data_cfg.sources)})")
    return {
        name: MixtureSource(
            build_source(
                name, cfg, paradigm=paradigm, on_bad_row=data_cfg.on_bad_row, response_template=response_template
            ),
            float(cfg.weight),
        )
        for name, cfg in chosen.items()
    }


def build_mixture_from_config(
    data_cfg: Any,
    tokenizer: Any,
    *,
    paradigm: str,
    batch_size: int,
    split: str = "train",
    response_template: str | None = None,
    shuffle: bool = True,
    num_epochs: int | None = None,
) -> SFTBatches | DPOBatches | PromptBatches:
    """The batch builder a loop iterates, from ``config.data``.

    Args:
        data_cfg: the ``config.data`` section.
        tokenizer: a ``transformers`` tokenizer.
        paradigm: "sft" -> :class:`SFTBatches`, "dpo" -> :class:`DPOBatches` (``batch_size`` pairs),
            "rl" / "eval" -> :class:`PromptBatches`.
        batch_size: examples (SFT), pairs (DPO) or prompts (RL, eval) per batch.
        split: which sources to use.
        response_template: see :func:`build_source`.
        shuffle, num_epochs: see :class:`~feynrl_jax.data.mixture.ExampleStream`; evaluation passes
            ``shuffle=False, num_epochs=1``.
    """
    sources = build_sources_from_config(data_cfg, paradigm=paradigm, split=split, response_template=response_template)
    common = dict(
        seed=data_cfg.shuffle_seed,
        use_chat_template=data_cfg.chat_template,
        system_prompt=data_cfg.system_prompt,
        shuffle=shuffle,
        num_epochs=num_epochs,
    )
    if paradigm == "sft":
        return SFTBatches(
            sources,
            tokenizer,
            batch_size=batch_size,
            max_seq_len=data_cfg.max_seq_len,
            max_prompt_len=data_cfg.max_prompt_len,
            packing=data_cfg.packing,
            **common,
        )
    if paradigm == "dpo":
        return DPOBatches(
            sources,
            tokenizer,
            pairs_per_batch=batch_size,
            max_seq_len=data_cfg.max_seq_len,
            max_prompt_len=data_cfg.max_prompt_len,
            **common,
        )
    return PromptBatches(sources, tokenizer, batch_size=batch_size, max_prompt_len=data_cfg.max_prompt_len, **common)
