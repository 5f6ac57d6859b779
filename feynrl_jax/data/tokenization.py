"""Chat-template rendering and tokenisation with loss masks.

A conversation is rendered with the tokenizer's own jinja chat template and tokenised piece by piece: the text
before each assistant turn (rendered with ``add_generation_prompt=True``), then the assistant turn itself. The
loss mask is 1 on the assistant pieces only (their content and the end-of-turn token that the template puts
after it, so the model learns to stop), 0 elsewhere. Tokenising the prompt as one piece makes training see
exactly the tokens that the rollout engine sees: the rendered prompt, then the generated tokens.

Without a chat template (or with ``use_chat_template=False``) a prompt is plain text tokenised with the
tokenizer's special tokens (BOS when it has one), and a response is followed by the EOS token.

Every render must extend the previous one (true of ordinary templates); a template that rewrites earlier turns
(e.g. one that strips the reasoning of past assistant turns) raises an error instead of producing wrong masks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from feynrl_jax.data.examples import DataError, prompt_messages


@dataclass(frozen=True)
class TokenizedSequence:
    """One tokenised training sequence.

    Attributes:
        tokens: ``[L]`` int32 token ids.
        loss_mask: ``[L]`` float32, 1 on tokens the loss trains on (response / assistant tokens).
        prompt_length: the number of tokens before the first trained token.
    """

    tokens: np.ndarray
    loss_mask: np.ndarray
    prompt_length: int

    def __len__(self) -> int:
        return int(self.tokens.shape[0])


def has_chat_template(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` carries a chat template."""
    return bool(getattr(tokenizer, "chat_template", None))


def _render(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    if not messages:
        return ""
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    except Exception as error:  # jinja raises TemplateError (and templates call raise_exception) for bad turns
        roles = [m["role"] for m in messages]
        raise DataError(f"the chat template rejected messages with roles {roles}: {error}") from error
    if not isinstance(text, str):
        raise DataError(f"chat template rendered {type(text).__name__}, expected a string")
    return text


def _encode(tokenizer: Any, text: str, *, add_special_tokens: bool = False) -> list[int]:
    if not text:
        return []
    return list(tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])


def _use_template(tokenizer: Any, use_chat_template: bool) -> bool:
    return use_chat_template and has_chat_template(tokenizer)


def render_prompt(
    tokenizer: Any, prompt: str | list[dict[str, str]], *, use_chat_template: bool = True, system_prompt: str = ""
) -> str:
    """The prompt text the model continues: the chat template with the generation prompt, or the plain string.

    Args:
        tokenizer: a ``transformers`` tokenizer.
        prompt: a string or chat messages.
        use_chat_template: render with the tokenizer's chat template when it has one.
        system_prompt: prepended as a system turn (chat) or as a first paragraph (plain text) when non-empty.

    Raises:
        DataError: the prompt is a list of chat messages but no chat template is in use.
    """
    if _use_template(tokenizer, use_chat_template):
        return _render(tokenizer, prompt_messages(prompt, system_prompt), add_generation_prompt=True)
    if not isinstance(prompt, str):
        raise DataError("a prompt given as chat messages needs a tokenizer with a chat template")
    return f"{system_prompt}\n\n{prompt}" if system_prompt else prompt


def tokenize_prompt(
    tokenizer: Any, prompt: str | list[dict[str, str]], *, use_chat_template: bool = True, system_prompt: str = ""
) -> list[int]:
    """Token ids of the rendered prompt (what a rollout engine is given); arguments as in :func:`render_prompt`."""
    text = render_prompt(tokenizer, prompt, use_chat_template=use_chat_template, system_prompt=system_prompt)
    return _encode(tokenizer, text, add_special_tokens=not _use_template(tokenizer, use_chat_template))


def tokenize_conversation(tokenizer: Any, messages: list[dict[str, str]]) -> TokenizedSequence:
    """Tokenises a chat conversation with the loss mask on assistant turns only.

    Args:
        tokenizer: a ``transformers`` tokenizer with a chat template.
        messages: the conversation; turns after the last assistant turn are dropped (nothing to train on).

    Returns:
        The tokens and the mask. ``prompt_length`` counts the tokens before the first assistant turn.
    """
    if not has_chat_template(tokenizer):
        raise DataError("multi-turn conversations need a tokenizer with a chat template")
    last = max((i for i, m in enumerate(messages) if m["role"] == "assistant"), default=None)
    if last is None:
        raise DataError("the conversation has no assistant turn to train on")
    tokens: list[int] = []
    mask: list[float] = []
    rendered = ""
    prompt_length = None
    for i, message in enumerate(messages[: last + 1]):
        if message["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], add_generation_prompt=True)
        after = _render(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if not before.startswith(rendered) or not after.startswith(before):
            raise DataError(
                f"the chat template does not render turn {i} as an extension of the earlier turns; "
                "loss masks cannot be derived from it"
            )
        context = _encode(tokenizer, before[len(rendered) :])
        tokens += context
        mask += [0.0] * len(context)
        if prompt_length is None:
            prompt_length = len(tokens)
        reply = _encode(tokenizer, after[len(before) :])
        tokens += reply
        mask += [1.0] * len(reply)
        rendered = after
    return TokenizedSequence(np.asarray(tokens, np.int32), np.asarray(mask, np.float32), int(prompt_length))


def tokenize_prompt_response(
    tokenizer: Any,
    prompt: str | list[dict[str, str]],
    response: str,
    *,
    use_chat_template: bool = True,
    system_prompt: str = "",
) -> TokenizedSequence:
    """Tokenises a prompt and its response with the loss mask on the response only.

    With a chat template the response is one assistant turn (its end-of-turn token is trained on); without,
    the response text is followed by the tokenizer's EOS token, which is trained on too.
    """
    if _use_template(tokenizer, use_chat_template):
        messages = prompt_messages(prompt, system_prompt) + [{"role": "assistant", "content": response}]
        return tokenize_conversation(tokenizer, messages)
    prompt_ids = tokenize_prompt(tokenizer, prompt, use_chat_template=False, system_prompt=system_prompt)
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no EOS token to end a plain-text response with")
    response_ids = _encode(tokenizer, response) + [tokenizer.eos_token_id]
    tokens = np.asarray(prompt_ids + response_ids, np.int32)
    mask = np.asarray([0.0] * len(prompt_ids) + [1.0] * len(response_ids), np.float32)
    return TokenizedSequence(tokens, mask, len(prompt_ids))


def tokenize_sft_example(
    tokenizer: Any, example: dict[str, Any], *, use_chat_template: bool = True, system_prompt: str = ""
) -> TokenizedSequence:
    """Tokenises an SFT example: ``messages`` (multi-turn) if present, else ``prompt`` + ``response``."""
    if "messages" in example:
        if not _use_template(tokenizer, use_chat_template):
            raise DataError("an example with 'messages' needs a tokenizer with a chat template")
        return tokenize_conversation(tokenizer, prompt_messages(example["messages"], system_prompt))
    if "response" not in example:
        raise DataError("an SFT example needs 'response' or 'messages'")
    return tokenize_prompt_response(
        tokenizer,
        example["prompt"],
        example["response"],
        use_chat_template=use_chat_template,
        system_prompt=system_prompt,
    )
