"""Tokenizers and chat templates from a local folder, through transformers, never from a hub."""

from __future__ import annotations

import json
import os

TOKENIZER_MODEL_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")

# Model types for which `AutoTokenizer` loads a folder whose `tokenizer_config.json` names `TokenizersBackend` as
# that class itself (the model type's own class is not forced over the folder's; transformers 5.x). Such a folder
# is loaded through the class directly: `transformers.AutoTokenizer` imports PyTorch where it is installed, 2-3 s
# in every process that loads a tokenizer (each Ray actor of a run; 5 s for a tokenizer alone on the 2-core
# machine), and the class alone does not. A folder without `config.json` (a tokenizer saved on its own, such as
# `data.toy_tokenizer`'s) has no model type for `AutoTokenizer` to go by, so it takes the named class too.
# tests/test_tokenizer_loading.py checks that both give the same tokenizer.
PLAIN_BACKEND_MODEL_TYPES = ("llama",)


def loads_as_plain_backend(folder: str) -> bool:
    """True where `AutoTokenizer` would load `folder` as `TokenizersBackend` itself: a `tokenizer.json`, a
    `tokenizer_config.json` naming that class and no remote code, and either no `config.json` or one of a model type
    in `PLAIN_BACKEND_MODEL_TYPES`. A `config.json` or `tokenizer_config.json` that is there but cannot be read as
    a JSON object answers False (`AutoTokenizer` then decides)."""
    try:
        with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
            tokenizer_config = json.load(f)
        config_path = os.path.join(folder, "config.json")
        if os.path.exists(config_path):
            with open(config_path, encoding="utf-8") as f:
                plain_model_type = json.load(f).get("model_type") in PLAIN_BACKEND_MODEL_TYPES
        else:
            plain_model_type = True
    except (OSError, ValueError, AttributeError):
        return False
    return (
        isinstance(tokenizer_config, dict)
        and tokenizer_config.get("tokenizer_class") == "TokenizersBackend"
        and "auto_map" not in tokenizer_config
        and plain_model_type
        and os.path.isfile(os.path.join(folder, "tokenizer.json"))
    )


def check_tokenizer_folder(path: str | os.PathLike) -> str:
    """`path` as a string, checked without loading anything (no transformers import): a folder that holds a
    tokenizer's model file.

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
    return folder


def load_tokenizer(path: str | os.PathLike):
    """Loads the tokenizer (and its chat template) saved in a local folder.

    Args:
        path: a folder holding `tokenizer.json` (or `tokenizer.model` / `vocab.json`) and
            `tokenizer_config.json`, e.g. a HF checkpoint folder or one written by `convert_gguf`.

    Returns:
        A `transformers` tokenizer, the one `AutoTokenizer` gives; `apply_chat_template` uses the folder's chat
        template.

    Raises:
        FileNotFoundError: the folder does not exist or holds no tokenizer files (the message names it).
    """
    folder = check_tokenizer_folder(path)
    if loads_as_plain_backend(folder):
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(folder, local_files_only=True)
    from transformers import AutoTokenizer  # heavy import, only when a tokenizer is needed

    return AutoTokenizer.from_pretrained(folder, local_files_only=True)
