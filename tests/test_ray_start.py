"""`runtime.start_ray` on a local instance whose first start times out: Ray gives a new raylet a fixed 30 s to
register with the GCS and then raises (`ray/_private/node.py`), which an overloaded CI machine hit once. The start is
tried again after the timed-out attempt's processes are stopped; any other error is raised at once."""

from __future__ import annotations

import logging
import time

import psutil
import pytest
import ray
from ml_collections import ConfigDict

from feynrl_jax.orchestration import runtime


def local_ray_config() -> ConfigDict:
    return ConfigDict({"address": "", "num_cpus": 2, "log_to_driver": False})


class SkewedClock:
    """`time` as `ray._private.node` sees it, with `monotonic` moved on by `skew[0]` seconds."""

    def __init__(self, skew: list[float]):
        self.skew = skew

    def __getattr__(self, name):
        return getattr(time, name)

    def monotonic(self) -> float:
        return time.monotonic() + self.skew[0]


def alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.ray
def test_a_start_that_times_out_is_stopped_and_started_again(monkeypatch, caplog):
    from ray._private import node, services

    assert not ray.is_initialized()
    earlier = {p.pid for p in psutil.Process().children(recursive=True)}  # this process's own, left alone
    real_get_node = services.get_node
    skew = [0.0]
    first_attempt = {}  # process -> command line: the processes of the attempt made to time out

    def get_node(*args, **kwargs):
        if not first_attempt:  # the first attempt's GCS, raylet and helpers are running: this node never registers
            started = [p for p in psutil.Process().children(recursive=True) if p.pid not in earlier]
            first_attempt.update({p: " ".join(p.cmdline())[:200] for p in started})
            skew[0] += 31.0  # and its 30 s are over at the next look at the clock
            raise RuntimeError("node info not available (forced by the test)")
        return real_get_node(*args, **kwargs)

    monkeypatch.setattr(services, "get_node", get_node)
    monkeypatch.setattr(node, "time", SkewedClock(skew))
    caplog.set_level(logging.WARNING, logger=runtime.__name__)
    try:
        assert runtime.start_ray(local_ray_config())
        assert ray.is_initialized()
        assert ray.get(ray.remote(lambda: 41 + 1).remote()) == 42  # the second attempt's instance runs work
        assert any("/raylet" in command for command in first_attempt.values()), first_attempt  # it had started one
        running = [name for p, name in first_attempt.items() if alive(p)]
        assert not running, f"left running by the timed-out attempt: {running}"
        [warning] = [
            r.getMessage() for r in caplog.records if r.name == runtime.__name__ and r.levelno >= logging.WARNING
        ]
        assert "timed out during start-up" in warning and "attempt 2 of 2" in warning
    finally:
        runtime.stop_ray()


def test_other_start_errors_and_a_last_timeout_are_raised_without_another_attempt(monkeypatch):
    calls = []

    def failing_init(**kwargs):
        calls.append(kwargs)
        raise failure

    monkeypatch.setattr(ray, "init", failing_init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    try:
        failure = ValueError("num_cpus must be positive")
        with pytest.raises(ValueError, match="num_cpus"):
            runtime.start_ray(local_ray_config())
        assert len(calls) == 1
        calls.clear()
        failure = Exception(f"{runtime.START_TIMEOUT_MESSAGE}. This could happen because ...")
        with pytest.raises(Exception, match=runtime.START_TIMEOUT_MESSAGE):
            runtime.start_ray(local_ray_config())
        assert len(calls) == runtime.LOCAL_START_ATTEMPTS == 2
    finally:
        runtime.stop_ray()  # what start_ray wrote to the environment for the actors
