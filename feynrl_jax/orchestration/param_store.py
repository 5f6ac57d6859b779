"""A double-buffered, versioned parameter store.

The trainer publishes a new policy version while rollout workers keep reading the current one:

- `begin(version)` claims the back buffer for a version newer than the front;
- `write(version, name, array)` fills it leaf by leaf (readers are never blocked: they only see the front);
- `publish(version)` checks that every leaf arrived and flips front and back in one step under a lock.

A reader always gets one complete version, never a mix of two; the store holds at most two versions (front and
back), so the memory bound is two copies of the parameters in host memory. Each published version carries a
checksum of its bytes so tests (and the paranoid) can verify what a reader received.

The class is plain Python and thread-safe; `feynrl_jax.orchestration.actors` wraps it in a Ray actor whose
leaves are Ray object references, so the arrays themselves live in Ray's shared-memory object store.
"""

from __future__ import annotations

import dataclasses
import threading
import zlib
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """One complete, published version of the parameters.

    Attributes:
      version: the policy version (monotonically increasing).
      leaves: a mapping from leaf name (e.g. "layers/q_proj/kernel") to its host array (or object reference).
      checksum: adler32 over the leaves' bytes in name order, computed at publish time; 0 when the leaves are
        references rather than arrays.
    """

    version: int
    leaves: Mapping[str, Any]
    checksum: int


def checksum_leaves(leaves: Mapping[str, Any]) -> int:
    """Adler-32 of the leaves' bytes in sorted-name order (names included), or 0 if any leaf is not an array."""
    value = 1
    for name in sorted(leaves):
        leaf = leaves[name]
        if not isinstance(leaf, np.ndarray):
            return 0
        value = zlib.adler32(name.encode(), value)
        value = zlib.adler32(np.ascontiguousarray(leaf).view(np.uint8).reshape(-1), value)
    return value


def flatten_params(params: Any, prefix: str = "") -> dict[str, Any]:
    """Flattens a nested dict of arrays into `{"a/b/c": leaf}`."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten_params(value, name + "/"))
        else:
            out[name] = value
    return out


def unflatten_params(leaves: Mapping[str, Any]) -> dict[str, Any]:
    """Inverse of `flatten_params`."""
    out: dict[str, Any] = {}
    for name, leaf in leaves.items():
        node = out
        *parents, last = name.split("/")
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = leaf
    return out


class StoreError(RuntimeError):
    """A publish protocol violation: wrong version order, missing leaves, unknown leaf."""


class DoubleBufferedStore:
    """Front/back parameter buffers with an atomic flip. Thread-safe.

    Args:
      leaf_names: the names every version must contain; `publish` refuses a version that lacks one. When None,
        the first published version defines them.
    """

    def __init__(self, leaf_names: Iterable[str] | None = None):
        self._lock = threading.Lock()
        self._front: Snapshot | None = None
        self._back: dict[str, Any] = {}
        self._back_version: int | None = None
        self._leaf_names = frozenset(leaf_names) if leaf_names is not None else None

    # Writer side -------------------------------------------------------------------------------------------

    def begin(self, version: int) -> None:
        """Claims the back buffer for `version`, dropping any unpublished partial write."""
        with self._lock:
            front_version = self._front.version if self._front is not None else -1
            if version <= front_version:
                raise StoreError(f"version {version} is not newer than the published version {front_version}")
            self._back = {}
            self._back_version = version

    def write(self, version: int, name: str, leaf: Any) -> None:
        """Writes one leaf of `version` into the back buffer; readers keep seeing the front."""
        with self._lock:
            if self._back_version != version:
                raise StoreError(f"write of version {version} but the back buffer holds {self._back_version}")
            if self._leaf_names is not None and name not in self._leaf_names:
                raise StoreError(f"leaf {name!r} is not a parameter of this model")
            self._back[name] = leaf

    def publish(self, version: int, checksum: int | None = None) -> Snapshot:
        """Flips the completed back buffer to the front in one step and returns the new snapshot.

        Args:
          version: the version being written.
          checksum: the writer's checksum of the leaves, for leaves that are references (a Ray object store);
            computed here from the arrays when None.
        """
        with self._lock:
            if self._back_version != version:
                raise StoreError(f"publish of version {version} but the back buffer holds {self._back_version}")
            expected = self._leaf_names if self._leaf_names is not None else frozenset(self._back)
            missing = sorted(expected - set(self._back))
            if missing:
                raise StoreError(f"version {version} is incomplete; missing leaves: {missing[:5]}")
            leaves = dict(self._back)
        # The checksum reads the arrays outside the lock: nobody else can touch this dict any more.
        if checksum is None:
            checksum = checksum_leaves(leaves)
        snapshot = Snapshot(version=version, leaves=leaves, checksum=checksum)
        with self._lock:
            self._front = snapshot
            self._leaf_names = expected
            self._back = {}
            self._back_version = None
        return snapshot

    def put(self, version: int, leaves: Mapping[str, Any]) -> Snapshot:
        """`begin`, `write` every leaf, `publish`: the whole protocol for one version."""
        self.begin(version)
        for name, leaf in leaves.items():
            self.write(version, name, leaf)
        return self.publish(version)

    # Reader side -------------------------------------------------------------------------------------------

    def latest(self) -> Snapshot | None:
        """The published snapshot (never a partial one), or None before the first publish."""
        with self._lock:
            return self._front

    def version(self) -> int:
        """The published version, or -1 before the first publish."""
        with self._lock:
            return self._front.version if self._front is not None else -1

    def versions_held(self) -> int:
        """How many versions the store references now: the front, plus a back buffer being written."""
        with self._lock:
            return int(self._front is not None) + int(self._back_version is not None)
