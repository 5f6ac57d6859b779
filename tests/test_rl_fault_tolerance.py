"""Fault tolerance: a rollout worker process killed (SIGKILL) or frozen (SIGSTOP) in the middle of a generation is
restarted, the step's generation is retried, the run finishes, and each lost batch is reported in the metrics.
Liveness: a call to a stopped actor ends within `ray.stall_timeout_s` instead of hanging. Exposure: a local
run's Ray listens on the loopback interface only."""

import os
import signal
import socket
import sys
import threading
import time

import pytest

from feynrl_jax.tracking import read_metrics

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "configs"))
import tiny_rl  # noqa: E402

# Its stall timeouts are 1-10 s and it counts the stalls it saw: `make test` runs it in the serial pass, alone.
pytestmark = pytest.mark.serial


def fault_worker_mid_generation(name: str, faults: list, stop: threading.Event) -> None:
    """Sends each `(signal, min_generate_calls)` of `faults`, in order, to the worker's process while a generation
    runs (once it has started that many), waits for Ray to restart it in a new process, and records
    `(signal, faulted pid, new pid, seconds until the new process answered)` in place of the fault."""
    import ray

    handle = None
    while not stop.is_set() and handle is None:
        try:
            handle = ray.get_actor(name)
        except ValueError:
            time.sleep(0.1)
    done = 0
    faulted_pid, faulted_at = None, 0.0
    while not stop.is_set() and done < len(faults):
        try:
            status = ray.get(handle.status.remote(), timeout=1)
        except Exception:  # restarting, or stopped
            time.sleep(0.05)
            continue
        sig, min_calls = faults[done]
        if faulted_pid is not None:
            if status["pid"] != faulted_pid:
                faults[done] = (sig, faulted_pid, status["pid"], time.monotonic() - faulted_at)
                faulted_pid, done = None, done + 1
        elif status["generating"] and status["generate_calls"] >= min_calls:
            os.kill(status["pid"], sig)
            faulted_pid, faulted_at = status["pid"], time.monotonic()
        time.sleep(0.005)


@pytest.mark.slow
@pytest.mark.ray
def test_killed_or_stopped_rollout_worker_is_restarted_and_the_step_is_retried(ray_session, tmp_path):
    import ray

    from feynrl_jax.orchestration import rl_loop
    from feynrl_jax.orchestration.actors import worker_name

    config = tiny_rl.get_config("grpo")
    config.run_dir = str(tmp_path / "run")
    config.eval.during_training = False
    config.train.steps = 5
    config.checkpoint.every_steps = 0
    config.rollout.max_new_tokens = 32
    config.data.max_prompt_len = 96
    config.rollout.decode_steps_per_dispatch = 1  # many host round trips: a long window to be faulted in
    config.ray.stall_timeout_s = 10.0

    # A SIGKILLed worker dies (Ray sees it at once); a SIGSTOPped one is alive but silent: only the liveness
    # pings find it, and the driver kills it so that Ray restarts it.
    faults = [(signal.SIGKILL, 2), (signal.SIGSTOP, 4)]
    stop = threading.Event()
    faulter = threading.Thread(
        target=fault_worker_mid_generation, args=(worker_name(config.run_dir, 0), faults, stop), daemon=True
    )
    faulter.start()
    try:
        last = rl_loop.run(config)
    finally:
        stop.set()
        faulter.join(timeout=10)
    assert all(len(f) == 4 for f in faults), f"a fault was never delivered or recovered from: {faults}"
    records = read_metrics(config.run_dir)
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5]  # the run finished
    lost = [r["rollout/lost_batches_this_step"] for r in records]
    assert sum(lost) == 2 and lost[0] == 0  # exactly the two faulted generations were lost
    assert last["rollout/lost_batches"] == 2
    for step_of_loss in (i for i, n in enumerate(lost) if n):
        # The retried generation trained normally: full batch, one more policy version.
        assert records[step_of_loss]["rollout/generated_tokens"] > 0
        assert records[step_of_loss]["train/policy_version"] == step_of_loss + 1
    assert last["train/policy_version"] == 5
    for _, old_pid, new_pid, _ in faults:  # each fault was served by a new process
        assert new_pid != old_pid
    # The stopped worker was found within the stall timeout (plus a restart), not after minutes.
    assert faults[1][3] < config.ray.stall_timeout_s + 60
    with pytest.raises(ValueError):
        ray.get_actor(worker_name(config.run_dir, 0))  # the run's actors are gone after it ends


@pytest.mark.ray
def test_a_call_to_a_stopped_actor_raises_within_the_stall_timeout(ray_session):
    import ray

    from feynrl_jax.orchestration.liveness import (
        CONCURRENCY_GROUPS,
        LIVENESS_GROUP,
        ActorStalled,
        get_alive,
        restart,
        wait_until_alive,
    )

    @ray.remote(concurrency_groups=CONCURRENCY_GROUPS, max_restarts=1)
    class Sleeper:
        @ray.method(concurrency_group=LIVENESS_GROUP)
        def ping(self):
            return os.getpid()

        def ready(self):
            return os.getpid()

        def work(self, seconds):
            time.sleep(seconds)
            return os.getpid()

    actor = Sleeper.remote()
    pid = ray.get(actor.ping.remote())
    # A call longer than the stall timeout is fine while the actor answers its pings.
    assert get_alive(actor.work.remote(2.5), actor, name="sleeper", stall_timeout_s=1.0) == pid
    ref = actor.work.remote(30)
    time.sleep(0.2)
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    with pytest.raises(ActorStalled, match="sleeper stopped responding.*ray.stall_timeout_s"):
        get_alive(ref, actor, name="sleeper", stall_timeout_s=1.0)
    assert time.monotonic() - t0 < 10
    restart(actor, name="sleeper")
    wait_until_alive(actor, name="sleeper", timeout_s=60)
    assert ray.get(actor.work.remote(0)) != pid  # a new process serves the actor
    ray.kill(actor, no_restart=True)


def _listening(proc) -> list[tuple[str, int]]:
    import psutil

    try:
        conns = proc.net_connections(kind="inet")
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return []
    return [
        (c.laddr.ip, c.laddr.port)
        for c in conns
        if c.status == psutil.CONN_LISTEN or (c.type == socket.SOCK_DGRAM and not c.raddr)
    ]


@pytest.mark.ray
def test_a_local_ray_instance_listens_on_loopback_only(ray_session):
    import ipaddress

    import psutil
    import ray

    @ray.remote
    class Echo:
        def pid(self):
            return os.getpid()

    actor = Echo.remote()
    actor_pid = ray.get(actor.pid.remote())
    me = psutil.Process()
    processes = [me, *me.children(recursive=True)]
    assert actor_pid in {p.pid for p in processes}
    names = {p.pid: p.name() for p in processes}
    bound = [(names[p.pid], addr) for p in processes for addr in _listening(p)]
    assert any(name.startswith(("gcs_server", "raylet")) for name, _ in bound), bound  # the check sees Ray's servers
    exposed = [
        (name, addr) for name, addr in bound if not ipaddress.ip_address(addr[0].removeprefix("::ffff:")).is_loopback
    ]
    assert not exposed, f"listening on a non-loopback address: {exposed}"
    ray.kill(actor)
