"""Mixtures: determinism, ratios, exact state restore; SFT / DPO / prompt batches; the config edge."""

import json

import numpy as np
import pytest

from feynrl_jax.data import (
    DataError,
    DPOBatches,
    ExampleStream,
    MixtureSource,
    PromptBatches,
    SFTBatches,
    Skip,
    build_mixture_from_config,
    from_examples,
)
from feynrl_jax.data.toy_tokenizer import build_toy_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_toy_tokenizer(["question number 12 answer 34", "chosen rejected pair 56"])


def numbered(name, n, **extra):
    return from_examples(
        name, [{"prompt": f"{name} question {i}", "response": f"answer {i}", **extra} for i in range(n)]
    )


def sources(weights=(3.0, 1.0)):
    return {"a": MixtureSource(numbered("a", 10), weights[0]), "b": MixtureSource(numbered("b", 7), weights[1])}


def test_mixture_is_deterministic_under_seed_and_follows_ratios():
    first = [e["prompt"] for _, e in zip(range(4000), ExampleStream(sources(), seed=3))]
    again = [e["prompt"] for _, e in zip(range(4000), ExampleStream(sources(), seed=3))]
    other = [e["prompt"] for _, e in zip(range(4000), ExampleStream(sources(), seed=4))]
    assert first == again and first != other
    share_a = sum(p.startswith("a ") for p in first) / len(first)
    assert abs(share_a - 0.75) < 0.03
    # Every epoch of a source is a permutation of it.
    a_prompts = [p for p in first if p.startswith("a ")]
    assert sorted(a_prompts[:10]) == sorted(f"a question {i}" for i in range(10))


def test_examples_carry_source_and_row():
    stream = ExampleStream({"only": MixtureSource(numbered("x", 3))}, seed=0, shuffle=False, num_epochs=1)
    got = [(e["source"], e["row"], e["prompt"]) for e in stream]
    assert got == [("only", 1, "x question 0"), ("only", 2, "x question 1"), ("only", 3, "x question 2")]


def test_stream_state_restores_exactly_through_json():
    transform = lambda e: Skip("odd") if int(e["prompt"].split()[-1]) % 2 else e["prompt"]
    stream = ExampleStream(sources(), seed=1, transform=transform)
    for _ in range(13):
        next(stream)
    state = json.loads(json.dumps(stream.get_state()))
    expected = [next(stream) for _ in range(20)]
    restored = ExampleStream(sources(), seed=1, transform=transform)
    restored.set_state(state)
    assert [next(restored) for _ in range(20)] == expected
    assert restored.get_state() == stream.get_state()
    assert stream.skipped["odd"] > 0 and sum(stream.taken.values()) == 33


def test_bad_mixtures_are_rejected():
    with pytest.raises(DataError, match="weight"):
        ExampleStream({"a": MixtureSource(numbered("a", 2), -1.0)}, seed=0)
    with pytest.raises(DataError, match=r"data.sources.a \(empty\) has no examples"):
        ExampleStream({"a": MixtureSource(from_examples("empty", []))}, seed=0)
    with pytest.raises(DataError, match="positive weight"):
        ExampleStream({"a": MixtureSource(numbered("a", 2), 0.0)}, seed=0)
    stream = ExampleStream(sources(), seed=0)
    with pytest.raises(DataError, match="lacks keys"):
        stream.set_state({"next_index": 3})
    with pytest.raises(DataError, match=r"data.sources.a: all 10 examples were skipped \(all: 10\)"):
        next(ExampleStream(sources(), seed=0, transform=lambda e: Skip("all")))


def too_long_unless_good(calls):
    """A transform that drops every example of source "bad" as over-long and counts its calls by source."""

    def transform(example):
        calls[example["source"]] += 1
        if example["source"] == "bad":
            return Skip("prompt_too_long", 20 + example["row"], "data.max_prompt_len=8")
        return example["prompt"]

    return transform


@pytest.mark.parametrize("num_epochs", [None, 1])
def test_a_source_fails_when_its_first_pass_is_all_skipped(num_epochs):
    from collections import Counter

    calls = Counter()
    mixture = {"good": MixtureSource(numbered("good", 5)), "bad": MixtureSource(numbered("bad", 30), 3.0)}
    stream = ExampleStream(mixture, seed=0, num_epochs=num_epochs, transform=too_long_unless_good(calls))
    message = (
        r"^data.sources.bad: all 30 examples were skipped \(prompt_too_long: 30 with 21 to 50 tokens > "
        r"data.max_prompt_len=8\), nothing is left to train on; e.g. row \d+: prompt_too_long: \d+ tokens"
    )
    with pytest.raises(DataError, match=message):
        for _ in range(100):
            next(stream)
    assert calls["bad"] == 30  # exactly one pass of the bad source, not a fixed number of draws
    assert stream.taken["good"] > 0 and stream.skipped["prompt_too_long"] < 30  # the good source was served


