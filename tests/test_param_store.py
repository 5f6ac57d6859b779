"""The double-buffered parameter store: readers only ever see complete versions; at most two are held."""

import threading

import numpy as np
import pytest

from feynrl_jax.orchestration.param_store import (
    DoubleBufferedStore,
    StoreError,
    checksum_leaves,
    flatten_params,
    unflatten_params,
)

NAMES = [f"layers/w{i}" for i in range(6)]


def leaves_for(version: int) -> dict[str, np.ndarray]:
    return {name: np.full((64, 64), version * 10 + i, np.float32) for i, name in enumerate(NAMES)}


def test_reader_never_sees_a_partial_version_while_the_writer_publishes():
    store = DoubleBufferedStore(NAMES)
    store.put(0, leaves_for(0))
    stop = threading.Event()
    errors: list[str] = []
    reads = []

    def reader():
        last = -1
        while not stop.is_set():
            snap = store.latest()
            # Every leaf of one snapshot comes from the same version, and the checksum matches the bytes.
            for i, name in enumerate(NAMES):
                if not np.all(snap.leaves[name] == snap.version * 10 + i):
                    errors.append(f"version {snap.version} leaf {name} mixed")
            if checksum_leaves(snap.leaves) != snap.checksum:
                errors.append(f"version {snap.version} checksum mismatch")
            if snap.version < last:
                errors.append(f"a reader went back in time: {last} -> {snap.version}")
            last = snap.version
            reads.append(snap.version)

    readers = [threading.Thread(target=reader) for _ in range(3)]
    for t in readers:
        t.start()
    for version in range(1, 40):
        store.begin(version)
        for name, leaf in leaves_for(version).items():
            store.write(version, name, leaf)
            # Mid-write, readers still get the previous complete version.
            assert store.version() == version - 1
            assert store.versions_held() == 2
        store.publish(version)
        assert store.versions_held() == 1
    stop.set()
    for t in readers:
        t.join()
    assert not errors, errors[:3]
    assert len(reads) > 0
    assert store.version() == 39


def test_publish_refuses_an_incomplete_version_and_keeps_the_front():
    store = DoubleBufferedStore(NAMES)
    store.put(0, leaves_for(0))
    store.begin(1)
    store.write(1, NAMES[0], leaves_for(1)[NAMES[0]])
    with pytest.raises(StoreError, match="missing leaves"):
        store.publish(1)
    assert store.version() == 0
    assert np.all(store.latest().leaves[NAMES[0]] == 0)


@pytest.mark.parametrize(
    "action, message",
    [
        (lambda s: s.begin(0), "not newer"),
        (lambda s: s.write(5, NAMES[0], np.zeros(1)), "back buffer holds None"),
        (lambda s: (s.begin(1), s.write(1, "layers/unknown", np.zeros(1))), "not a parameter"),
        (lambda s: (s.begin(1), s.publish(2)), "back buffer holds 1"),
    ],
)
def test_protocol_violations_are_named(action, message):
    store = DoubleBufferedStore(NAMES)
    store.put(0, leaves_for(0))
    with pytest.raises(StoreError, match=message):
        action(store)


def test_flatten_round_trip():
    params = {"embed": {"embedding": np.ones((3, 2))}, "layers": {"q": {"kernel": np.zeros((2, 2))}}}
    flat = flatten_params(params)
    assert sorted(flat) == ["embed/embedding", "layers/q/kernel"]
    back = unflatten_params(flat)
    assert back["layers"]["q"]["kernel"] is params["layers"]["q"]["kernel"]
