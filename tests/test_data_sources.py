"""Data sources: JSONL, Parquet, tfds (array_record), reasoning-gym, CHAMP; and the bad-data table."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from feynrl_jax.data import BadRowError, DataError, MixtureSource, SFTBatches, read_jsonl, read_parquet
from feynrl_jax.data.toy_tokenizer import build_toy_tokenizer

GOOD = {"prompt": "What is 2 + 2?", "response": "4", "answer": "4"}


@pytest.fixture(scope="module")
def tokenizer():
    return build_toy_tokenizer(["What is 2 + 2? The answer is 4.", "Calculate 12 * 3 = 36"])


def write_jsonl(path, lines: list[bytes]):
    path.write_bytes(b"\n".join(lines) + b"\n")
    return str(path)


def encode(row) -> bytes:
    return json.dumps(row).encode()


# name, raw line (line 3 of the file), the kind counted when skipped.
BAD_ROWS = [
    ("malformed_json", b'{"prompt": "hi", "response": ', "malformed_json"),
    ("missing_field", encode({"response": "4"}), "missing_field"),
    ("missing_response", encode({"prompt": "What?"}), "missing_field"),
    ("wrong_type_prompt", encode({"prompt": 7, "response": "4"}), "wrong_type"),
    ("wrong_type_response", encode({"prompt": "hi", "response": ["4"]}), "wrong_type"),
    ("not_an_object", encode(["hi", "4"]), "wrong_type"),
    ("empty_response", encode({"prompt": "hi", "response": "  "}), "empty_text"),
    (
        "unknown_role",
        encode({"messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "4"}]}),
        "unknown_role",
    ),
    (
        "message_without_content",
        encode({"messages": [{"role": "user"}, {"role": "assistant", "content": "4"}]}),
        "missing_field",
    ),
    ("not_utf8", b'{"prompt": "caf\xe9", "response": "4"}', "not_utf8"),
]


@pytest.mark.parametrize("name,line,kind", BAD_ROWS, ids=[b[0] for b in BAD_ROWS])
def test_bad_row_is_an_error_naming_file_and_row(tmp_path, name, line, kind):
    path = write_jsonl(tmp_path / f"{name}.jsonl", [encode(GOOD), encode(GOOD), line, encode(GOOD)])
    with pytest.raises(BadRowError) as info:
        read_jsonl(path, required=("response",))
    assert info.value.path == path and info.value.row == 3 and info.value.kind == kind
    assert path in str(info.value) and "row 3" in str(info.value)


@pytest.mark.parametrize("name,line,kind", BAD_ROWS, ids=[b[0] for b in BAD_ROWS])
def test_bad_row_is_skipped_counted_and_logged(tmp_path, caplog, name, line, kind):
    path = write_jsonl(tmp_path / f"{name}.jsonl", [encode(GOOD), encode(GOOD), line, encode(GOOD)])
    source = read_jsonl(path, required=("response",), on_bad_row="skip")
    assert len(source) == 3 and dict(source.skipped) == {kind: 1}
    assert source.row_numbers == [1, 2, 4] and source.rows == 4
    row_line, summary = [r.getMessage() for r in caplog.records]
    assert row_line.startswith(f"{path}, row 3 skipped (on_bad_row=skip; {kind})")
    assert summary.startswith(f"{path}: skipped 1 of 4 rows as bad rows ({kind}: 1)") and "e.g. row 3: " in summary


def test_over_long_prompt_is_filtered_and_counted(tmp_path, tokenizer):
    long_row = {"prompt": "What is 2 + 2? " * 40, "response": "4"}
    path = write_jsonl(tmp_path / "long.jsonl", [encode(GOOD), encode(long_row), encode(GOOD)])
    source = read_jsonl(path, required=("response",))
    assert len(source) == 3  # a long prompt is a valid row; the length budget filters it
    batches = SFTBatches(
        {"f": MixtureSource(source)},
        tokenizer,
        batch_size=2,
        max_seq_len=64,
        max_prompt_len=32,
        packing=False,
        seed=0,
        shuffle=False,
        num_epochs=1,
    )
    rows = [b for b in batches]
    assert batches.stream.skipped == {"prompt_too_long": 1}
    assert batches.stream.taken == {"f": 2}
    assert sum(int((b.segment_ids.max(axis=1) > 0).sum()) for b in rows) == 2
    assert batches.metrics()["train/data/skipped_rows/prompt_too_long"] == 1.0
    assert batches.metrics()["train/data/skipped_rows/f/prompt_too_long"] == 1.0


def test_many_bad_rows_log_a_few_lines_and_reach_the_metrics(tmp_path, caplog, tokenizer):
    from feynrl_jax.tracking.namespaces import check_metric_name

    lines = [encode(GOOD), b"{broken"] + [b"{broken"] * 29 + [encode({"prompt": "no response"})] * 20 + [encode(GOOD)]
    path = write_jsonl(tmp_path / "noisy.jsonl", lines)
    source = read_jsonl(path, required=("response",), on_bad_row="skip")
    assert len(caplog.records) == 4  # three rows one line each, then one summary
    assert (
        "skipped 50 of 52 rows as bad rows (malformed_json: 30, missing_field: 20)" in caplog.records[-1].getMessage()
    )
    batches = SFTBatches(
        {"noisy": MixtureSource(source)},
        tokenizer,
        batch_size=2,
        max_seq_len=64,
        max_prompt_len=32,
        packing=False,
        seed=0,
    )
    assert batches.skipped() == {
        "train/data/skipped_rows": 50.0,
        "train/data/skipped_rows/malformed_json": 30.0,
        "train/data/skipped_rows/missing_field": 20.0,
        "train/data/skipped_rows/noisy/malformed_json": 30.0,
        "train/data/skipped_rows/noisy/missing_field": 20.0,
    }
    assert batches.skip_counts() == {"malformed_json": 30, "missing_field": 20}
    assert all(check_metric_name(name) for name in batches.metrics())


def test_a_source_of_only_bad_rows_fails_naming_it(tmp_path, tokenizer):
    from feynrl_jax.config.base import add_data_source, base_config, data_source
    from feynrl_jax.data import build_mixture_from_config

    good = write_jsonl(tmp_path / "good.jsonl", [encode(GOOD)] * 3)
    bad = write_jsonl(tmp_path / "bad.jsonl", [b"{broken"] * 2 + [encode({"prompt": "no response"})])
    config = base_config()
    add_data_source(config, "good", data_source("jsonl", path=good))
    add_data_source(config, "bad", data_source("jsonl", path=bad))
    with config.unlocked():
        config.data.on_bad_row = "skip"
    with pytest.raises(DataError) as info:
        build_mixture_from_config(config.data, tokenizer, paradigm="sft", batch_size=2)
    assert str(info.value) == (
        f"data.sources.bad ({bad}): all 3 rows were skipped as bad rows (malformed_json: 2, missing_field: 1); "
        "e.g. row 1: malformed JSON: Expecting property name enclosed in double quotes at column 2"
    )


def test_unknown_on_bad_row_value_is_rejected(tmp_path):
    path = write_jsonl(tmp_path / "a.jsonl", [encode(GOOD)])
    with pytest.raises(DataError, match="on_bad_row"):
        read_jsonl(path, on_bad_row="ignore")


def test_missing_file_names_the_path(tmp_path):
    with pytest.raises(DataError, match="nope.jsonl"):
        read_jsonl(str(tmp_path / "nope.jsonl"))


def test_jsonl_reads_fields_metadata_and_renamed_columns(tmp_path):
    rows = [
        {"question": "Q1", "solution": "A1", "answer": 3, "difficulty": "easy"},
        {"question": "Q2", "solution": "A2", "answer": "x", "metadata": {"id": 7}},
    ]
    path = write_jsonl(tmp_path / "renamed.jsonl", [encode(r) for r in rows] + [b"   "])
    source = read_jsonl(path, required=("response",), columns={"prompt": "question", "response": "solution"})
    assert [e["prompt"] for e in source] == ["Q1", "Q2"]
    assert [e["response"] for e in source] == ["A1", "A2"]
    assert source[0]["answer"] == "3" and source[0]["metadata"] == {"difficulty": "easy"}
    assert source[1]["metadata"] == {"id": 7}


def test_parquet_reads_rows_and_names_a_bad_row(tmp_path):
    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.table({"prompt": ["a", "b", "c"], "chosen": ["x", "", "z"], "rejected": ["y", "y", "w"]}), path)
    with pytest.raises(BadRowError) as info:
        read_parquet(path, required=("chosen", "rejected"))
    assert info.value.row == 2 and info.value.kind == "empty_text" and path in str(info.value)
    source = read_parquet(path, required=("chosen", "rejected"), on_bad_row="skip")
    assert [e["prompt"] for e in source] == ["a", "c"] and source.skipped == {"empty_text": 1}


def test_corrupt_parquet_is_a_clear_error(tmp_path):
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"PAR1 not really")
    with pytest.raises(DataError, match="broken.parquet"):
        read_parquet(str(path))


def test_tfds_builder_writes_array_record_and_reads_back(tmp_path):
    from feynrl_jax.data.tfds_source import build_jsonl_tfds, read_tfds

    rows = [encode({"prompt": f"q{i}", "response": f"r{i}", "answer": str(i)}) for i in range(6)]
    rows.insert(2, b"{broken")
    path = write_jsonl(tmp_path / "src.jsonl", rows)
    data_dir = tmp_path / "tfds"
    folder = build_jsonl_tfds(path, str(data_dir), on_bad_row="skip")
    assert list((data_dir / "jsonl_examples" / "1.0.0").glob("*.array_record*")), "no array_record files written"
    by_name = read_tfds("jsonl_examples", split="train", data_dir=str(data_dir), required=("response",))
    by_folder = read_tfds(folder, split="train")
    expected = read_jsonl(path, on_bad_row="skip")
    for source in (by_name, by_folder):
        assert source.row_numbers == expected.row_numbers == [1, 2, 4, 5, 6, 7]
        assert source.examples == expected.examples


def test_tfds_missing_dataset_is_a_clear_error(tmp_path):
    from feynrl_jax.data.tfds_source import read_tfds

    with pytest.raises(DataError, match="no_such_set"):
        read_tfds("no_such_set", data_dir=str(tmp_path))


def test_reasoning_gym_split_is_disjoint_and_deterministic():
    from feynrl_jax.data.reasoning_gym_source import assert_disjoint, reasoning_gym_source, reasoning_gym_split

    small = dict(
        min_terms=2,
        max_terms=2,
        min_digits=1,
        max_digits=1,
        operators=("+",),
        allow_parentheses=False,
        allow_negation=False,
    )
    train, held_out = reasoning_gym_split("basic_arithmetic", train_size=40, eval_size=10, seed=5, config=small)
    assert len(train) == 40 and len(held_out) == 10
    train_q = {e["prompt"] for e in train}
    assert not train_q & {e["prompt"] for e in held_out}
    assert {e["metadata"]["index"] % 2 for e in train} == {0} and {e["metadata"]["index"] % 2 for e in held_out} == {1}
    # The question space is small (100 sums), so some test items repeat a train question and are dropped.
    assert held_out.skipped["overlaps_train"] > 0
    again = reasoning_gym_source("basic_arithmetic", size=40, seed=5, config=small)
    assert [e["prompt"] for e in again] == [e["prompt"] for e in train]
    assert all(e["answer"] == str(eval(e["metadata"]["entry"]["metadata"]["expression"])) for e in train)
    with pytest.raises(DataError, match="share"):
        assert_disjoint(train, train)


def test_reasoning_gym_split_fails_when_the_space_is_exhausted():
    from feynrl_jax.data.reasoning_gym_source import reasoning_gym_split

    tiny = dict(
        min_terms=2,
        max_terms=2,
        min_digits=1,
        max_digits=1,
        operators=("+",),
        allow_parentheses=False,
        allow_negation=False,
    )
    with pytest.raises(DataError, match="held-out questions"):
        reasoning_gym_split("basic_arithmetic", train_size=200, eval_size=60, seed=0, config=tiny)


def test_reasoning_gym_preference_pairs_state_right_and_wrong_answers():
    from feynrl_jax.data.reasoning_gym_source import preference_pairs, reasoning_gym_source

    source = reasoning_gym_source("chain_sum", size=20, seed=1)
    pairs = preference_pairs(source, response_template="The answer is {answer}.", seed=0)
    for pair in pairs:
        assert pair["chosen"] == f"The answer is {pair['answer']}."
        wrong = pair["metadata"]["rejected_answer"]
        assert wrong != pair["answer"] and pair["rejected"] == f"The answer is {wrong}."


def test_unknown_reasoning_gym_task_is_a_clear_error():
    from feynrl_jax.data.reasoning_gym_source import reasoning_gym_source

    with pytest.raises(DataError, match="no_such_task"):
        reasoning_gym_source("no_such_task", size=2, seed=0)


def test_champ_problems_load_with_answers():
    from feynrl_jax.data.champ_source import CHAMP_INSTRUCTION, champ_source

    everything = champ_source()
    assert len(everything) == 270
    combinatorics = champ_source(categories=("Combinatorics",), limit=5)
    assert len(combinatorics) == 5
    first = combinatorics[0]
    assert first["prompt"].startswith(CHAMP_INSTRUCTION) and first["answer"]
    assert first["metadata"]["category"] == "Combinatorics" and first["metadata"]["id"].startswith("P_")
    with pytest.raises(DataError, match="Geometry"):
        champ_source(categories=("Geometry",))
