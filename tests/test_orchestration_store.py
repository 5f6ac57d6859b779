"""The parameter store as a Ray actor: leaves are object references put by the writer; a reader always fetches one
complete, checksum-verified version while new versions are published, and the store never holds more than two.
Also in this Ray session: the OpenMP threads of an actor (`runtime.openmp_threads_from_cores`)."""

import threading

import numpy as np
import pytest


@pytest.fixture(scope="module")
def ray_session():
    import ray

    from feynrl_jax.config.base import base_config
    from feynrl_jax.orchestration.runtime import start_ray, stop_ray

    config = base_config()
    with config.ray.unlocked():
        config.ray.num_cpus = 2
    assert start_ray(config.ray)
    assert ray.is_initialized()
    yield
    stop_ray()


def params_for(version: int) -> dict:
    return {
        "embed": {"embedding": np.full((64, 32), version, np.float32)},
        "layers": {"q_proj": {"kernel": np.full((2, 32, 4, 8), version + 0.5, np.float32)}},
        "final_norm": {"scale": np.arange(32, dtype=np.float32) + version},
    }


@pytest.mark.ray
def test_readers_fetch_whole_verified_versions_while_the_writer_publishes(ray_session):
    import ray

    from feynrl_jax.orchestration.actors import ParamStoreActor, fetch_params, publish_params
    from feynrl_jax.orchestration.param_store import StoreError

    store = ParamStoreActor.remote()
    assert fetch_params(store) is None
    publish_params(store, params_for(0), 0, timeout_s=60)
    errors, seen = [], []
    stop = threading.Event()

    def reader():
        while not stop.is_set():
            version, params = fetch_params(store)  # raises if the bytes do not match the writer's checksum
            if not (
                np.all(params["embed"]["embedding"] == version)
                and np.all(params["layers"]["q_proj"]["kernel"] == version + 0.5)
                and np.all(params["final_norm"]["scale"] == np.arange(32) + version)
            ):
                errors.append(f"version {version} mixes leaves of several versions")
            if seen and version < seen[-1]:
                errors.append(f"went back from {seen[-1]} to {version}")
            seen.append(version)

    thread = threading.Thread(target=reader)
    thread.start()
    held = []
    for version in range(1, 12):
        publish_params(store, params_for(version), version, timeout_s=60)
        held.append(ray.get(store.versions_held.remote()))
    stop.set()
    thread.join()
    assert not errors, errors[:3]
    assert seen and seen[-1] <= 11 and len(set(seen)) > 1
    assert max(held) <= 2
    assert ray.get(store.version.remote()) == 11
    with pytest.raises(StoreError, match="not newer"):
        ray.get(store.begin.remote(11))


@pytest.mark.ray
def test_a_corrupted_version_is_refused_by_the_reader(ray_session):
    import ray

    from feynrl_jax.orchestration.actors import ParamStoreActor, fetch_params
    from feynrl_jax.orchestration.param_store import StoreError, checksum_leaves, flatten_params

    store = ParamStoreActor.remote()
    leaves = flatten_params(params_for(3))
    ray.get(store.begin.remote(0))
    ray.get(store.write.remote(0, {name: [ray.put(leaf)] for name, leaf in leaves.items()}))
    ray.get(store.publish.remote(0, checksum_leaves(leaves) + 1))
    with pytest.raises(StoreError, match="checksum"):
        fetch_params(store)
    version, params = fetch_params(store, verify=False)
    assert version == 0 and params["embed"]["embedding"][0, 0] == 3


@pytest.mark.ray
def test_actors_give_openmp_their_cores_not_rays_one_thread(ray_session, monkeypatch):
    """Ray sets OMP_NUM_THREADS=1 in an actor of fractional CPUs where the driver's environment leaves it unset;
    `openmp_threads_from_cores` gives oneDNN's OpenMP the cores the actor may run on, or the driver's value."""
    import os

    import ray

    from feynrl_jax.orchestration import runtime

    assert os.environ[runtime.DRIVER_OMP_THREADS] == os.environ.get("OMP_NUM_THREADS", "")

    @ray.remote(num_cpus=0.25)
    class Probe:
        def threads(self, driver: str | None) -> tuple[str, int, int]:
            before = os.environ.get("OMP_NUM_THREADS", "")
            if driver is not None:
                os.environ[runtime.DRIVER_OMP_THREADS] = driver
            return before, runtime.openmp_threads_from_cores(), len(os.sched_getaffinity(0))

    probe = Probe.remote()
    try:
        before, threads, cores = ray.get(probe.threads.remote(None))
        if "OMP_NUM_THREADS" not in os.environ:  # the driver left it unset: Ray's 1 becomes the actor's cores
            assert before == "1" and threads == cores
        assert ray.get(probe.threads.remote("3"))[1] == 3  # a driver's value is kept
    finally:
        ray.kill(probe)
    cores = len(os.sched_getaffinity(0))
    for driver, current, expected in [("", "1", cores), (None, "1", cores), (None, "3", 3), ("2,1", "1", 2)]:
        if driver is None:
            monkeypatch.delenv(
                runtime.DRIVER_OMP_THREADS, raising=False
            )  # Ray started by someone else: only Ray's 1 is replaced
        else:
            monkeypatch.setenv(runtime.DRIVER_OMP_THREADS, driver)
        monkeypatch.setenv("OMP_NUM_THREADS", current)  # restored after the test
        assert runtime.openmp_threads_from_cores() == expected, (driver, current)
