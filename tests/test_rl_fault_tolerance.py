"""Fault tolerance: a rollout worker process killed in the middle of a generation is restarted by Ray, the step's
generation is retried, the run finishes, and the lost batch is reported in the metrics."""

import os
import signal
import sys
import threading
import time

import pytest

from feynrl_jax.tracking import read_metrics

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "configs"))
import tiny_rl  # noqa: E402


@pytest.fixture(scope="module")
def ray_session(tmp_path_factory):
    from feynrl_jax.orchestration.runtime import start_ray, stop_ray

    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(tmp_path_factory.mktemp("jax_cache")))
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    assert start_ray(tiny_rl.get_config().ray)
    yield
    stop_ray()


def kill_worker_mid_generation(name: str, killed: list, restarted: list, stop: threading.Event) -> None:
    """Waits for the worker's second generation to be running, SIGKILLs its process once, then records the pid
    of the process Ray restarts it in."""
    import ray

    handle = None
    while not stop.is_set() and handle is None:
        try:
            handle = ray.get_actor(name)
        except ValueError:
            time.sleep(0.1)
    while not stop.is_set():
        try:
            status = ray.get(handle.status.remote(), timeout=5)
        except Exception:  # the actor is restarting
            time.sleep(0.05)
            continue
        if killed:
            if status["pid"] != killed[0]:
                restarted.append(status["pid"])
                return
        elif status["generating"] and status["generate_calls"] >= 2:
            os.kill(status["pid"], signal.SIGKILL)
            killed.append(status["pid"])
        time.sleep(0.005)


@pytest.mark.slow
@pytest.mark.ray
def test_killed_rollout_worker_is_restarted_and_the_step_is_retried(ray_session, tmp_path):
    import ray

    from feynrl_jax.orchestration import rl_loop
    from feynrl_jax.orchestration.actors import worker_name

    config = tiny_rl.get_config("grpo")
    config.run_dir = str(tmp_path / "run")
    config.eval.during_training = False
    config.train.steps = 4
    config.checkpoint.every_steps = 0
    config.rollout.max_new_tokens = 32
    config.data.max_prompt_len = 96
    config.rollout.decode_steps_per_dispatch = 1  # many host round trips: a long window to be killed in

    killed: list[int] = []
    restarted: list[int] = []
    stop = threading.Event()
    killer = threading.Thread(
        target=kill_worker_mid_generation, args=(worker_name(config.run_dir, 0), killed, restarted, stop), daemon=True
    )
    killer.start()
    try:
        last = rl_loop.run(config)
    finally:
        stop.set()
        killer.join(timeout=10)
    assert killed, "the worker was never caught generating"
    records = read_metrics(config.run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4]  # the run finished
    lost = [r["rollout/lost_batches_this_step"] for r in records]
    assert sum(lost) == 1 and lost[0] == 0  # exactly one generation was lost, after the first step
    assert last["rollout/lost_batches"] == 1
    step_of_loss = lost.index(1)
    # The retried generation trained normally: full batch, finite loss, one more policy version.
    assert records[step_of_loss]["rollout/generated_tokens"] > 0
    assert records[step_of_loss]["train/policy_version"] == step_of_loss + 1
    assert last["train/policy_version"] == 4
    # Ray restarted the worker in a new process, which served the retry and the later steps.
    assert restarted and restarted[0] != killed[0]
    with pytest.raises(ValueError):
        ray.get_actor(worker_name(config.run_dir, 0))  # the run's actors are gone after it ends
