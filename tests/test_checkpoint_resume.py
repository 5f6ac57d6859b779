"""Orbax train-state checkpoints: round trip into shardings, retention, intervals, and atomicity under SIGKILL."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from feynrl_jax.checkpoints.train_state import RunProgress, TrainCheckpointer, abstract_like, latest_step


def _mesh():
    return Mesh(np.array(jax.devices()[:8]).reshape(4, 2), ("data", "fsdp"))


def _state(mesh, scale=1.0):
    w = jax.device_put(
        jnp.arange(64.0, dtype=jnp.float32).reshape(8, 8) * scale, NamedSharding(mesh, P("data", "fsdp"))
    )
    b = jax.device_put(jnp.full((8,), scale, jnp.bfloat16), NamedSharding(mesh, P(None)))
    return {"params": {"w": w, "b": b}, "count": jnp.asarray(int(scale), jnp.int32)}


def _progress(step, **kw):
    fields = dict(
        step=step,
        rng=jax.random.key(100 + step),
        data_state={"epoch": 1, "position": step, "raw": b"\x00\xfe"},
        policy_version=step,
        config={"train": {"steps": 10}, "shape": (2, 3)},
    )
    fields.update(kw)
    return RunProgress(**fields)


def test_round_trip_restores_values_shardings_rng_and_progress(tmp_path):
    mesh = _mesh()
    state = _state(mesh, 3.0)
    with TrainCheckpointer(tmp_path, save_every=1, keep=3) as ckpt:
        assert ckpt.save(state, _progress(5))
    assert latest_step(tmp_path) == 5
    target = abstract_like(_state(mesh, 0.0))
    with TrainCheckpointer(tmp_path, save_every=1, keep=3) as ckpt:
        restored, progress = ckpt.restore(target)
        assert ckpt.restore_config() == {"train": {"steps": 10}, "shape": [2, 3]}
    for path in (("params", "w"), ("params", "b")):
        got, want = restored[path[0]][path[1]], state[path[0]][path[1]]
        assert got.dtype == want.dtype
        assert got.sharding == want.sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert int(restored["count"]) == 3
    assert progress.step == 5 and progress.policy_version == 5
    assert progress.data_state == {"epoch": 1, "position": 5, "raw": b"\x00\xfe"}
    np.testing.assert_array_equal(jax.random.key_data(progress.rng), jax.random.key_data(jax.random.key(105)))
    # The restored key continues the same random stream.
    np.testing.assert_array_equal(jax.random.normal(progress.rng, (4,)), jax.random.normal(jax.random.key(105), (4,)))


def test_one_process_saves_replicated_arrays_without_compiling_and_reads_them_back(tmp_path):
    """In one process orbax writes a replicated array from its first replica whole: splitting it among the 8 local
    replicas (its default, for jobs of several hosts) compiled a slice program per leaf and replica on first use,
    about 5 s at a tiny run's first save. A leaf shape never saved in this session is used, so a slice compiled
    by an earlier test cannot hide one here."""
    from feynrl_jax.compile_clock import compile_clock

    mesh = _mesh()
    replicated = NamedSharding(mesh, P())
    state = {
        "embed": jax.device_put(jnp.arange(24 * 16.0, dtype=jnp.float32).reshape(24, 16), replicated),
        "norm": jax.device_put(jnp.linspace(0.0, 1.0, 40, dtype=jnp.float32), replicated),
        "w": _state(mesh, 2.0)["params"]["w"],
    }
    progress, clock = _progress(1), compile_clock()
    with TrainCheckpointer(tmp_path, save_every=1, keep=1) as ckpt:
        before = list(clock.names())
        assert ckpt.save(state, progress)
        compiled = clock.names()[len(before) :]
    assert not compiled, compiled
    with TrainCheckpointer(tmp_path, save_every=1, keep=1) as ckpt:
        restored, _ = ckpt.restore(abstract_like(state))
    for name, leaf in state.items():
        assert restored[name].sharding == leaf.sharding, name
        np.testing.assert_array_equal(np.asarray(restored[name]), np.asarray(leaf), err_msg=name)


def test_raw_uint32_rng_round_trips(tmp_path):
    raw = jax.random.PRNGKey(7)
    with TrainCheckpointer(tmp_path, save_every=1, keep=1) as ckpt:
        ckpt.save({"x": jnp.ones(3)}, _progress(1, rng=raw))
        _, progress = ckpt.restore({"x": jnp.zeros(3)})
    assert progress.rng.dtype == jnp.uint32
    np.testing.assert_array_equal(np.asarray(progress.rng), np.asarray(raw))


def test_interval_force_and_keep_last_k(tmp_path):
    with TrainCheckpointer(tmp_path, save_every=3, keep=2) as ckpt:
        started = [ckpt.save({"x": jnp.full(4, float(s))}, _progress(s)) for s in range(1, 11)]
        assert ckpt.save({"x": jnp.full(4, 10.0)}, _progress(10), force=True)
        assert not ckpt.save({"x": jnp.full(4, 10.0)}, _progress(10), force=True), "a step is saved once"
    assert started == [s % 3 == 0 for s in range(1, 11)]
    with TrainCheckpointer(tmp_path, save_every=3, keep=2) as ckpt:
        assert ckpt.all_steps() == [9, 10]
        state, progress = ckpt.restore({"x": jnp.zeros(4)}, step=9)
        np.testing.assert_array_equal(np.asarray(state["x"]), np.full(4, 9.0))
        assert progress.step == 9
        with pytest.raises(FileNotFoundError, match="step 3 not found"):
            ckpt.restore({"x": jnp.zeros(4)}, step=3)
    assert sorted(os.listdir(os.path.join(tmp_path, "checkpoints"))) == ["10", "9"]


def test_donating_the_state_right_after_an_async_save_keeps_the_saved_values(tmp_path):
    step_fn = jax.jit(lambda s: {"x": s["x"] * 2.0}, donate_argnums=0)
    state = {"x": jnp.ones((256, 256))}
    with TrainCheckpointer(tmp_path, save_every=1, keep=5, async_save=True) as ckpt:
        for step in range(1, 4):
            state = step_fn(state)
            ckpt.save(state, _progress(step))
    with TrainCheckpointer(tmp_path, save_every=1, keep=5) as ckpt:
        for step in range(1, 4):
            restored, _ = ckpt.restore({"x": jnp.zeros((256, 256))}, step=step)
            np.testing.assert_array_equal(np.asarray(restored["x"]), np.full((256, 256), 2.0**step))


def test_missing_and_mismatched_checkpoints_raise_clear_errors(tmp_path):
    with TrainCheckpointer(tmp_path, save_every=1, keep=1) as ckpt:
        assert ckpt.latest_step() is None
        with pytest.raises(FileNotFoundError, match="no committed checkpoint"):
            ckpt.restore({"x": jnp.zeros(3)})
        ckpt.save({"x": jnp.ones(3)}, _progress(1))
    with TrainCheckpointer(tmp_path, save_every=1, keep=1) as ckpt:
        with pytest.raises(ValueError, match="does not match the train state"):
            ckpt.restore({"x": jnp.zeros(5)})
    with pytest.raises(ValueError, match="save_every"):
        TrainCheckpointer(tmp_path, save_every=0, keep=1)


_SAVER = textwrap.dedent(
    """
    import sys
    import jax, jax.numpy as jnp
    from feynrl_jax.checkpoints.train_state import RunProgress, TrainCheckpointer

    ckpt = TrainCheckpointer(sys.argv[1], save_every=1, keep=2, async_save=True)
    step = 0
    while True:
        step += 1
        # ~32 MB per step so a save is in flight for a while; values are a function of the step.
        state = {"a": jnp.full((2048, 2048), float(step)), "b": jnp.full((1024, 2048), float(-step))}
        ckpt.save(state, RunProgress(step=step, rng=jax.random.key(step), data_state={"position": step},
                                     policy_version=step, config={}))
        print("saving", step, flush=True)
    """
)


def _tmp_dirs(directory):
    return [n for n in os.listdir(directory) if ".orbax-checkpoint-tmp" in n] if os.path.isdir(directory) else []


@pytest.mark.multiprocess
@pytest.mark.serial  # polls for a save in flight every 0.5 ms, then kills: nothing beside it may slow the poller
def test_sigkill_mid_save_never_leaves_a_loadable_partial_checkpoint(tmp_path):
    """Kills the saver while a step's temporary folder exists (a save in flight), at three different steps."""
    target = {"a": jnp.zeros((2048, 2048)), "b": jnp.zeros((1024, 2048))}
    for kill_after in (1, 2, 4):
        run_dir = os.path.join(tmp_path, f"kill_after_{kill_after}")
        directory = os.path.join(run_dir, "checkpoints")
        proc = subprocess.Popen([sys.executable, "-c", _SAVER, run_dir], stdout=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 120
            while True:
                assert time.monotonic() < deadline, "the saver never had a save in flight"
                assert proc.poll() is None, "the saver died on its own"
                committed = [n for n in os.listdir(directory) if n.isdigit()] if os.path.isdir(directory) else []
                in_flight = _tmp_dirs(directory)
                if len(committed) >= min(kill_after, 2) and max(map(int, committed)) >= kill_after and in_flight:
                    proc.send_signal(signal.SIGKILL)
                    break
                time.sleep(0.0005)
        finally:
            proc.kill()
            proc.wait()
        unfinished = {int(n.split(".")[0]) for n in _tmp_dirs(directory)}
        assert unfinished, "the kill landed while a save was in flight, so its temporary folder remains"
        committed = latest_step(run_dir)
        assert committed is not None and committed not in unfinished
        with TrainCheckpointer(run_dir, save_every=1, keep=2) as ckpt:
            assert _tmp_dirs(directory) == [], "a new manager removes unfinished saves"
            assert ckpt.latest_step() == committed
            steps = ckpt.all_steps()
            assert not set(steps) & unfinished
            for step in steps:  # every step folder that remains is complete and restorable
                state, progress = ckpt.restore(target, step=step)
                assert progress.step == step and progress.data_state == {"position": step}
                np.testing.assert_array_equal(np.asarray(state["a"]), np.full((2048, 2048), float(step)))
                np.testing.assert_array_equal(np.asarray(state["b"]), np.full((1024, 2048), float(-step)))