def test_skips_are_logged_briefly_counted_by_source_and_restored(caplog, tokenizer):
    from feynrl_jax.tracking.namespaces import check_metric_name

    mixed = from_examples("mixed.jsonl", [{"prompt": "question " * (30 if i % 5 < 3 else 1)} for i in range(10)])
    mixture = {"mixed": MixtureSource(mixed), "short": MixtureSource(numbered("short", 4))}

    def batches():
        return PromptBatches(mixture, tokenizer, batch_size=2, max_prompt_len=40, seed=0)

    first = batches()
    for _ in range(10):
        next(first)
    assert first.stream.get_state()["positions"]["mixed"] >= 10  # its first pass is over
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4, lines  # three skipped rows, then one summary for the source's first pass
    assert all(line.startswith("data.sources.mixed (mixed.jsonl), row ") for line in lines[:3])
    assert "prompt_too_long: " in lines[0] and "tokens > data.max_prompt_len=40" in lines[0]
    assert lines[3].startswith("data.sources.mixed (mixed.jsonl): 6 of its 10 examples were skipped in its first pass")
    skipped = first.skipped()
    n = skipped["train/data/skipped_rows"]
    assert n >= 6 and skipped == {
        "train/data/skipped_rows": n,
        "train/data/skipped_rows/prompt_too_long": n,
        "train/data/skipped_rows/mixed/prompt_too_long": n,
    }
    assert all(check_metric_name(name) for name in first.metrics())

    state = json.loads(json.dumps(first.get_state()))
    resumed = batches()
    resumed.set_state(state)
    assert resumed.skipped() == skipped
    for _ in range(4):
        assert next(resumed).prompt_ids == next(first).prompt_ids
    assert resumed.metrics() == first.metrics()
    legacy = {k: v for k, v in state.items() if k != "skipped_by_source"} | {"skipped": {"prompt_too_long": n}}
    resumed.set_state(legacy)  # a state written before per-source counts: they restart at zero
    assert resumed.skipped() == {"train/data/skipped_rows": 0.0}


@pytest.mark.serial  # times itself
def test_all_prompts_too_long_fails_in_seconds_naming_the_source(tmp_path, tokenizer):
    import time

    from feynrl_jax.config.base import add_data_source, base_config, data_source

    path = tmp_path / "prompts.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"question {i} " * 20, "answer": "1"}) for i in range(300)))
    config = base_config()
    add_data_source(config, "train", data_source("jsonl", path=str(path)))
    with config.unlocked():
        config.data.max_prompt_len = 16
    prompts = build_mixture_from_config(config.data, tokenizer, paradigm="rl", batch_size=4)
    start = time.monotonic()
    with pytest.raises(DataError) as info:
        next(prompts)
    assert time.monotonic() - start < 10.0
    message = str(info.value)
    assert message.startswith(f"data.sources.train ({path}): all 300 examples were skipped (prompt_too_long: 300 with ")
    assert "tokens > data.max_prompt_len=16)" in message


def sft(tokenizer, packing, seed=0):
    return SFTBatches(sources(), tokenizer, batch_size=4, max_seq_len=64, max_prompt_len=32, packing=packing, seed=seed)


@pytest.mark.parametrize("packing", [False, True])
def test_sft_batches_have_fixed_shape_and_restore_exactly(tokenizer, packing):
    batches = sft(tokenizer, packing)
    for _ in range(2):
        next(batches)
    state = json.loads(json.dumps(batches.get_state()))
    expected = [next(batches) for _ in range(3)]
    resumed = sft(tokenizer, packing)
    resumed.set_state(state)
    for want, got in zip(expected, [next(resumed) for _ in range(3)]):
        assert got.shape == (4, 64)
        for field in ("tokens", "positions", "segment_ids", "loss_mask"):
            np.testing.assert_array_equal(getattr(got, field), getattr(want, field))
    batch = expected[0]
    if packing:
        assert batch.segment_ids.max() >= 2  # at least one row holds two sequences
    else:
        assert (batch.segment_ids.max(axis=1) == 1).all()
    # Every trained token is an answer token.
    for row in range(4):
        text = tokenizer.decode(batch.tokens[row][batch.loss_mask[row] > 0])
        assert "answer" in text and "question" not in text


def test_dpo_batches_interleave_chosen_and_rejected(tokenizer):
    pairs = from_examples(
        "p", [{"prompt": f"question {i}", "chosen": f"chosen {i}", "rejected": f"rejected {i}"} for i in range(5)]
    )
    batches = DPOBatches(
        {"p": MixtureSource(pairs)}, tokenizer, pairs_per_batch=3, max_seq_len=40, max_prompt_len=30, seed=0
    )
    batch = next(batches)
    assert batch.shape == (6, 40)
    for i in range(3):
        chosen = tokenizer.decode(batch.tokens[2 * i][batch.loss_mask[2 * i] > 0])
        rejected = tokenizer.decode(batch.tokens[2 * i + 1][batch.loss_mask[2 * i + 1] > 0])
        number = chosen.removeprefix("chosen ").removesuffix("<|im_end|>\n")
        assert chosen == f"chosen {number}<|im_end|>\n" and rejected == f"rejected {number}<|im_end|>\n"
        prompt_len = int((batch.loss_mask[2 * i] == 0).argmin())
        np.testing.assert_array_equal(batch.tokens[2 * i, :prompt_len], batch.tokens[2 * i + 1, :prompt_len])


