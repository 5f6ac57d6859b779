"""Tokenizers and chat templates from a local folder, through transformers, never from a hub."""

from __future__ import annotations

import os

TOKENIZER_MODEL_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def load_tokenizer(path: str | os.PathLike):
    """Loads the tokenizer (and its chat template) saved in a local folder.

    Args:
        path: a folder holding `tokenizer.json` (or `tokenizer.model` / `vocab.json`) and
            `tokenizer_config.json`, e.g. a HF checkpoint folder or one written by `convert_gguf`.

    Returns:
        A `transformers` tokenizer; `apply_chat_template` uses the folder's chat template.

    Raises:
        FileNotFoundError: the folder does not exist or holds no tokenizer files (the message names it).
    """
    folder = os.fspath(path)
    if not os.path.isdir(folder):
        raise FileNotFoundError(f"tokenizer folder {folder} does not exist")
    if not any(os.path.isfile(os.path.join(folder, name)) for name in TOKENIZER_MODEL_FILES):
        raise FileNotFoundError(
            f"no tokenizer in {folder}: expected one of {TOKENIZER_MODEL_FILES} (plus tokenizer_config.json)"
        )
    from transformers import AutoTokenizer  # heavy import, only when a tokenizer is needed

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)
