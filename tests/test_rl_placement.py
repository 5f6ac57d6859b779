"""Ray placement of the RL actors: the GPUs the config names, on a local Ray instance that declares 4 GPUs.

Ray schedules by declared resources, so GPU placement is tested on a CPU machine: `ray.init(num_gpus=4)` makes 4
GPU slots, and Ray gives each actor the ids of the slots it holds (`ray.get_gpu_ids()`). JAX stays on the CPU
(`JAX_PLATFORMS=cpu`), whatever `CUDA_VISIBLE_DEVICES` Ray sets.
"""

import os
import sys
import time

import pytest
import ray

from feynrl_jax.errors import InputError
from feynrl_jax.orchestration.actors import RolloutWorker
from feynrl_jax.orchestration.engines import EngineSpec
from feynrl_jax.orchestration.placement import WorkerPlacement, check_gpus, trainer_options
from feynrl_jax.orchestration.runtime import ACTOR_CPUS

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, os.path.join(ROOT, "configs"))
import tiny_rl  # noqa: E402

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def four_gpus():
    from feynrl_jax.orchestration.runtime import listen_on_loopback_only

    listen_on_loopback_only()
    ray.init(num_cpus=2, num_gpus=4, include_dashboard=False, configure_logging=False)
    yield
    ray.shutdown()


def config_with(gpus_per_worker=0, trainer_gpus=0, workers=2):
    config = tiny_rl.get_config()
    config.rollout.num_workers = workers
    config.ray.gpus_per_rollout_worker = gpus_per_worker
    config.ray.trainer_gpus = trainer_gpus
    return config


@ray.remote
class _Probe:
    def gpu_ids(self) -> list[str]:
        return [str(i) for i in ray.get_gpu_ids()]


def test_rollout_workers_get_their_own_gpus_in_one_bundle(four_gpus, tmp_path):
    config = config_with(gpus_per_worker=2)
    placement = WorkerPlacement(config)
    spec = EngineSpec(kind="native", num_slots=2, cache_len=32, decode_steps_per_dispatch=2)
    try:
        from feynrl_jax.checkpoints import smollm2_checkpoint_dir

        workers = [
            RolloutWorker.options(**placement.options(i)).remote(None, smollm2_checkpoint_dir(), spec=spec, index=i)
            for i in range(2)
        ]
        ray.get([w.ready.remote() for w in workers])
        ids = [ray.get(w.status.remote())["gpu_ids"] for w in workers]
        assert [len(i) for i in ids] == [2, 2]
        assert not set(ids[0]) & set(ids[1])  # each worker its own GPUs
        tables = [ray.util.placement_group_table(group) for group in placement.groups]
        assert [t["strategy"] for t in tables] == ["STRICT_PACK", "STRICT_PACK"]
        assert [t["bundles"][0]["GPU"] for t in tables] == [2.0, 2.0]
        for w in workers:
            ray.kill(w)
    finally:
        placement.remove()
    # Removing a placement group is asynchronous: its GPUs come back shortly after.
    deadline = time.monotonic() + 30
    while ray.available_resources().get("GPU") != 4.0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.available_resources().get("GPU") == 4.0


def test_no_gpus_means_no_placement_group(four_gpus):
    placement = WorkerPlacement(config_with())
    assert placement.options(0) == {"num_cpus": ACTOR_CPUS["rollout"]}
    assert placement.groups == []
    assert "num_gpus" not in trainer_options(config_with())


def test_trainer_gets_its_gpus(four_gpus):
    probe = _Probe.options(**trainer_options(config_with(trainer_gpus=3))).remote()
    assert len(ray.get(probe.gpu_ids.remote())) == 3
    ray.kill(probe)


def test_too_few_gpus_fail_naming_the_keys(four_gpus):
    check_gpus(config_with(gpus_per_worker=1, trainer_gpus=2))  # 4 of 4
    with pytest.raises(InputError, match=r"needs 5 GPUs .*ray.trainer_gpus=1.*ray.gpus_per_rollout_worker=2.* has 4"):
        check_gpus(config_with(gpus_per_worker=2, trainer_gpus=1))


def test_rl_run_refuses_gpus_the_cluster_lacks(four_gpus, tmp_path):
    """The loop itself checks (a run that ignored the keys would start and train)."""
    from feynrl_jax.orchestration import rl_loop

    config = config_with(gpus_per_worker=3)
    config.run_dir = str(tmp_path / "run")
    config.eval.during_training = False
    with pytest.raises(InputError, match="ray.gpus_per_rollout_worker=3"):
        rl_loop.run(config)
