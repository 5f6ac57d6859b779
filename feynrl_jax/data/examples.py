"""The common example format, and its validation.

Every source (JSONL, Parquet, tensorflow-datasets, reasoning-gym, CHAMP) yields plain dicts of one shape:

- ``prompt``: a string, or a list of chat messages ``{"role": ..., "content": str}``. Required unless the
  example holds a whole conversation in ``messages``.
- ``response`` (SFT): the target completion, a non-empty string.
- ``messages`` (multi-turn SFT): a full conversation; the loss falls on its assistant turns only.
- ``chosen`` / ``rejected`` (DPO): the preferred and the dispreferred completion, non-empty strings.
- ``answer``: the reference answer that rewards and evaluation compare against (a string).
- ``metadata``: a dict of anything else (source, task, seed...).

Examples handed out by a mixture (:mod:`feynrl_jax.data.mixture`) also carry ``source`` (the mixture's name for
their source) and ``row`` (their 1-based row in it), so any later error can name both.

A row that breaks these rules raises :class:`BadRowError`, which names the file and the 1-based row, or is
skipped and counted when the caller asked for ``on_bad_row="skip"``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from feynrl_jax.errors import InputError

CHAT_ROLES = ("system", "user", "assistant", "tool")
ON_BAD_ROW = ("error", "skip")
_TEXT_FIELDS = ("response", "chosen", "rejected")


class DataError(InputError, ValueError):
    """A data set, a source or a configuration of them cannot be used."""


class BadRowError(DataError):
    """One row of a data file is malformed.

    Attributes:
        path: the file (or data set name) the row came from.
        row: the 1-based row number (the line number in a JSONL file).
        reason: what is wrong with the row; also its skip-counter key (see :attr:`kind`).
        kind: a short machine-readable category ("malformed_json", "missing_field", "wrong_type",
            "empty_text", "unknown_role", "not_utf8"), used to count skipped rows.
    """

    def __init__(self, path: str, row: int, kind: str, reason: str):
        self.path = str(path)
        self.row = row
        self.kind = kind
        self.reason = reason
        super().__init__(f"{self.path}, row {row}: {reason}")


class RowProblem(Exception):
    """A row-level problem found by :func:`validate_example`; the caller adds the file and row."""

    def __init__(self, kind: str, reason: str):
        self.kind = kind
        self.reason = reason
        super().__init__(reason)


def check_on_bad_row(on_bad_row: str) -> str:
    """Returns ``on_bad_row`` after checking that it is "error" or "skip"."""
    if on_bad_row not in ON_BAD_ROW:
        raise DataError(f"on_bad_row must be one of {ON_BAD_ROW}, got {on_bad_row!r}")
    return on_bad_row


def _check_messages(messages: Any, field: str) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise RowProblem("wrong_type", f"field {field!r} must be a non-empty list of chat messages")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise RowProblem("wrong_type", f"{field}[{i}] must be a dict with 'role' and 'content'")
        for key in ("role", "content"):
            if key not in message:
                raise RowProblem("missing_field", f"{field}[{i}] has no {key!r}")
        role, content = message["role"], message["content"]
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise RowProblem(
                "unknown_role", f"{field}[{i}] has unknown chat role {role!r}; expected one of {CHAT_ROLES}"
            )
        if not isinstance(content, str):
            raise RowProblem("wrong_type", f"{field}[{i}].content must be a string, got {type(content).__name__}")
        out.append({"role": role, "content": content})
    return out


def validate_example(raw: Any, *, required: tuple[str, ...] = ()) -> dict[str, Any]:
    """Checks one raw row against the common format and returns a clean copy.

    Args:
        raw: the decoded row (a dict).
        required: fields that this use needs beyond the format itself, e.g. ``("response",)`` for SFT or
            ``("chosen", "rejected")`` for DPO. ``"prompt"`` and ``"response"`` are satisfied by ``"messages"``.

    Returns:
        A new dict with ``prompt`` (str or list of messages), the optional fields that were present, and
        ``metadata`` (a dict, empty when absent). Unknown top-level keys are moved into ``metadata``.

    Raises:
        RowProblem: the row is malformed (its ``kind`` says how).
    """
    if not isinstance(raw, Mapping):
        raise RowProblem("wrong_type", f"a row must be a JSON object, got {type(raw).__name__}")
    for field in required:
        if field in ("prompt", "response") and raw.get("messages") is not None:
            continue
        if field not in raw or raw[field] is None:
            raise RowProblem("missing_field", f"missing required field {field!r}")
    if "prompt" not in raw and "messages" not in raw:
        raise RowProblem("missing_field", "missing required field 'prompt' (or 'messages')")
    out: dict[str, Any] = {}
    if "prompt" in raw and raw["prompt"] is not None:
        prompt = raw["prompt"]
        if isinstance(prompt, str):
            if not prompt.strip():
                raise RowProblem("empty_text", "field 'prompt' is empty")
            out["prompt"] = prompt
        elif isinstance(prompt, list):
            out["prompt"] = _check_messages(prompt, "prompt")
        else:
            raise RowProblem(
                "wrong_type", f"field 'prompt' must be a string or a list of messages, got {type(prompt).__name__}"
            )
    if "messages" in raw and raw["messages"] is not None:
        messages = _check_messages(raw["messages"], "messages")
        if not any(m["role"] == "assistant" for m in messages):
            raise RowProblem("missing_field", "field 'messages' has no assistant turn to train on")
        out["messages"] = messages
        if "prompt" not in out:
            first_assistant = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
            out["prompt"] = messages[:first_assistant]
    for field in _TEXT_FIELDS:
        if field in raw and raw[field] is not None:
            value = raw[field]
            if not isinstance(value, str):
                raise RowProblem("wrong_type", f"field {field!r} must be a string, got {type(value).__name__}")
            if not value.strip():
                raise RowProblem("empty_text", f"field {field!r} is empty")
            out[field] = value
    if "answer" in raw and raw["answer"] is not None:
        answer = raw["answer"]
        if isinstance(answer, bool) or not isinstance(answer, str | int | float):
            raise RowProblem("wrong_type", f"field 'answer' must be a string or a number, got {type(answer).__name__}")
        out["answer"] = str(answer)
    metadata = raw.get("metadata") or {}
    if not isinstance(metadata, Mapping):
        raise RowProblem("wrong_type", f"field 'metadata' must be a dict, got {type(metadata).__name__}")
    metadata = dict(metadata)
    known = {"prompt", "messages", "answer", "metadata", *_TEXT_FIELDS}
    for key, value in raw.items():
        if key not in known:
            metadata.setdefault(key, value)
    out["metadata"] = metadata
    return out


def prompt_messages(prompt: str | list[dict[str, str]], system_prompt: str = "") -> list[dict[str, str]]:
    """Returns the prompt as chat messages: a string becomes one user turn.

    Args:
        prompt: a string or a list of chat messages.
        system_prompt: when non-empty and the messages do not start with a system turn, prepended as one.
    """
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    if system_prompt and not (messages and messages[0]["role"] == "system"):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def rename_columns(raw: Any, columns: Mapping[str, str] | None) -> Any:
    """Renames file columns to example fields: ``columns`` maps a field ("prompt") to its column ("question").

    Returns ``raw`` unchanged when it is not a dict or when every column already has its field's name.
    """
    if not columns or not isinstance(raw, Mapping):
        return raw
    out = dict(raw)
    for field, column in columns.items():
        if column != field and column in out:
            out[field] = out.pop(column)
    return out
