"""Parity with transformers (PyTorch, CPU, float32) on tiny random models of every family.

Each case builds a transformers model from its config class, perturbs every weight (so norms and biases are not
the trivial 1 and 0), saves it with `save_pretrained`, loads it with our loader, and checks:
- logits on a right-padded batch of prompts of different lengths (max |diff| < 1e-4);
- packed rows give the per-token logits of the unpacked rows;
- prefill + token-by-token decode with the KV cache gives the logits of the full forward pass;
- HF folder -> our params -> export -> `from_pretrained` gives identical weights and logits.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from feynrl_jax.checkpoints import export_hf, load_hf  # noqa: E402
from feynrl_jax.models import forward, init_cache, logits, sequence_logprobs  # noqa: E402

TOL = 1e-4
VOCAB = 96
_BASE = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
)

# name -> (config class, extra kwargs). Together they cover every family, GQA, tied/untied embeddings, biases,
# q/k norms, a head_dim independent of hidden/heads, sliding windows and every RoPE variant we implement.
CASES = {
    "llama3_rope_scaling": (
        "LlamaConfig",
        dict(
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            )
        ),
    ),
    "llama2_linear_rope_bias": (
        "LlamaConfig",
        dict(num_key_value_heads=4, attention_bias=True, rope_parameters=dict(rope_type="linear", factor=2.0)),
    ),
    "smollm2_tied": ("LlamaConfig", dict(tie_word_embeddings=True, rope_parameters=dict(rope_theta=100000.0))),
    "qwen2_bias": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen2_sliding_upper_layers": (
        "Qwen2Config",
        dict(use_sliding_window=True, sliding_window=3, max_window_layers=1),
    ),
    "qwen3_qk_norm_yarn": (
        "Qwen3Config",
        dict(
            head_dim=24,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=16),
        ),
    ),
    "mistral_sliding_window": ("MistralConfig", dict(sliding_window=4, head_dim=16)),
}

LENGTHS = (11, 7, 3)
WIDTH = sum(LENGTHS) + 2  # room for all prompts packed into one row, plus padding


def _batch():
    """Rows 0-2: the prompts right-padded (segment 1); row 3: the same prompts packed (segments 1, 2, 3).

    One array shape serves the padded, packed and log-probability checks, so each family compiles once.
    """
    rng = np.random.default_rng(0)
    tokens = np.zeros((len(LENGTHS) + 1, WIDTH), np.int32)
    positions = np.zeros_like(tokens)
    segments = np.zeros_like(tokens)
    start = 0
    for i, n in enumerate(LENGTHS):
        prompt = rng.integers(1, VOCAB, n)
        tokens[i, :n], positions[i, :n], segments[i, :n] = prompt, np.arange(n), 1
        tokens[-1, start : start + n], positions[-1, start : start + n] = prompt, np.arange(n)
        segments[-1, start : start + n] = i + 1
        start += n
    positions[:, :][segments == 0] = 0
    return tokens, positions, segments


def _make_hf_model(name: str, seed: int = 0):
    """A transformers model of family `name` with every weight perturbed (norms around 1, the rest ~0.15)."""
    cls_name, extra = CASES[name]
    config = getattr(transformers, cls_name)(**{**_BASE, **extra})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, cls_name.replace("Config", "ForCausalLM"))(config).eval()
    with torch.no_grad():
        for p_name, p in model.named_parameters():
            if "norm" in p_name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(0.15 * torch.randn_like(p))
    return model


def _hf_logits(model, tokens, segments):
    with torch.no_grad():
        out = model(input_ids=torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(segments))
    return out.logits.numpy()


@pytest.fixture(scope="module", params=sorted(CASES))
def family(request, tmp_path_factory):
    """Per family: the HF model, our params/config, the saved folder, and our outputs on `_batch()`."""
    model = _make_hf_model(request.param)
    folder = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(folder)
    params, config = load_hf(folder)

    @jax.jit
    def run(p, x, pos, seg):
        hidden, _ = forward(p, x, pos, config=config, segment_ids=seg)
        lp, _ = sequence_logprobs(p, x, pos, config=config, segment_ids=seg, chunk_size=8)
        return logits(p, hidden, config=config), lp

    tokens, positions, segments = _batch()
    ours, lp = (np.asarray(a) for a in run(params, tokens, positions, segments))
    return dict(name=request.param, model=model, params=params, config=config, folder=folder, logits=ours, lp=lp)


def test_config_matches_hf(family):
    name, config, hf = family["name"], family["config"], family["model"].config
    assert config.num_layers == hf.num_hidden_layers
    assert config.tie_word_embeddings == bool(hf.tie_word_embeddings)
    assert config.head_dim == (hf.__dict__.get("head_dim") or hf.hidden_size // hf.num_attention_heads)
    if "sliding" in name:
        assert config.sliding_window == hf.sliding_window
        ours = ["sliding_attention" if w is not None else "full_attention" for w in config.layer_windows()]
        hf_types = hf.__dict__.get("layer_types") or ["sliding_attention"] * hf.num_hidden_layers
        assert ours == list(hf_types)
    else:
        assert config.sliding_window is None


def test_padded_batch_logits_match_transformers(family):
    tokens, _, segments = _batch()
    n = len(LENGTHS)
    ref = _hf_logits(family["model"], tokens[:n], segments[:n])
    ours = family["logits"][:n]
    real = segments[:n].astype(bool)
    assert ours.dtype == np.float32
    assert np.abs(ref).max() > 0.5, "random weights too small for a meaningful comparison"
    np.testing.assert_array_less(np.abs(ours - ref)[real].max(), TOL)


def test_packed_equals_unpacked(family):
    ours, lp = family["logits"], family["lp"]
    start = 0
    for i, n in enumerate(LENGTHS):
        np.testing.assert_allclose(ours[-1, start : start + n], ours[i, :n], atol=1e-5, rtol=0)
        # Log-probabilities aligned per token; the first token of every segment has none.
        np.testing.assert_allclose(lp[-1, start : start + n], lp[i, :n], atol=1e-5, rtol=0)
        assert lp[-1, start] == 0.0 and lp[i, 0] == 0.0
        start += n
    _, _, segments = _batch()
    assert np.all(lp[segments == 0] == 0.0)
    continuing = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] != 0)
    assert np.all(lp[:, 1:][continuing] != 0.0)


def test_logprobs_are_log_softmax_of_logits(family):
    tokens, _, segments = _batch()
    ours, lp = family["logits"], family["lp"]
    log_softmax = ours - np.log(np.sum(np.exp(ours - ours.max(-1, keepdims=True)), -1, keepdims=True))
    log_softmax -= ours.max(-1, keepdims=True)
    want = np.take_along_axis(log_softmax[:, :-1], tokens[:, 1:, None], -1)[..., 0]
    same = segments[:, 1:] == segments[:, :-1]
    np.testing.assert_allclose(lp[:, 1:][same & (segments[:, 1:] != 0)], want[same & (segments[:, 1:] != 0)], atol=1e-5)


def test_prefill_then_decode_equals_full_forward(family):
    params, config = family["params"], family["config"]
    tokens, positions, segments = _batch()
    n = len(LENGTHS)
    tokens, positions, segments = (
        tokens[:n, : max(LENGTHS)],
        positions[:n, : max(LENGTHS)],
        segments[:n, : max(LENGTHS)],
    )
    full = family["logits"][:n, : max(LENGTHS)]
    b, t = tokens.shape
    prefill_len = 2

    @jax.jit
    def step(p, x, pos, s, c):
        hidden, c = forward(p, x, pos, config=config, segment_ids=s, cache=c)
        return logits(p, hidden, config=config), c

    cache = init_cache(config, b, t + 1)
    out, cache = step(params, tokens[:, :prefill_len], positions[:, :prefill_len], segments[:, :prefill_len], cache)
    pieces = [np.asarray(out)]
    for i in range(prefill_len, t):
        sl = slice(i, i + 1)
        out, cache = step(params, tokens[:, sl], positions[:, sl], segments[:, sl], cache)
        pieces.append(np.asarray(out))
    decoded = np.concatenate(pieces, axis=1)
    real = segments.astype(bool)
    np.testing.assert_allclose(decoded[real], full[real], atol=1e-5, rtol=0)
    ref = _hf_logits(family["model"], tokens, segments)
    np.testing.assert_array_less(np.abs(decoded - ref)[real].max(), TOL)
    # Padding tokens were never written into the cache; every real position was.
    k = np.asarray(cache.k).swapaxes(-1, -2)  # [L, B, K, S, Dh], as the values
    for i, length in enumerate(LENGTHS):
        for stored in (k, np.asarray(cache.v)):
            assert np.all(stored[:, i, :, length:] == 0.0)
            assert np.all(np.any(stored[:, i, :, :length] != 0.0, axis=(1, -1)))


def test_round_trip_export_loads_in_transformers(family, tmp_path):
    model = family["model"]
    out = export_hf(family["params"], family["config"], tmp_path / "exported")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    reloaded.config._attn_implementation = "eager"
    original = model.state_dict()
    assert set(reloaded.state_dict()) == set(original)
    for name, value in reloaded.state_dict().items():
        assert torch.equal(value, original[name]), name
    tokens, _, segments = _batch()
    np.testing.assert_array_equal(_hf_logits(reloaded, tokens, segments), _hf_logits(model, tokens, segments))
