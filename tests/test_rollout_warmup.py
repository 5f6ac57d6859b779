"""`rollout.warmup`: rollout workers compile their engine's programs at start-up (`RolloutWorker.warm_up`), and the
key is honoured both ways, with nothing the run computes changed by it."""

import os
import sys
import time

import pytest

from feynrl_jax.config.errors import ConfigError
from feynrl_jax.config.validation import validate
from feynrl_jax.tracking import read_metrics

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "configs"))
import tiny_rl  # noqa: E402


def _config(run_dir: str, warmup: bool):
    config = tiny_rl.get_config()
    config.run_dir = run_dir
    config.eval.during_training = False
    config.checkpoint.every_steps = 0
    config.train.steps = 2
    config.rollout.num_workers = 2  # each warms up for its own share of the first batch
    config.rollout.warmup = warmup
    return config


@pytest.mark.slow
@pytest.mark.ray
def test_warmed_up_workers_compile_nothing_in_the_first_generation_and_change_nothing(ray_session, tmp_path):
    from feynrl_jax.orchestration import rl_loop

    runs = {}
    for warmup in (True, False):
        config = _config(str(tmp_path / f"warmup_{warmup}"), warmup)
        rl_loop.run(config)
        runs[warmup] = read_metrics(config.run_dir)
    warm, cold = runs[True], runs[False]
    assert [r["step"] for r in warm] == [r["step"] for r in cold] == [1, 2]
    # The warm-up is reported once, at the first step; the first generation then compiled nothing, prefill and
    # every decode program included (each worker's 2 prompts x 4 samples in 8 slots; the engine tests cover the
    # narrowed tails).
    assert warm[0]["perf/rollout_warmup_seconds"] > 0 and "perf/rollout_warmup_seconds" not in warm[1]
    assert [r["perf/rollout_compile_seconds"] for r in warm] == [0.0, 0.0]
    # Without it, the first generation compiles them (or loads them from the compilation cache that the test
    # session shares, which counts too), and no warm-up is reported.
    assert cold[0]["perf/rollout_compile_seconds"] > 0
    assert all("perf/rollout_warmup_seconds" not in r for r in cold)
    # Same samples, same training: the warm-up left the engines as it found them.
    for key in ("rollout/reward/total/mean", "rollout/logprob_mismatch_kl", "train/loss", "train/grad_norm"):
        assert [r[key] for r in warm] == [r[key] for r in cold], key


def test_a_vllm_run_cannot_turn_the_warm_up_off():
    """vLLM warms itself up when it starts: the key would do nothing there, so turning it off is refused by name."""
    config = tiny_rl.get_config()
    config.rollout.engine = "vllm"
    config.rollout.warmup = False
    with pytest.raises(ConfigError) as excinfo:
        validate(config, num_devices=1)
    (problem,) = [p for p in excinfo.value.problems if p.key == "rollout.warmup"]
    assert "applies to the native engine only" in problem.message
    config.rollout.warmup = True
    try:
        validate(config, num_devices=1)
    except ConfigError as error:  # vLLM may be missing here; the warm-up is not the problem
        assert all(p.key != "rollout.warmup" for p in error.problems)


@pytest.mark.ray
def test_a_worker_finishes_the_warm_up_its_first_generation_cut_short_before_the_tail_needs_it(ray_session):
    """A generation waiting while the worker warms up cuts the narrowed tail's part short; the worker compiles that
    part once a generation is done (`warm_up_left` falls to 0 with no call from outside), so a later batch whose
    tail narrows to every width compiles nothing. The worker loads its tokenizer only for stop strings."""
    import dataclasses

    import jax
    import ray

    from feynrl_jax.checkpoints import load_tokenizer, smollm2_checkpoint_dir
    from feynrl_jax.models import ModelConfig, init_params
    from feynrl_jax.orchestration.actors import ParamStoreActor, RolloutWorker, latest_snapshot, publish_params
    from feynrl_jax.orchestration.engines import EngineSpec
    from feynrl_jax.rollout.types import SamplingParams

    # A model of this test's own: no other test's programs in a shared compilation cache shorten its warm-up.
    model = ModelConfig(
        vocab_size=80, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=16
    )
    store = ParamStoreActor.remote()
    publish_params(store, jax.device_get(init_params(model, jax.random.PRNGKey(0))), 1, timeout_s=60)
    snapshot = latest_snapshot(store, timeout_s=60)
    spec = EngineSpec(kind="native", num_slots=16, cache_len=48, decode_steps_per_dispatch=2)
    worker = RolloutWorker.options(max_concurrency=2).remote(model, smollm2_checkpoint_dir(), spec=spec, index=0)
    ray.get(worker.ready.remote())
    prompts = [[(5 * i + j) % 70 + 1 for j in range(5)] for i in range(16)]
    # A third of the vocabulary stops a row: the 16 rows end at different lengths, and the tail narrows.
    sampling = SamplingParams(temperature=1.0, max_new_tokens=24, seed=7, stop_token_ids=tuple(range(0, 80, 3)))

    def status():
        return ray.get(worker.status.remote())

    def waiting_generations(count: int) -> None:  # as if `count` generations waited for the engine
        ray.get(worker.__ray_call__.remote(lambda w: setattr(w.host, "generations", count)))

    # A generation waiting throughout (whatever the machine's speed): the warm-up stops at the narrowed tail.
    waiting_generations(1)
    assert ray.get(worker.warm_up.remote([len(p) for p in prompts], sampling))["complete"] == 0.0
    assert status()["warm_up_left"] > 0 and not status()["warming_up"]
    waiting_generations(0)
    # Two new tokens: one dispatch, no narrowing; its end starts the finisher.
    _, first = ray.get(worker.generate.remote(prompts, dataclasses.replace(sampling, max_new_tokens=2), snapshot))
    assert first["narrowings"] == 0, first
    deadline = time.monotonic() + 120
    while status()["warm_up_left"] or status()["warming_up"]:
        assert time.monotonic() < deadline, status()
        time.sleep(0.05)
    _, second = ray.get(worker.generate.remote(prompts, sampling, snapshot))
    assert second["narrowings"] > 0 and second["compile_seconds"] == 0.0, second
    # Without stop strings the worker never loaded its tokenizer (transformers stays unimported there); the first
    # `detokenize` loads it and decodes as the tokenizer does.
    assert not ray.get(worker.__ray_call__.remote(lambda _: "transformers" in sys.modules))
    ids = [20, 33, 47, 61, 2]
    want = load_tokenizer(smollm2_checkpoint_dir()).decode(ids, skip_special_tokens=True)
    assert ray.get(worker.detokenize.remote(ids)) == want
    ray.kill(worker)
    ray.kill(store)
    # The folder is still checked at construction: a worker without it fails to start, naming it.
    lost = RolloutWorker.remote(model, "/nonexistent/tokenizer", spec=spec, index=1)
    with pytest.raises(FileNotFoundError, match="tokenizer folder /nonexistent/tokenizer does not exist"):
        ray.get(lost.ready.remote())
    ray.kill(lost)
