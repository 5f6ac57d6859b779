"""`rollout.colocate`: the rollout engine inside the trainer's process.

- A colocated sync run trains bitwise as the same run with a rollout worker does (the same engine code, params and
  seeds; at temperature 1, the config's: see `test_sampling.test_greedy_traced_takes_the_branch_it_says`), and
  publishes no arrays (`perf/publish_bytes` 0, nothing fetched): the key is honoured.
- Its engine (`EngineHost` fed the trainer's params) samples what a fresh engine holding those params samples, frees
  its copy of the params and its KV cache after every generation, and refuses a version the trainer does not hold.
  The trainer's held-out evaluation runs on it (`ColocatedEngine`), with the decode programs its rollouts compiled.
- Every setting a colocated engine cannot honour is refused, naming its key.
"""

import json
import os
import sys
import threading

import numpy as np
import pytest
import resume_harness as harness
from rl_run_checks import assert_loop_records

from feynrl_jax.config.errors import ConfigError
from feynrl_jax.config.validation import validate
from feynrl_jax.tracking import read_metrics

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "configs"))
import tiny_rl  # noqa: E402


def _config(run_dir: str, colocate: bool):
    config = tiny_rl.get_config()
    config.run_dir = run_dir
    config.eval.temperature, config.eval.n_samples, config.eval.k = 0.0, 1, (1,)  # greedy, before and after
    config.checkpoint.every_steps = 0
    config.rollout.colocate = colocate
    return config


@pytest.mark.slow
@pytest.mark.ray
def test_a_colocated_run_trains_bitwise_as_a_run_with_a_rollout_worker(ray_session, tmp_path):
    from feynrl_jax.orchestration import rl_loop

    runs = {}
    for colocate in (False, True):
        config = _config(str(tmp_path / f"colocate_{colocate}"), colocate)
        rl_loop.run(config)
        runs[colocate] = config.run_dir
    worker, colocated = ([r for r in read_metrics(runs[c]) if "train/loss" in r] for c in (False, True))
    assert_loop_records(runs[True], "grpo")
    for key in (
        "train/loss",
        "train/grad_norm",
        "train/entropy",
        "rollout/reward/total/mean",
        "rollout/generated_tokens",
        "rollout/logprob_mismatch_max_abs",
        "loss/ratio_mean",
    ):
        assert [r[key] for r in colocated] == [r[key] for r in worker], key
    harness.assert_same_final_state(runs[False], runs[True], total_steps=2)
    # The colocated run evaluated on its rollout engine, the other on an engine of the trainer's own; the same
    # params before training, so the same greedy completions.
    for colocate, engine in ((False, "NativeEngine"), (True, "ColocatedEngine")):
        for step in (0, 2):
            with open(os.path.join(runs[colocate], f"eval_results_step{step}.json")) as f:
                assert json.load(f)["engine"] == engine, (colocate, step)
    with (
        open(os.path.join(runs[False], "eval_results_step0.json")) as f,
        open(os.path.join(runs[True], "eval_results_step0.json")) as g,
    ):
        assert [s["completion"] for s in json.load(f)["samples"]] == [s["completion"] for s in json.load(g)["samples"]]
    # Honoured: the worker run published its params through the object store and fetched them; the colocated run
    # published no arrays and fetched nothing, its engine loading the trainer's params on the trainer's device.
    assert all(r["perf/publish_bytes"] > 0 and r["perf/weight_sync_fetch_seconds"] > 0 for r in worker)
    assert all(r["perf/publish_bytes"] == 0 and r["perf/weight_sync_fetch_seconds"] == 0 for r in colocated)
    assert [r["perf/weight_sync_bytes"] for r in colocated] == [r["perf/weight_sync_bytes"] for r in worker]
    assert colocated[0]["perf/rollout_warmup_seconds"] > 0  # its warm-up ran in the trainer and was reported
    assert worker[0]["perf/rollout_warmup_past_start_seconds"] >= 0  # the part the start-up did not hide
    # The colocated warm-up started in the trainer before its start-up ended (the driver sent it first).
    assert 0 <= colocated[0]["perf/rollout_warmup_past_start_seconds"] <= colocated[0]["perf/rollout_warmup_seconds"]
    # The first update reports its compile-ahead once; the colocated one began only after the warm-up had ended.
    for records in (worker, colocated):
        assert records[0]["perf/update_compile_wait_seconds"] >= 0
        assert not any("perf/update_compile_past_start_seconds" in r for r in records[1:])
    warmed = colocated[0]["perf/rollout_warmup_past_start_seconds"]
    assert colocated[0]["perf/update_compile_past_start_seconds"] >= warmed
    # The engine's own time, apart from the call's queue on its actor and the trip back to the driver.
    # Generation speed is measured on that engine time, the queue and the round trip left out.
    for r in worker + colocated:
        assert 0 < r["perf/rollout_engine_seconds"] < r["perf/rollout_seconds"]
        rate = r["rollout/generated_tokens"] / r["perf/rollout_engine_seconds"]
        assert r["rollout/tokens_per_second"] == pytest.approx(rate, rel=1e-12)


