"""What JAX compiled, by thread: a `jax.monitoring` listener on the backend-compile event.

The event fires for every program handed to the backend, a persistent-cache hit included (then with the time of
loading it). A rollout worker reports its compiles per generation (`perf/rollout_compile_seconds`), and tests
check that a warmed-up engine compiles nothing more.
"""

from __future__ import annotations

import threading
from typing import Any

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
"""JAX's monitoring event of a backend compile (`jax._src.dispatch.BACKEND_COMPILE_EVENT`); its `fun_name` keyword
names the program ("jit(step)")."""


class CompileClock:
    """Seconds and program names of the backend compiles, kept per thread (the thread that compiled)."""

    def __init__(self):
        self.local = threading.local()

    def __call__(self, event: str, seconds: float, **kwargs: Any) -> None:
        if event == COMPILE_EVENT:
            if not hasattr(self.local, "names"):
                self.local.seconds, self.local.names = 0.0, []
            self.local.seconds += seconds
            self.local.names.append(str(kwargs.get("fun_name")))

    def seconds(self) -> float:
        """This thread's compile seconds so far."""
        return getattr(self.local, "seconds", 0.0)

    def names(self) -> list[str]:
        """The programs this thread compiled so far, in order."""
        return list(getattr(self.local, "names", []))


_CLOCKS: list[CompileClock] = []
_LOCK = threading.Lock()


def compile_clock() -> CompileClock:
    """The process's `CompileClock`, registered with `jax.monitoring` at the first call."""
    with _LOCK:
        if not _CLOCKS:
            import jax

            _CLOCKS.append(CompileClock())
            jax.monitoring.register_event_duration_secs_listener(_CLOCKS[0])
        return _CLOCKS[0]
