"""A run folder survives damage and misuse: resume skips damaged or uncommitted checkpoint steps, and two runs
cannot share one run_dir (the lock)."""

import json
import logging
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from feynrl_jax.checkpoints.train_state import (
    COMMIT_MARKER,
    STEP_METADATA,
    UNUSABLE_SUBDIR,
    RunProgress,
    TrainCheckpointer,
    latest_step,
)
from feynrl_jax.errors import InputError
from feynrl_jax.train.run_lock import RunLock

CHECKPOINT_LOG = "feynrl_jax.checkpoints.train_state"
# Reading damaged arrays, orbax leaves a tensorstore callback behind that fires on its closed event loop later.
ORBAX_LEFTOVERS = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


def _state(step):
    w = jax.random.normal(jax.random.key(step), (64, 8))  # incompressible, so every array file holds real data
    return {"w": w, "b": jnp.full((8,), -float(step))}


def _target():
    return {"w": jnp.zeros((64, 8)), "b": jnp.zeros((8,))}


def _progress(step):
    return RunProgress(
        step=step, rng=jax.random.key(step), data_state={"position": step}, policy_version=step, config={"s": 1}
    )


def _save_steps(run_dir, steps, keep=2):
    with TrainCheckpointer(run_dir, save_every=1, keep=keep) as ckpt:
        for step in steps:
            ckpt.save(_state(step), _progress(step))
    return os.path.join(run_dir, "checkpoints")


def _array_files(step_dir):
    return [
        os.path.join(root, name)
        for root, _, names in os.walk(os.path.join(step_dir, "state"))
        if os.path.basename(root) == "d"
        for name in names
    ]


