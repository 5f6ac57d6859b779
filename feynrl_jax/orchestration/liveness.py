"""Waiting on an actor without hanging: every blocking call is bounded by a liveness check.

A plain `ray.get` on a call to a stopped actor (a process frozen by SIGSTOP, a wedged native library, a
machine that went to swap) waits forever and says nothing. Timing out the call itself does not work either: a
generation or a train step may honestly take minutes. Instead, while a call runs, `get_alive` pings its actor
every few seconds through a concurrency group of its own (`LIVENESS_GROUP`), so the ping is answered by another
thread while the call keeps working. An actor that has not answered a ping for `ray.stall_timeout_s` seconds is
stalled: `get_alive` raises `ActorStalled`, and the caller restarts the actor and retries (rollout workers, the
reward scorer) or stops the run with one line naming the actor (trainer, parameter store).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray

from feynrl_jax.errors import RunFailed

log = logging.getLogger(__name__)

LIVENESS_GROUP = "liveness"
CONCURRENCY_GROUPS = {LIVENESS_GROUP: 1}
"""`concurrency_groups` of every actor class: one thread that answers `ping` whatever the actor is doing."""

WORKER_FAILURES = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)
"""What a call to an actor raises when its process died or is restarting."""


class ActorStalled(RunFailed):
    """An actor that did not answer a liveness ping within `ray.stall_timeout_s`."""

    def __init__(self, name: str, seconds: float):
        self.name = name
        self.seconds = seconds
        super().__init__(
            f"{name} stopped responding: no answer to a liveness ping for {seconds:.0f} s (ray.stall_timeout_s)"
        )


def get_alive(ref: Any, actor: Any, *, name: str, stall_timeout_s: float) -> Any:
    """`ray.get(ref)` for a call to `actor`, raising `ActorStalled` when the actor stops answering pings.

    Args:
        ref: the object reference of a call to `actor`.
        actor: the actor handle; its class has a `ping` method in `LIVENESS_GROUP`.
        name: the actor's name in messages ("rollout worker 0").
        stall_timeout_s: seconds without an answer to a ping after which the actor counts as stalled.

    Returns:
        The call's result.

    Raises:
        ActorStalled: the actor did not answer a ping for `stall_timeout_s` seconds.
        Whatever the call raised (e.g. `RayActorError` when the actor died).
    """
    interval = min(2.0, stall_timeout_s / 4)
    ping, ping_sent = None, 0.0
    while True:
        ready, _ = ray.wait([ref], timeout=interval)
        if ready:
            return ray.get(ref)
        now = time.monotonic()
        if ping is None:
            ping, ping_sent = actor.ping.remote(), now
            continue
        answered, _ = ray.wait([ping], timeout=0)
        if answered:
            ray.get(ping)  # raises when the actor died meanwhile
            ping = None
        elif now - ping_sent > stall_timeout_s:
            raise ActorStalled(name, now - ping_sent)


def get_within(ref: Any, *, name: str, timeout_s: float) -> Any:
    """`ray.get(ref)` for a short call (store lookups, close): `RunFailed` naming `name` after `timeout_s`."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise ActorStalled(name, timeout_s) from None


def restart(actor: Any, *, name: str) -> None:
    """Kills a stalled actor's process so that Ray restarts it (it counts against `ray.max_restarts`)."""
    log.warning("%s stalled; killing its process so that Ray restarts it", name)
    ray.kill(actor, no_restart=False)


def wait_until_alive(actor: Any, *, name: str, timeout_s: float = 600.0) -> None:
    """Blocks while Ray restarts `actor` until its `ready()` answers (calls to a restarting actor fail at once).

    Raises:
        RunFailed: the actor is dead for good (out of restarts) or not back within `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ray.get(actor.ready.remote(), timeout=max(deadline - time.monotonic(), 0.1))
            return
        except ray.exceptions.ActorUnavailableError:
            if time.monotonic() > deadline:
                raise RunFailed(f"{name} did not come back within {timeout_s:.0f} s of a restart") from None
            time.sleep(0.2)
        except ray.exceptions.GetTimeoutError:
            raise RunFailed(f"{name} did not come back within {timeout_s:.0f} s of a restart") from None
        except ray.exceptions.RayActorError as error:
            raise RunFailed(f"{name} is dead and out of restarts (ray.max_restarts): {error}") from error
