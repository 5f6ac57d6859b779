"""A tiny byte-level BPE tokenizer with a ChatML chat template, built locally (no hub).

For unit tests and ``runlocal`` smoke runs that need a real ``transformers`` tokenizer without downloading
one. Byte-level BPE covers every UTF-8 string; merges are learned from the few strings given.
"""

from __future__ import annotations

from collections.abc import Iterable

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ("<pad>", "<|endoftext|>", "<|im_start|>", "<|im_end|>")


def build_toy_tokenizer(corpus: Iterable[str], *, vocab_size: int = 400, chat_template: str | None = CHATML_TEMPLATE):
    """Trains a byte-level BPE on ``corpus`` and wraps it as a ``PreTrainedTokenizerFast``.

    Args:
        corpus: a few strings to learn merges from.
        vocab_size: the target vocabulary size (at least 256 bytes + the special tokens).
        chat_template: a jinja chat template; the default is ChatML (``<|im_start|>role ... <|im_end|>``).

    Returns:
        A ``transformers.PreTrainedTokenizerFast`` with ``pad_token="<pad>"`` (id 0), ``eos_token="<|im_end|>"``
        and ``bos_token=None``; ``save_pretrained`` writes a folder that ``AutoTokenizer`` loads.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(corpus), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<|im_end|>", unk_token=None, bos_token=None
    )
    fast.chat_template = chat_template
    return fast