def _truncate_arrays(step_dir):
    for path in _array_files(step_dir):
        os.truncate(path, os.path.getsize(path) // 2)


def _remove_the_array_files(step_dir):
    for path in _array_files(step_dir):
        os.remove(path)


def _remove_an_item_file(step_dir):
    os.remove(os.path.join(step_dir, "progress", "metadata"))


def _garbage_json_item(step_dir):
    with open(os.path.join(step_dir, "data", "metadata"), "w") as f:
        f.write('{"state": {"position": 3')


def _wrong_json_layout(step_dir):
    with open(os.path.join(step_dir, "rng", "metadata"), "w") as f:
        f.write('["not", "a", "key"]')


DAMAGE = {
    "truncated array files": (_truncate_arrays, "Error reading"),
    "removed array files": (_remove_the_array_files, "Error reading"),
    "a removed item file": (_remove_an_item_file, "progress/metadata"),
    "garbage in a JSON item": (_garbage_json_item, "JSONDecodeError"),
    "JSON of the wrong layout": (_wrong_json_layout, "TypeError"),
}


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
@ORBAX_LEFTOVERS
def test_resume_falls_back_past_a_damaged_latest_step_and_keeps_the_fallback(tmp_path, caplog, damage):
    run_dir = str(tmp_path / "run")
    directory = _save_steps(run_dir, [1, 2, 3])
    damage_fn, why = DAMAGE[damage]
    damage_fn(os.path.join(directory, "3"))
    with TrainCheckpointer(run_dir, save_every=1, keep=2) as ckpt:
        assert ckpt.latest_step() == 3  # committed; whether it reads back is known only on restore
        with pytest.raises(InputError, match=r"checkpoint step folder .*checkpoints/3 cannot be read"):
            ckpt.restore(_target(), step=3)  # an explicit step never falls back
        with caplog.at_level(logging.WARNING, logger=CHECKPOINT_LOG):
            state, progress = ckpt.restore(_target())
        assert progress.step == 2 and progress.data_state == {"position": 2}
        np.testing.assert_array_equal(np.asarray(state["w"]), np.asarray(_state(2)["w"]))
        assert f"{directory}/3 cannot be read" in caplog.text and why in caplog.text
        assert f"moved to {directory}/{UNUSABLE_SUBDIR}/3" in caplog.text
        # The run goes on from step 2: step 3 is saved again, and the intact step 2 is still kept (keep=2).
        assert ckpt.all_steps() == [2]
        assert ckpt.save(_state(3), _progress(3))
        ckpt.wait_until_finished()
        assert ckpt.all_steps() == [2, 3]
        assert ckpt.save(_state(4), _progress(4))
    with TrainCheckpointer(run_dir, save_every=1, keep=2) as ckpt:
        assert ckpt.all_steps() == [3, 4]
        _, progress = ckpt.restore(_target())
        assert progress.step == 4
    # The damaged folder was set aside, never deleted, with the reason beside it.
    aside = os.path.join(directory, UNUSABLE_SUBDIR)
    assert sorted(os.listdir(aside)) == ["3", "3.why.txt"]
    assert os.path.isdir(os.path.join(aside, "3", "state"))
    with open(os.path.join(aside, "3.why.txt")) as f:
        assert f.read().startswith("cannot be read: ")


def _uncommit(step_dir, *, keep_metadata_time=False):
    os.remove(os.path.join(step_dir, COMMIT_MARKER))
    path = os.path.join(step_dir, STEP_METADATA)
    with open(path) as f:
        metadata = json.load(f)
    if not keep_metadata_time:
        metadata["commit_timestamp_nsecs"] = None
    with open(path, "w") as f:
        json.dump(metadata, f)


def test_a_step_without_its_commit_marker_is_never_resumed_from(tmp_path, caplog):
    run_dir = str(tmp_path / "run")
    directory = _save_steps(run_dir, [1, 2, 3], keep=3)
    _uncommit(os.path.join(directory, "3"))
    assert latest_step(run_dir) == 2
    with TrainCheckpointer(run_dir, save_every=1, keep=2, read_only=True) as ckpt:  # export: looks, moves nothing
        assert ckpt.all_steps() == [1, 2] and ckpt.latest_step() == 2
        with pytest.raises(InputError, match="checkpoint step 3 has no commit marker"):
            ckpt.restore(_target(), step=3)
    assert os.path.isdir(os.path.join(directory, "3"))
    with caplog.at_level(logging.WARNING, logger=CHECKPOINT_LOG):
        with TrainCheckpointer(run_dir, save_every=1, keep=2) as ckpt:
            assert ckpt.latest_step() == 2
            _, progress = ckpt.restore(_target())
            assert progress.step == 2
            assert ckpt.save(_state(3), _progress(3))  # not blocked by the uncommitted folder of step 3
    assert f"{directory}/3 has no commit marker" in caplog.text
    assert os.path.isdir(os.path.join(directory, UNUSABLE_SUBDIR, "3"))
    assert latest_step(run_dir) == 3


def test_a_step_written_by_an_orbax_without_commit_files_counts_as_committed(tmp_path):
    """orbax < 0.12 (the project allows >= 0.11.30) marks a commit only by the time in the step metadata."""
    run_dir = str(tmp_path / "run")
    directory = _save_steps(run_dir, [1, 2])
    _uncommit(os.path.join(directory, "2"), keep_metadata_time=True)
    assert latest_step(run_dir) == 2
    with TrainCheckpointer(run_dir, save_every=1, keep=2) as ckpt:
        _, progress = ckpt.restore(_target())
    assert progress.step == 2 and not os.path.exists(os.path.join(directory, UNUSABLE_SUBDIR))


@ORBAX_LEFTOVERS
def test_when_no_step_is_usable_the_error_names_the_folder_and_every_step_and_moves_nothing(tmp_path, caplog):
    run_dir = str(tmp_path / "run")
    directory = _save_steps(run_dir, [1, 2])
    _truncate_arrays(os.path.join(directory, "2"))
    _garbage_json_item(os.path.join(directory, "1"))
    with TrainCheckpointer(run_dir, save_every=1, keep=2) as ckpt:
        with pytest.raises(InputError) as error:
            ckpt.restore(_target())
    message = str(error.value)
    assert message.startswith(f"no checkpoint in {directory} can be read: step 2 ({directory}/2): ")
    assert f"step 1 ({directory}/1): JSONDecodeError" in message and "Nothing was moved or deleted" in message
    assert sorted(os.listdir(directory)) == ["1", "2"]


def test_a_changed_model_is_a_mismatch_not_damage(tmp_path):
    run_dir = str(tmp_path / "run")
    directory = _save_steps(run_dir, [1, 2])
    with TrainCheckpointer(run_dir, save_every=1, keep=2) as ckpt:
        with pytest.raises(InputError, match=r"checkpoints/2 does not match the train state.*w has shape \(64, 8\)"):
            ckpt.restore({"w": jnp.zeros((32, 8)), "b": jnp.zeros((8,))})
        with pytest.raises(InputError, match=r"entries missing from the checkpoint: \['extra'\]"):
            ckpt.restore({**_target(), "extra": jnp.zeros(1)})
    assert sorted(os.listdir(directory)) == ["1", "2"]  # nothing set aside: the steps are fine


# -- the run lock ------------------------------------------------------------------------------------------------

_HOLDER = textwrap.dedent(
    """
    import sys, time
    from feynrl_jax.train.run_lock import RunLock

    lock = RunLock(sys.argv[1])
    lock.acquire()
    print("locked", flush=True)
    time.sleep(600)
    """
)


def _start_holder(run_dir):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-c", _HOLDER, str(run_dir)], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "locked"
    return proc


@pytest.mark.multiprocess
def test_a_second_run_on_a_locked_run_dir_fails_until_the_holder_is_killed(tmp_path):
    run_dir = tmp_path / "runs" / "x"
    holder = _start_holder(run_dir)
    try:
        with pytest.raises(InputError) as error:
            RunLock(run_dir).acquire()
        message = str(error.value)
        assert message.startswith(f"run_dir {run_dir} is in use by another run (pid {holder.pid} on host ")
        assert "started 20" in message and message.endswith("; wait for it or choose another run_dir")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert os.path.exists(run_dir / ".lock")  # the file stays; the lock died with its holder
    with RunLock(run_dir) as lock:
        assert lock.held
        with open(run_dir / ".lock") as f:
            assert json.load(f)["pid"] == os.getpid()
    with RunLock(run_dir):  # released on exit, so it can be taken again
        pass


def test_two_locks_in_one_process_conflict_too(tmp_path):
    with RunLock(tmp_path):
        with pytest.raises(InputError, match=f"pid {os.getpid()} on host"):
            RunLock(tmp_path).acquire()


@pytest.mark.multiprocess
@pytest.mark.filterwarnings("ignore:os.fork:RuntimeWarning")  # the child only sleeps; it never touches JAX
def test_a_forked_child_does_not_keep_the_lock_after_its_parent_lets_go(tmp_path):
    lock = RunLock(tmp_path)
    lock.acquire()
    child = os.fork()
    if child == 0:  # e.g. a worker forked by multiprocessing while the run holds its lock
        time.sleep(30)
        os._exit(0)
    try:
        lock.release()
        holder = _start_holder(tmp_path)  # would fail while the child still held the lock
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_the_sft_and_dpo_loops_take_the_lock_before_anything_else(tmp_path):
    from feynrl_jax.config.base import base_config
    from feynrl_jax.train import dpo_loop, sft_loop

    for paradigm, loop in (("sft", sft_loop), ("dpo", dpo_loop)):
        config = base_config()
        config.paradigm = paradigm
        config.run_dir = str(tmp_path / paradigm)
        with RunLock(config.run_dir):
            with pytest.raises(InputError, match=f"run_dir {config.run_dir} is in use by another run"):
                loop.run(config)
        assert sorted(os.listdir(config.run_dir)) == [".lock"]


# -- end to end: an SFT run resumes past a damaged checkpoint and a cut metrics line ---------------------------------


@pytest.mark.slow
@ORBAX_LEFTOVERS
def test_sft_resumes_from_the_previous_intact_step_and_logs_each_step_once(tmp_path, caplog):
    from test_sft_loop import tiny_sft_config

    from feynrl_jax.tracking import read_metrics
    from feynrl_jax.train import sft_loop

    data_dir = _toy_sft_data(tmp_path / "data")
    run_dir = tmp_path / "run"
    config = tiny_sft_config(data_dir, run_dir)
    config.train.steps = 8
    config.checkpoint.every_steps = 4
    config.eval.during_training = False
    sft_loop.run(config)
    straight = {r["step"]: r["train/loss"] for r in read_metrics(str(run_dir))}
    assert sorted(straight) == list(range(1, 9)) and latest_step(run_dir) == 8

    directory = os.path.join(run_dir, "checkpoints")
    _truncate_arrays(os.path.join(directory, "8"))  # the disk lost the end of the last checkpoint
    with open(run_dir / "metrics.jsonl", "a") as f:  # and the run was killed while writing a metrics line
        f.write('{"step": 9, "time": 1.5, "train/lo')
    with caplog.at_level(logging.WARNING):
        sft_loop.run(config)
    assert f"{directory}/8 cannot be read" in caplog.text
    assert "resumed from step 4" in caplog.text
    with open(run_dir / "metrics.jsonl") as f:
        resumed = [json.loads(line) for line in f]  # valid JSONL, one line per step
    assert [r["step"] for r in resumed] == list(range(1, 9))
    for record in resumed:
        assert record["train/loss"] == pytest.approx(straight[record["step"]], rel=1e-5)
    assert latest_step(run_dir) == 8 and os.path.isdir(os.path.join(directory, UNUSABLE_SUBDIR, "8"))


def _toy_sft_data(root):
    from feynrl_jax.data.toy_tokenizer import build_toy_tokenizer

    os.makedirs(root)
    rows = [{"prompt": f"What is {i % 7} plus {i % 5}?", "response": f"#### {i % 7 + i % 5}"} for i in range(40)]
    for name, part in (("train", rows[8:]), ("test", rows[:8])):
        with open(os.path.join(root, f"{name}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
    build_toy_tokenizer([r["prompt"] + " " + r["response"] for r in rows], vocab_size=280).save_pretrained(
        os.path.join(root, "tokenizer")
    )
    return pathlib.Path(root)
