"""tensorflow-datasets over local files: a builder that writes array_record files, and a reader.

TensorFlow itself is not needed: the builder is prepared with ``file_format="array_record"`` and read back with
``tfds.data_source`` (random access through array_record), never with ``as_dataset``.

:class:`JsonlExamples` turns a local JSONL file of examples (the common format of
:mod:`feynrl_jax.data.examples`) into a tfds data set whose records hold the validated example as JSON text and
its 1-based source line; :func:`read_tfds` reads any array_record tfds data set back into an
:class:`~feynrl_jax.data.file_sources.ExampleSource`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import tensorflow_datasets as tfds

from feynrl_jax.data.examples import DataError
from feynrl_jax.data.file_sources import ExampleSource, collect_rows, read_jsonl


class JsonlExamples(tfds.core.GeneratorBasedBuilder):
    """A tfds builder over one local JSONL file of examples (split "train", or the split name given).

    Each record is ``{"example": <validated example as JSON text>, "row": <1-based JSONL line>}``. Bad rows
    follow ``on_bad_row`` exactly as in :func:`~feynrl_jax.data.file_sources.read_jsonl`. ``jsonl_path`` may be
    left out when the builder only reads an already prepared data set (``tfds.data_source`` by name does that).
    """

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Examples in the feynrl-jax common format, one JSON record each."}

    def __init__(self, *, jsonl_path: str | None = None, split: str = "train", on_bad_row: str = "error", **kwargs):
        self._jsonl_path = jsonl_path
        self._split = split
        self._on_bad_row = on_bad_row
        kwargs.setdefault("file_format", "array_record")
        super().__init__(**kwargs)

    @tfds.core.utils.classproperty
    @classmethod
    def code_path(cls):
        """None: the builder has no checksums or metadata files next to its code (it reads local files only).

        tfds would otherwise locate this module through ``importlib_resources``, which it does not install.
        """
        return None

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description="Examples in the feynrl-jax common format (prompt, response, chosen, rejected, answer).",
            features=tfds.features.FeaturesDict(
                {"example": tfds.features.Text(), "row": tfds.features.Scalar(dtype=np.int64)}
            ),
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # local files only
        if self._jsonl_path is None:
            raise DataError("JsonlExamples needs jsonl_path to prepare a data set (reading a prepared one does not)")
        return {self._split: self._generate_examples()}

    def _generate_examples(self):
        source = read_jsonl(self._jsonl_path, on_bad_row=self._on_bad_row)
        for line, example in zip(source.row_numbers, source.examples, strict=True):
            yield line, {"example": json.dumps(example, ensure_ascii=False), "row": line}


def build_jsonl_tfds(jsonl_path: str, data_dir: str, *, split: str = "train", on_bad_row: str = "error") -> str:
    """Prepares :class:`JsonlExamples` for ``jsonl_path`` under ``data_dir`` (array_record files).

    Returns:
        The prepared data set folder (``data_dir/jsonl_examples/1.0.0``), readable with :func:`read_tfds`.
    """
    builder = JsonlExamples(jsonl_path=jsonl_path, split=split, on_bad_row=on_bad_row, data_dir=data_dir)
    builder.download_and_prepare()
    return os.fspath(builder.data_dir)


def _decode_record(record: dict[str, Any]) -> Any:
    if set(record) == {"example", "row"}:
        return json.loads(_text(record["example"]))
    return {key: _text(value) for key, value in record.items()}


def _text(value: Any) -> Any:
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if hasattr(value, "tolist"):
        return _text(value.tolist())
    if isinstance(value, list):
        return [_text(v) for v in value]
    if isinstance(value, dict):
        return {k: _text(v) for k, v in value.items()}
    return value


def read_tfds(
    name: str,
    *,
    split: str = "train",
    data_dir: str | None = None,
    required: tuple[str, ...] = (),
    on_bad_row: str = "error",
    columns: Mapping[str, str] | None = None,
) -> ExampleSource:
    """Reads an array_record tfds data set with ``tfds.data_source`` into an :class:`ExampleSource`.

    Args:
        name: a registered data set name (looked up under ``data_dir``), or the path of a prepared data set
            folder (``.../<name>/<version>``).
        split: the split to read ("train", "test", "train[:10%]"...).
        data_dir: the tfds data folder when ``name`` is a name.
        required: fields every example must have beyond ``prompt``.
        on_bad_row: "error" or "skip". Rows are numbered by record index from 1, or by source JSONL line for
            data sets built by :class:`JsonlExamples`. Examples come back in row order.
        columns: example field -> feature name, for data sets that name their features differently.
    """
    label = f"{name}[{split}]"
    try:
        if os.path.isdir(name):
            source = tfds.builder_from_directory(name).as_data_source(split=split)
        else:
            source = tfds.data_source(name, split=split, data_dir=data_dir, download=False)
    except Exception as error:  # tfds raises many types for a missing or unprepared data set
        raise DataError(f"cannot open tfds data set {label} (data_dir={data_dir}): {error}") from error

    rows = []
    for index in range(len(source)):
        record = source[index]
        row = int(record["row"]) if set(record) == {"example", "row"} else index + 1
        rows.append((row, _decode_record(record)))
    rows.sort(key=lambda pair: pair[0])  # tfds stores records in hashed-key order; give back file order
    return collect_rows(label, rows, required=required, on_bad_row=on_bad_row, columns=columns)
