"""`load_tokenizer` gives the tokenizer `transformers.AutoTokenizer` gives, and loads the folders `convert_gguf`
writes (SmolLM2's) and tokenizers saved on their own (no `config.json`, e.g. `data.toy_tokenizer`'s) without
importing PyTorch: through `TokenizersBackend` directly, 2-5 s sooner in every process that loads one. Folders it
cannot vouch for (another model type, another class, remote code, a `config.json` that cannot be read) go
through `AutoTokenizer` itself.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from feynrl_jax.checkpoints import load_tokenizer, smollm2_checkpoint_dir
from feynrl_jax.checkpoints.tokenizer import loads_as_plain_backend

transformers = pytest.importorskip("transformers")

TEXTS = [
    "What is 12 * 7?",
    "  leading spaces,\ttabs\nand a new line ",
    "<|im_start|>user\nhi<|im_end|>",
    "émigré naïve 数学 🙂",
    "",
]
CHATS = [
    [{"role": "user", "content": "What is 2 + 3?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Sum 1, 2 and 3."}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "4+4?"},
    ],
]


def assert_same_tokenizer(ours, auto):
    assert type(ours) is type(auto)
    assert repr(ours) == repr(auto)  # the settings: lengths, padding and truncation sides, special tokens
    assert ours.init_kwargs.keys() == auto.init_kwargs.keys()
    assert ours.get_vocab() == auto.get_vocab()
    assert {i: str(t) for i, t in ours.added_tokens_decoder.items()} == {
        i: str(t) for i, t in auto.added_tokens_decoder.items()
    }
    assert ours.all_special_tokens == auto.all_special_tokens
    for name in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        assert getattr(ours, name) == getattr(auto, name), name
    assert ours.chat_template == auto.chat_template
    for text in TEXTS:
        for special in (True, False):
            ids = ours(text, add_special_tokens=special)["input_ids"]
            assert ids == auto(text, add_special_tokens=special)["input_ids"], (text, special)
            assert ours.decode(ids) == auto.decode(ids)
    for chat in CHATS:
        for tokenize in (False, True):
            got = ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=tokenize)
            assert got == auto.apply_chat_template(chat, add_generation_prompt=True, tokenize=tokenize)


@pytest.fixture(scope="module")
def smollm2_folder():
    return smollm2_checkpoint_dir()


@pytest.fixture(scope="module")
def toy_folder(tmp_path_factory):
    """A tokenizer saved on its own (`save_pretrained`, no `config.json`), as the tests' CLI runs use."""
    from feynrl_jax.data.toy_tokenizer import build_toy_tokenizer

    folder = str(tmp_path_factory.mktemp("toy_tokenizer"))
    build_toy_tokenizer([t for t in TEXTS if t] + ["What is 2 plus 3? 2 plus 3 is 5."], vocab_size=300).save_pretrained(
        folder
    )
    assert not os.path.exists(os.path.join(folder, "config.json"))
    return folder


@pytest.fixture(scope="module")
def smollm2_without_config_folder(smollm2_folder, tmp_path_factory):
    """SmolLM2's tokenizer files without the model's `config.json`."""
    return _edited_copy(smollm2_folder, tmp_path_factory.mktemp("edited"), "no config.json")


@pytest.mark.parametrize("which", ["smollm2", "toy", "smollm2_without_config"])
def test_the_folders_loaded_directly_give_the_tokenizer_autotokenizer_loads(request, which):
    folder = request.getfixturevalue(f"{which}_folder")
    assert loads_as_plain_backend(folder)
    auto = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert_same_tokenizer(load_tokenizer(folder), auto)


@pytest.mark.parametrize("which", ["smollm2", "toy"])
def test_loading_a_tokenizer_does_not_import_torch(request, which):
    if importlib.util.find_spec("torch") is None:  # (not imported here: this process need not load it)
        pytest.skip("PyTorch is not installed, so nothing could import it")
    folder = request.getfixturevalue(f"{which}_folder")
    code = (
        "import sys\n"
        "from feynrl_jax.checkpoints import load_tokenizer\n"
        f"tokenizer = load_tokenizer({folder!r})\n"
        "assert tokenizer('2 + 3')['input_ids'], 'no tokens'\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "False", out.stdout + out.stderr


def _edited_copy(src: str, dst, change: str) -> str:
    folder = str(dst / change.replace(" ", "_"))
    os.makedirs(folder)
    for name in os.listdir(src):
        if name != "model.safetensors":
            shutil.copy(os.path.join(src, name), folder)
    with open(os.path.join(folder, "tokenizer_config.json")) as f:
        tokenizer_config = json.load(f)
    with open(os.path.join(folder, "config.json")) as f:
        model_config = json.load(f)
    if change == "qwen2 model type":  # AutoTokenizer forces Qwen2's own class over the folder's
        model_config["model_type"] = "qwen2"
    elif change == "generic fast class":
        tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    elif change == "remote code":
        tokenizer_config["auto_map"] = {"AutoTokenizer": [None, "tokenization_custom.CustomTokenizer"]}
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config, f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(model_config, f)
    if change == "no config.json":
        os.remove(os.path.join(folder, "config.json"))
    elif change == "unreadable config.json":  # AutoTokenizer reports the broken file; the fast path must not hide it
        with open(os.path.join(folder, "config.json"), "w") as f:
            f.write("{not json")
    return folder


@pytest.mark.parametrize("change", ["qwen2 model type", "generic fast class", "remote code", "unreadable config.json"])
def test_other_folders_are_left_to_autotokenizer(smollm2_folder, tmp_path, change):
    folder = _edited_copy(smollm2_folder, tmp_path, change)
    assert not loads_as_plain_backend(folder)
    if change == "remote code":  # AutoTokenizer would ask to trust the code: nothing more to compare
        return
    if change == "unreadable config.json":  # the error names the file, as AutoTokenizer's does
        with pytest.raises(OSError, match=re.escape(os.path.join(folder, "config.json"))):
            load_tokenizer(folder)
        return
    auto = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
    if change == "qwen2 model type":
        assert type(auto).__name__ == "Qwen2Tokenizer"  # the case the fast path must not take
    assert_same_tokenizer(load_tokenizer(folder), auto)
