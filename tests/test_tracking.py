"""Tracking: metrics.jsonl, namespaces, progress bar, wandb offline, and PNG plots — all with real files."""

import io
import json
import logging
import math
import os

import numpy as np
import pytest

from feynrl_jax.tracking import NAMESPACES, Tracker, check_metric_name, plot_run, read_metrics
from feynrl_jax.tracking.wandb_sink import wandb_mode


def lines(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_every_log_is_one_flushed_json_line_with_step_and_time(tmp_path):
    run_dir = str(tmp_path / "run")
    tracker = Tracker(run_dir, progress_bar=False)
    tracker.log(1, {"loss/total": np.float32(0.5), "train/lr": 1e-3, "perf/tokens": np.int64(128)})
    # Flushed per step: readable while the tracker is still open.
    first = lines(run_dir)
    assert len(first) == 1 and first[0]["step"] == 1 and abs(first[0]["time"] - __import__("time").time()) < 60
    assert first[0]["loss/total"] == 0.5 and first[0]["perf/tokens"] == 128
    tracker.log(2, {"loss/total": float("nan"), "rollout/reward_mean": 1.0})
    tracker.close()
    second = lines(run_dir)[1]
    assert second["loss/total"] is None and second["rollout/reward_mean"] == 1.0
    # A resumed run appends to the same file.
    with Tracker(run_dir, progress_bar=False, initial_step=2) as resumed:
        resumed.log(3, {"loss/total": 0.25})
    assert [r["step"] for r in lines(run_dir)] == [1, 2, 3]


def test_names_outside_the_namespaces_are_rejected_before_writing(tmp_path):
    run_dir = str(tmp_path / "run")
    with Tracker(run_dir, progress_bar=False) as tracker:
        with pytest.raises(ValueError, match="'reward'.*namespaces"):
            tracker.log(1, {"loss/total": 1.0, "reward": 2.0})
        with pytest.raises(ValueError, match="namespaces"):
            tracker.log(1, {"loss/": 1.0})
        with pytest.raises(TypeError, match="'train/vector'"):
            tracker.log(1, {"train/vector": np.ones(3)})
    assert lines(run_dir) == []
    assert NAMESPACES == ("loss/", "train/", "rollout/", "eval/", "perf/")
    assert check_metric_name("eval/pass@4") == "eval/pass@4"


def test_progress_bar_shows_step_eta_and_main_metrics(tmp_path):
    stream = io.StringIO()
    with Tracker(str(tmp_path), total_steps=10, progress_stream=stream) as tracker:
        for step in range(1, 4):
            tracker.log(step, {"loss/total": 1.0 / step, "rollout/reward_mean": 0.1 * step, "perf/tokens_per_sec": 5.0})
    text = stream.getvalue()
    assert "3/10" in text and "loss/total=0.3333" in text and "rollout/reward_mean=0.3" in text
    assert "<" in text  # tqdm's elapsed<remaining (the ETA)


def test_wandb_runs_offline_without_an_api_key(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert wandb_mode() == "offline"
    run_dir = str(tmp_path / "run")
    tracker = Tracker(run_dir, use_wandb=True, wandb_project="feynrl-test", wandb_name="t", progress_bar=False)
    assert not os.path.exists(os.path.join(run_dir, "wandb"))  # started lazily, on the first log
    tracker.log(1, {"loss/total": 1.0})
    tracker.log(2, {"loss/total": 0.5})
    tracker.close()
    runs = [d for d in os.listdir(os.path.join(run_dir, "wandb")) if d.startswith("offline-run-")]
    run_id = open(os.path.join(run_dir, "wandb_id.txt")).read().strip()
    assert len(runs) == 1 and runs[0].endswith(run_id)
    assert os.path.isfile(os.path.join(run_dir, "wandb", runs[0], f"run-{run_id}.wandb"))
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert wandb_mode() == "online"


def test_read_metrics_keeps_the_last_line_of_a_step_and_skips_malformed_lines_with_a_warning(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        '{"step": 1, "time": 0, "loss/total": 3}\n{"step": 2, "time": 1, "loss/total": 2}\n'
        '{"step": 2, "time": 2, "loss/total": 1.5}\n{"step": 3, "ti'
    )
    with caplog.at_level(logging.WARNING, logger="feynrl_jax.tracking.metrics_file"):
        records = read_metrics(str(tmp_path))
    assert [(r["step"], r["loss/total"]) for r in records] == [(1, 3), (2, 1.5)]
    assert "line 4 (the last, cut short by a crash?)" in caplog.text and str(path) in caplog.text
    caplog.clear()
    # A damaged line in the middle (e.g. a cut line that a later run appended to) is skipped too, naming it.
    path.write_text('{"step": 1, "time": 0}\n{"step": 2, "ti{"step": 2, "time": 5}\n[1, 2]\n{"step": 3, "time": 0}\n')
    with caplog.at_level(logging.WARNING, logger="feynrl_jax.tracking.metrics_file"):
        assert [r["step"] for r in read_metrics(str(tmp_path))] == [1, 3]
    assert (
        "line 2:" in caplog.text
        and 'line 3: skipping a malformed metrics record (not a JSON object with an integer "step")' in caplog.text
    )
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        read_metrics(str(tmp_path / "elsewhere"))


def _crashed_run(run_dir, last_step, cut='{"step": 6, "time": 9, "loss/to'):
    """A metrics file as a run leaves it when it is killed while writing the line after `last_step`."""
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps({"step": s, "time": s, "loss/total": 1.0 / s}) + "\n" for s in range(1, last_step + 1))
        f.write(cut)


def test_a_resumed_tracker_drops_the_cut_line_and_the_steps_it_will_log_again(tmp_path, caplog):
    run_dir = str(tmp_path / "run")
    _crashed_run(run_dir, 5)
    with caplog.at_level(logging.WARNING, logger="feynrl_jax.tracking.metrics_file"):
        with Tracker(run_dir, initial_step=3, progress_bar=False) as tracker:  # resumed from checkpoint step 3
            for step in (4, 5, 6):
                tracker.log(step, {"loss/total": 10.0 * step})
    assert "a partial last line" in caplog.text and "2 line(s) of steps after 3" in caplog.text
    records = lines(run_dir)  # every line parses: the file stayed valid JSONL
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert [r["loss/total"] for r in records[3:]] == [40.0, 50.0, 60.0]
    assert not os.path.exists(os.path.join(run_dir, "metrics.jsonl.tmp"))
    # A fresh loop (initial step 0) drops what a run that never checkpointed had logged, but keeps step 0.
    _crashed_run(run_dir, 3, cut="")
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": 0, "time": 0, "eval/accuracy": 0.5}) + "\n")
    with Tracker(run_dir, initial_step=0, progress_bar=False) as tracker:
        tracker.log(1, {"loss/total": 7.0})
    assert [(r["step"], r.get("loss/total")) for r in lines(run_dir)] == [(0, None), (1, 7.0)]


def test_a_tracker_outside_a_loop_keeps_whole_lines_and_still_drops_a_cut_one(tmp_path, caplog):
    run_dir = str(tmp_path / "run")
    _crashed_run(run_dir, 5)
    with Tracker(run_dir, progress_bar=False) as tracker:
        tracker.log(9, {"eval/accuracy": 0.25})
    assert [r["step"] for r in lines(run_dir)] == [1, 2, 3, 4, 5, 9]
    # A whole last record without its newline (written by hand) is kept, and the next line starts afresh.
    _crashed_run(run_dir, 2, cut='{"step": 3, "time": 3}')
    with Tracker(run_dir, progress_bar=False) as tracker:
        tracker.log(4, {"loss/total": 1.0})
    assert [r["step"] for r in lines(run_dir)] == [1, 2, 3, 4]


def test_each_line_is_one_unbuffered_write(tmp_path, monkeypatch):
    from feynrl_jax.tracking import metrics_file

    calls = []
    real_write = os.write

    def spy(fd, data):
        calls.append(bytes(data))
        return real_write(fd, data)

    monkeypatch.setattr(metrics_file.os, "write", spy)
    run_dir = str(tmp_path / "run")
    with Tracker(run_dir, progress_bar=False) as tracker:
        tracker.log(1, {f"train/m{i}": float(i) for i in range(2000)})  # a line far longer than a buffer
        assert len(calls) == 1 and calls[0].endswith(b"\n") and calls[0].count(b"\n") == 1
        assert lines(run_dir)[0]["train/m1999"] == 1999.0  # on disk at once, nothing held in a buffer
        tracker.log(2, {"loss/total": 0.5})
    assert len(calls) == 2


def test_plot_run_survives_a_line_cut_by_a_crash_and_a_resume_after_it(tmp_path):
    run_dir = str(tmp_path / "run")
    _crashed_run(run_dir, 5)
    assert [os.path.basename(p) for p in plot_run(run_dir)] == ["loss.png"]  # the `feynrl-jax plot` of a crash
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:  # an old-style resume appended to the cut line
        f.write(json.dumps({"step": 6, "time": 6, "loss/total": 0.1}) + "\n")
    assert [os.path.basename(p) for p in plot_run(run_dir)] == ["loss.png"]  # the end-of-run plot


def test_plot_run_writes_pngs_for_the_metrics_that_exist(tmp_path):
    import matplotlib.image

    run_dir = str(tmp_path / "run")
    with Tracker(run_dir, progress_bar=False) as tracker:
        for step in range(1, 31):
            tracker.log(
                step,
                {
                    "loss/total": math.exp(-step / 10),
                    "rollout/reward_mean": step / 30,
                    "rollout/kl_behavior": 0.01 * step,
                    "rollout/response_length": 20 + step,
                    "perf/tokens_per_sec": 1000 + 10 * step,
                },
            )
    paths = plot_run(run_dir)
    names = [os.path.basename(p) for p in paths]
    assert names == ["loss.png", "reward.png", "kl.png", "lengths.png", "throughput.png"]  # no entropy logged
    for path in paths:
        assert os.path.dirname(path) == os.path.join(run_dir, "plots")
        with open(path, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        image = matplotlib.image.imread(path)
        assert image.shape[0] > 200 and image.shape[1] > 400
        assert image[..., :3].std() > 0.01  # not a blank canvas