@pytest.mark.parametrize("case", ["warm_up", "close", "no_warm_up"])
def test_a_colocated_trainer_compiles_its_update_once_its_engines_warm_up_has_ended(tmp_path, monkeypatch, case):
    """`TrainerActor` with a colocated engine holds the update's compile-ahead (`RLTrainer`'s `compile_after`) until
    the engine's warm-up has returned, whatever it returned: one process's compiles do not run side by side, and the
    first generation needs the warm-up's programs first. Closing the trainer wakes a held compile, which then
    compiles nothing. Without `rollout.warmup` nothing is held (no warm-up comes)."""
    from feynrl_jax.orchestration.actors import TrainerActor
    from feynrl_jax.orchestration.engines import EngineSpec
    from feynrl_jax.rollout.types import SamplingParams

    monkeypatch.setenv("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))  # the actor sets it: restored
    config = _config(str(tmp_path / "run"), colocate=True)
    config.rollout.warmup = case != "no_warm_up"
    spec = EngineSpec(kind="native", num_slots=4, cache_len=config.data.max_seq_len, decode_steps_per_dispatch=2)
    actor = TrainerActor.__ray_actor_class__(config, None, spec)  # the class itself, in this process
    try:
        assert actor.init_error is None
        if case == "no_warm_up":
            assert actor.trainer.compile_after is None
            return
        assert actor.trainer.compile_after == actor._after_warm_up
        answers = []
        waiter = threading.Thread(target=lambda: answers.append(actor._after_warm_up()))
        waiter.start()
        waiter.join(1.0)
        assert waiter.is_alive() and not answers  # held: no warm-up has ended
        if case == "warm_up":
            sampling = SamplingParams(temperature=1.0, max_new_tokens=4, n=2, seed=0)
            assert actor.rollout.warm_up([5, 9], sampling)["complete"] == 1.0
            waiter.join(60)
            assert answers == [True]
    finally:
        actor.close()
    waiter.join(5)
    assert answers == ([True] if case == "warm_up" else [False])


@pytest.mark.parametrize("lora_rank", [0, 2])
def test_a_colocated_engine_samples_the_trainers_params_and_frees_them_after_each_generation(lora_rank):
    import jax

    from feynrl_jax.checkpoints import smollm2_checkpoint_dir
    from feynrl_jax.models import ModelConfig, init_params
    from feynrl_jax.orchestration.actors import ColocatedEngine, ParamsSnapshot
    from feynrl_jax.orchestration.engine_host import EngineHost
    from feynrl_jax.orchestration.engines import EngineSpec, build_native
    from feynrl_jax.orchestration.param_store import StoreError
    from feynrl_jax.rollout.types import SamplingParams

    model = ModelConfig(
        vocab_size=80,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        lora_rank=lora_rank,
        lora_targets=("q_proj", "down_proj") if lora_rank else (),
    )
    # Placed as a trainer's are: on its mesh (here two devices, replicated), not where the engine runs.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    on_mesh = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    versions = {v: jax.device_put(init_params(model, jax.random.PRNGKey(v)), on_mesh) for v in (3, 4)}
    held = {"version": 3}

    def trainer_params(version: int):  # as `TrainerActor._engine_params`: the trainer's current version only
        if version != held["version"]:
            raise StoreError(f"asked for {version}, holding {held['version']}")
        return versions[version]

    spec = EngineSpec(kind="native", num_slots=8, cache_len=32, decode_steps_per_dispatch=2)
    host = EngineHost(model, smollm2_checkpoint_dir(), spec, index=0, local_params=trainer_params)
    prompts = [[(5 * i + j) % 70 + 1 for j in range(4)] for i in range(3)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6, n=2, seed=11)
    # A failed warm-up (a prompt of no tokens) is logged and reported empty, and it has ended all the same.
    failing = EngineHost(model, smollm2_checkpoint_dir(), spec, index=1, local_params=trainer_params)
    assert not failing.warm_up_ended.is_set()
    assert failing.warm_up([0], sampling) == {} and failing.warm_up_ended.is_set()
    # The warm-up (placeholder weights; a LoRA engine's adapter load too) completes, then frees what it held.
    assert host.warm_up([len(p) for p in prompts], sampling)["complete"] == 1.0
    assert host.engine._params is None and host.engine._state is None

    def snapshot(version: int) -> ParamsSnapshot:  # what the store records for a colocated run: no arrays
        return ParamsSnapshot(version=version, refs={}, checksum=0)

    for version in (3, 4):
        held["version"] = version
        compiled_before = len(host.clock.names())
        got, stats = host.generate(prompts, sampling, snapshot(version))
        compiled = host.clock.names()[compiled_before:]
        want = build_native(spec, model, jax.device_get(versions[version]), version).generate(prompts, sampling)
        np.testing.assert_array_equal(got.completion_ids, want.completion_ids)
        np.testing.assert_array_equal(got.behavior_logprobs, want.behavior_logprobs)
        assert set(got.policy_version.tolist()) == {version}
        assert stats["load_fetch_seconds"] == 0.0 and stats["load_bytes"] > 0
        assert stats["engine_seconds"] > stats["load_seconds"] > 0  # the load, the generation and the freeing
        # The engine places the trainer's params where it placed the warm-up's placeholder weights (from host
        # memory), so the generations run the warm-up's programs: no prefill or decode program compiled again.
        again = [name for name in compiled if "prefill" in name or "dispatch" in name]
        assert not again, again
        # Freed: no params, no decode state (KV cache); the next generation loads again.
        assert host.engine._params is None and host.engine._state is None and host.version == -1
    # The trainer's held-out evaluation (greedy) on this engine (`ColocatedEngine`) runs the programs the warm-up
    # and the sampled rollouts compiled (`greedy` traced), and picks what an engine of its own picks.
    evaluation = ColocatedEngine(host, lambda: held["version"])
    evaluation.load_params(None, 7)  # the evaluator's step: the host loads the trainer's version itself
    greedy = SamplingParams(greedy=True, max_new_tokens=6)
    compiled_before = len(host.clock.names())
    got = evaluation.generate(prompts, greedy)
    assert "jit(dispatch)" not in host.clock.names()[compiled_before:]
    want = build_native(spec, model, jax.device_get(versions[4]), 4).generate(prompts, greedy)
    np.testing.assert_array_equal(got.completion_ids, want.completion_ids)
    # The same float32 model code; the sampling step sits in a `lax.cond`, which may fuse otherwise.
    np.testing.assert_allclose(got.behavior_logprobs, want.behavior_logprobs, atol=1e-5, rtol=0)
    assert set(got.policy_version.tolist()) == {4} and host.engine._params is None
    with pytest.raises(StoreError, match="asked for 3, holding 4"):
        host.generate(prompts, sampling, snapshot(3))
    with pytest.raises(ValueError, match="exactly one of fetch"):
        EngineHost(model, smollm2_checkpoint_dir(), spec, index=0)


@pytest.mark.parametrize(
    "key, value",
    [
        ("rollout.engine", "vllm"),
        ("train.max_staleness", 1),
        ("rollout.num_workers", 2),
        ("rollout.cpu_cores", (0,)),
        ("ray.gpus_per_rollout_worker", 1),
        ("ray.trainer_processes", 2),
        ("eval.release_memory", False),
    ],
)
def test_settings_a_colocated_engine_cannot_honour_are_refused_by_name(key, value):
    config = tiny_rl.get_config()
    config.rollout.colocate = True
    validate(config, num_devices=2)  # the tiny RL config colocates as it is
    section, name = key.split(".")
    config[section][name] = value
    with pytest.raises(ConfigError) as excinfo:
        validate(config, num_devices=2)
    problems = [p for p in excinfo.value.problems if p.key == key and "rollout.colocate=True" in p.message]
    assert len(problems) == 1, excinfo.value.problems