def test_prompt_batches_make_one_exact_pass_for_evaluation(tokenizer):
    examples = from_examples("e", [{"prompt": f"question {i}", "answer": str(i)} for i in range(7)])
    batches = PromptBatches(
        {"e": MixtureSource(examples)}, tokenizer, batch_size=3, max_prompt_len=64, seed=0, shuffle=False, num_epochs=1
    )
    got = list(batches)
    assert [len(b) for b in got] == [3, 3, 1]
    answers = [e["answer"] for b in got for e in b.examples]
    assert answers == [str(i) for i in range(7)]
    first = got[0]
    assert first.prompt_ids[0] == list(tokenizer(first.prompt_texts[0], add_special_tokens=False)["input_ids"])
    assert first.prompt_texts[0].endswith("<|im_start|>assistant\n")


def test_build_mixture_from_config(tmp_path, tokenizer):
    from feynrl_jax.config.base import add_data_source, base_config, data_source

    path = tmp_path / "sft.jsonl"
    path.write_text(
        "\n".join(json.dumps({"q": f"question {i}", "response": f"answer {i}"}) for i in range(6)) + "\n{bad\n"
    )
    config = base_config()
    add_data_source(config, "file", data_source("jsonl", path=str(path), weight=1.0, fields={"prompt": "q"}))
    add_data_source(config, "arith", data_source("reasoning_gym", task="chain_sum", size=8, seed=2, weight=1.0))
    add_data_source(config, "held_out", data_source("reasoning_gym", task="chain_sum", size=4, seed=2, split="test"))
    with config.unlocked():
        config.data.max_seq_len, config.data.max_prompt_len, config.data.packing = 256, 200, True
    with pytest.raises(DataError, match=r"sft.jsonl, row 7"):
        build_mixture_from_config(config.data, tokenizer, paradigm="sft", batch_size=2, response_template="= {answer}")
    with config.unlocked():
        config.data.on_bad_row = "skip"
    batches = build_mixture_from_config(
        config.data, tokenizer, paradigm="sft", batch_size=2, response_template="= {answer}"
    )
    assert isinstance(batches, SFTBatches) and next(batches).shape == (2, 256)
    assert set(batches.stream.names) == {"file", "arith"}
    evaluation = build_mixture_from_config(
        config.data, tokenizer, paradigm="eval", batch_size=4, split="test", shuffle=False, num_epochs=1
    )
    held_out = [e["prompt"] for b in evaluation for e in b.examples]
    train = [e["prompt"] for e in batches.stream._sources["arith"].examples]
    assert len(held_out) == 4 and not set(held_out) & set(train)
    assert evaluation.stream.skipped == {}
    with pytest.raises(DataError, match="response_template"):
        build_mixture_from_config(config.data, tokenizer, paradigm="dpo", batch_size=2)
    add_data_source(config, "nofile", data_source("parquet"))
    with pytest.raises(DataError, match=r"data.sources.nofile.path"):
        build_mixture_from_config(config.data, tokenizer, paradigm="sft", batch_size=2, response_template="{answer}")


def test_over_long_pairs_and_sequences_are_counted_not_crashed(tokenizer):
    pairs = from_examples(
        "p",
        [
            {"prompt": "question 1", "chosen": "chosen 1", "rejected": "rejected 1"},
            {"prompt": "question 2 " * 20, "chosen": "chosen 2", "rejected": "rejected 2"},
            {"prompt": "question 3", "chosen": "chosen 3", "rejected": "rejected " * 30},
        ],
    )
    dpo = DPOBatches(
        {"p": MixtureSource(pairs)},
        tokenizer,
        pairs_per_batch=2,
        max_seq_len=48,
        max_prompt_len=30,
        seed=0,
        shuffle=False,
        num_epochs=1,
    )
    batch = next(dpo)
    assert batch.shape == (4, 48) and (batch.segment_ids[2:] == 0).all()  # one pair fit; the second pair row is padding
    assert dpo.stream.skipped == {"prompt_too_long": 1, "sequence_too_long": 1}
    long_response = from_examples("s", [{"prompt": "q", "response": "answer " * 40}, {"prompt": "q", "response": "a"}])
    sft_batches = SFTBatches(
        {"s": MixtureSource(long_response)},
        tokenizer,
        batch_size=2,
        max_seq_len=32,
        max_prompt_len=20,
        packing=False,
        seed=0,
        shuffle=False,
        num_epochs=1,
    )
    next(sft_batches)
    assert sft_batches.stream.skipped == {"sequence_too_long": 1} and sft_batches.stream.taken == {"s": 1}
