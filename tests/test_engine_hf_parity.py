"""Greedy generation of the native engine is token-identical to transformers `generate` (torch, float32).

Tiny random models of every family are built with transformers config classes, saved, and loaded with
`feynrl_jax.checkpoints.load_hf`. Five prompts of different lengths are generated together with fewer slots than
sequences, so finished slots are refilled mid-run; each is compared with `generate` on that prompt alone.
"""

import os

import numpy as np
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from feynrl_jax.checkpoints import load_hf, load_tokenizer, smollm2_checkpoint_dir  # noqa: E402
from feynrl_jax.rollout.native_engine import NativeEngine  # noqa: E402
from feynrl_jax.rollout.types import FINISH_LENGTH, FINISH_STOP, SamplingParams  # noqa: E402

PROMPTS = [[3, 17, 52], [9, 8, 7, 6, 5, 4, 3, 2, 1, 90, 91], [100], [44, 45, 46, 47, 48, 49], [5, 120, 5, 120, 77]]
MAX_NEW = 12
EOS = 2

_COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    # A wide init makes logits spread out, so argmax ties within float noise are vanishingly unlikely.
    initializer_range=0.25,
    eos_token_id=EOS,
    bos_token_id=1,
    pad_token_id=0,
    tie_word_embeddings=False,
)

FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(**_COMMON, rope_theta=10000.0),
    "qwen2": lambda: transformers.Qwen2Config(**_COMMON),
    "qwen3": lambda: transformers.Qwen3Config(**_COMMON, head_dim=24),
    # A window shorter than prompt + completion exercises sliding-window attention against the cache.
    "mistral": lambda: transformers.MistralConfig(**_COMMON, sliding_window=8),
}


def _hf_greedy(model, prompt, max_new, eos):
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    torch.manual_seed(0)
    built = {}
    for family, make_config in FAMILIES.items():
        folder = tmp_path_factory.mktemp(family)
        model = transformers.AutoModelForCausalLM.from_config(make_config(), dtype=torch.float32).eval()
        if family == "qwen2":  # qwen2 has q/k/v biases, zero at init: make them matter
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if name.endswith("bias"):
                        p.normal_(0.0, 0.5)
        model.save_pretrained(folder)
        built[family] = (model, folder)
    return built


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_transformers_with_refill(family, hf_models):
    model, folder = hf_models[family]
    params, config = load_hf(folder)
    engine = NativeEngine(config, params, num_slots=2, cache_len=64, decode_steps_per_dispatch=4)
    rollouts = engine.generate(PROMPTS, SamplingParams(greedy=True, max_new_tokens=MAX_NEW, stop_token_ids=(EOS,)))
    assert engine.last_stats["dispatches"] > MAX_NEW // 4  # several waves: slots were refilled
    ours = rollouts.completions()
    for i, prompt in enumerate(PROMPTS):
        expected = _hf_greedy(model, prompt, MAX_NEW, EOS)
        assert ours[i] == expected, f"{family} prompt {i}: engine {ours[i]} != transformers {expected}"
        want = FINISH_STOP if expected[-1] == EOS else FINISH_LENGTH
        assert rollouts.finish_reason[i] == want
    # A nearly uniform random model would make the comparison weak: the completions must vary.
    assert len({tuple(c) for c in ours}) == len(PROMPTS)


@pytest.mark.slow
def test_greedy_matches_transformers_on_smollm2():
    folder = smollm2_checkpoint_dir()
    tokenizer = load_tokenizer(folder)
    questions = [
        "What is 2 + 2?",
        "Name a color.",
        "Write one sentence about the sea and the wind over it.",
        "List three fruits.",
        "Hi",
    ]
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True)
        for q in questions
    ]
    prompts = [list(p["input_ids"]) if isinstance(p, dict) or hasattr(p, "keys") else list(p) for p in prompts]
    assert len({len(p) for p in prompts}) > 1
    params, config = load_hf(folder)
    eos = tokenizer.eos_token_id
    engine = NativeEngine(config, params, num_slots=3, cache_len=128, decode_steps_per_dispatch=8)
    max_new = 24
    rollouts = engine.generate(prompts, SamplingParams(greedy=True, max_new_tokens=max_new, stop_token_ids=(eos,)))
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for i, prompt in enumerate(prompts):
        expected = _hf_greedy(model, prompt, max_new, eos)
        got = rollouts.completions()[i]
        assert got == expected, (
            f"prompt {i}: engine {tokenizer.decode(got)!r} != transformers {tokenizer.decode(expected)!r}"
        )
    assert np.all(rollouts.prompt_lengths == [len(p) for p in prompts])
