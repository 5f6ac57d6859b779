"""Every loss against an independent NumPy float64 reference, to 1e-6 relative.

The references below are written from the papers' formulas with plain loops over sequences and pairs; they
share no code with ``feynrl_jax.losses``. The JAX losses run in float64 inside ``jax.enable_x64(True)`` (a
context manager, so x64 is never switched on for the rest of the test session). Gradients are checked too:
by central finite differences of the NumPy reference for the losses without a stop-gradient, and against the
analytic gradient of the surrogate for CISPO, P3O and GSPO (whose stop-gradients make the loss value's
derivative differ from the update by design).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from feynrl_jax.losses import ALGORITHMS, TrainBatch

B, T = 6, 7  # 6 rows = 3 DPO pairs (row 2i chosen, 2i + 1 rejected)
RTOL = 1e-6


def _inputs(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    mask = np.zeros((B, T))
    segment_ids = np.zeros((B, T), np.int32)
    for b in range(B):
        length = rng.integers(3, T + 1)  # right padding after `length`
        prompt = rng.integers(1, length - 1)
        segment_ids[b, :length] = 1
        mask[b, prompt:length] = 1.0
    logprobs = -rng.uniform(0.05, 3.0, (B, T))
    return {
        "mask": mask,
        "segment_ids": segment_ids,
        "logprobs": logprobs,
        "old": logprobs + 0.25 * rng.normal(size=(B, T)),
        "ref": logprobs + 0.25 * rng.normal(size=(B, T)),
        "behavior": logprobs + 0.25 * rng.normal(size=(B, T)),
        "adv": np.repeat(rng.normal(size=(B, 1)), T, axis=1) + 0.1 * rng.normal(size=(B, T)),
        "values_old": rng.normal(size=(B, T)),
        "returns": rng.normal(size=(B, T)),
        "critic": rng.normal(size=(B, T)),
        "entropy": rng.uniform(0.0, 2.0, (B, T)),
    }


# ---------------------------------------------------------------------------------------------------------------
# NumPy float64 references.


def np_aggregate(per_token, x, mode, max_tokens=None):
    mask = x["mask"]
    if mode == "token_mean":
        return float(np.sum(per_token * mask) / np.sum(mask))
    per_seq = []
    for b in range(B):
        n = mask[b].sum()
        if n == 0:
            continue
        s = np.sum(per_token[b] * mask[b])
        per_seq.append(s / n if mode == "seq_mean_token_mean" else s / max_tokens)
    return float(np.mean(per_seq))


def np_k3(logp, other):
    d = other - logp
    return np.exp(d) - 1.0 - d


def np_weight(x, hp):
    """Off-policy weight pi_old / pi_behavior, truncated at tis_cap; none unless TIS or decoupled is on."""
    if hp.get("tis_cap") is None and not hp.get("decoupled", False):
        return np.ones_like(x["logprobs"])
    weight = np.exp(x["old"] - x["behavior"])
    return weight if hp["tis_cap"] is None else np.minimum(weight, hp["tis_cap"])


def np_clipped_surrogate(ratio, adv, lo, hi):
    return np.minimum(ratio * adv, np.clip(ratio, 1 - lo, 1 + hi) * adv)


def ref_sft(x, logp, hp):
    return np_aggregate(-logp, x, hp["loss_agg"], hp["max_tokens"])


def ref_ppo(x, logp, hp):
    ratio = np.exp(logp - x["old"])
    adv = x["adv"]
    surrogate = np_clipped_surrogate(ratio, adv, hp["clip_low"], hp["clip_high"])
    if hp["dual_clip"] is not None:
        surrogate = np.where(adv < 0, np.maximum(surrogate, hp["dual_clip"] * adv), surrogate)
    loss = -np_weight(x, hp) * surrogate
    v, v_old, ret = x["critic"], x["values_old"], x["returns"]
    err = (v - ret) ** 2
    if hp["value_clip"] is not None:
        err = np.maximum(err, (v_old + np.clip(v - v_old, -hp["value_clip"], hp["value_clip"]) - ret) ** 2)
    loss = loss + hp["vf_coef"] * 0.5 * err - hp["entropy_coef"] * x["entropy"]
    return np_aggregate(loss, x, hp["loss_agg"], hp["max_tokens"])


def ref_grpo(x, logp, hp):
    ratio = np.exp(logp - x["old"])
    loss = -np_weight(x, hp) * np_clipped_surrogate(ratio, x["adv"], hp["clip_low"], hp["clip_high"])
    assert hp["kl_estimator"] == "k3"
    loss = loss + hp["kl_coef"] * np_k3(logp, x["ref"])
    return np_aggregate(loss, x, hp["loss_agg"], hp["max_tokens"])


def ref_cispo(x, logp, hp):
    ratio = np.exp(x["logprobs"] - x["old"])  # stop-gradient: evaluated at the given logprobs
    lower = 0.0 if hp["clip_low"] is None else 1 - hp["clip_low"]
    loss = -np_weight(x, hp) * np.clip(ratio, lower, 1 + hp["clip_high"]) * x["adv"] * logp
    loss = loss + hp["kl_coef"] * np_k3(logp, x["ref"])
    return np_aggregate(loss, x, hp["loss_agg"], hp["max_tokens"])


def ref_p3o(x, logp, hp):
    ratio = np.exp(x["logprobs"] - x["old"])
    valid = ratio[x["mask"] > 0]
    ess = valid.sum() ** 2 / (len(valid) * np.sum(valid**2))
    rho = np.clip(ratio, 0.0, ess)
    loss = -np_weight(x, hp) * rho * x["adv"] * logp + (1 - ess) * np_k3(logp, x["old"])
    loss = loss + hp["kl_coef"] * np_k3(logp, x["ref"])
    return np_aggregate(loss, x, hp["loss_agg"], hp["max_tokens"])


def ref_gspo(x, logp, hp):
    loss = np.zeros((B, T))
    for b in range(B):
        m = x["mask"][b] > 0
        if not m.any():
            continue
        s = np.exp(np.mean(logp[b][m] - x["old"][b][m]))
        loss[b] = -np_clipped_surrogate(s, x["adv"][b], hp["clip_low"], hp["clip_high"])
    loss = np_weight(x, hp) * loss + hp["kl_coef"] * np_k3(logp, x["ref"])
    return np_aggregate(loss, x, hp["loss_agg"], hp["max_tokens"])


def _pairs(x, logp, hp):
    rho = np.sum((logp - x["ref"]) * x["mask"], axis=1)
    if hp["length_normalize"]:
        rho = rho / x["mask"].sum(axis=1)
    return rho[0::2], rho[1::2]


def ref_dpo(x, logp, hp):
    chosen, rejected = _pairs(x, logp, hp)
    h = hp["beta"] * (chosen - rejected)
    log_sigmoid = lambda z: -np.log1p(np.exp(-z))  # noqa: E731
    eps = hp["label_smoothing"]
    return float(np.mean(-(1 - eps) * log_sigmoid(h) - eps * log_sigmoid(-h)))


def ref_ipo(x, logp, hp):
    chosen, rejected = _pairs(x, logp, hp)
    return float(np.mean((chosen - rejected - 1 / (2 * hp["beta"])) ** 2))


REFERENCES = {
    "sft": ref_sft,
    "dpo": ref_dpo,
    "ipo": ref_ipo,
    "ppo": ref_ppo,
    "grpo": ref_grpo,
    "dr_grpo": ref_grpo,
    "dapo": ref_grpo,
    "rloo": ref_grpo,
    "reinforce_pp": ref_grpo,
    "cispo": ref_cispo,
    "p3o": ref_p3o,
    "gspo": ref_gspo,
}

CASES = [(name, {}) for name in ALGORITHMS] + [
    ("sft", {"loss_agg": "seq_mean_token_mean"}),
    ("dpo", {"label_smoothing": 0.2, "beta": 0.5}),
    ("dpo", {"length_normalize": True}),
    ("ipo", {"length_normalize": True, "beta": 0.3}),
    ("ppo", {"dual_clip": 2.0, "tis_cap": 1.5, "loss_agg": "seq_mean_token_mean"}),
    ("ppo", {"value_clip": None, "clip_low": 0.1, "clip_high": 0.15}),
    ("grpo", {"tis_cap": 1.5, "loss_agg": "token_mean"}),
    ("grpo", {"decoupled": True, "loss_agg": "seq_mean_token_sum", "max_tokens": 5.0}),
    ("cispo", {"clip_low": 0.1, "clip_high": 0.1, "kl_coef": 0.1, "tis_cap": 2.0}),
    ("p3o", {"kl_coef": 0.05, "tis_cap": 1.2}),
    ("gspo", {"clip_low": 0.2, "clip_high": 0.2, "kl_coef": 0.02}),
]
IDS = [f"{name}-{i}" for i, (name, _) in enumerate(CASES)]

STOP_GRADIENT_LOSSES = ("cispo", "p3o", "gspo")


def _jax_loss(name, overrides, x):
    """The library loss in float64, and its gradient with respect to logprobs."""
    with jax.enable_x64(True):
        batch = TrainBatch(
            tokens=jnp.ones((B, T), jnp.int32),
            positions=jnp.zeros((B, T), jnp.int32),
            segment_ids=jnp.asarray(x["segment_ids"]),
            loss_mask=jnp.asarray(x["mask"]),
            advantages=jnp.asarray(x["adv"]),
            old_logprobs=jnp.asarray(x["old"]),
            ref_logprobs=jnp.asarray(x["ref"]),
            behavior_logprobs=jnp.asarray(x["behavior"]),
            values=jnp.asarray(x["values_old"]),
            returns=jnp.asarray(x["returns"]),
        )
        loss_fn = ALGORITHMS[name].make_loss(**overrides)
        extra = dict(entropy=jnp.asarray(x["entropy"]), values=jnp.asarray(x["critic"]))
        logprobs = jnp.asarray(x["logprobs"])
        assert logprobs.dtype == jnp.float64
        value, grad = jax.value_and_grad(lambda lp: loss_fn(lp, batch, **extra)[0].value)(logprobs)
        assert value.dtype == jnp.float64
        return float(value), np.asarray(grad)


def _analytic_gradient(name, hp, x):
    """d loss / d logprobs of the stop-gradient surrogates, from the formulas (token_mean/seq aggregation)."""
    logp, mask, adv = x["logprobs"], x["mask"], x["adv"]
    weight = np_weight(x, hp)
    kl_ref = hp["kl_coef"] * (1.0 - np.exp(x["ref"] - logp))  # d k3(logp, ref) / d logp
    ratio = np.exp(logp - x["old"])
    if name == "cispo":
        lower = 0.0 if hp["clip_low"] is None else 1 - hp["clip_low"]
        per_token = -weight * np.clip(ratio, lower, 1 + hp["clip_high"]) * adv + kl_ref
    elif name == "p3o":
        valid = ratio[mask > 0]
        ess = valid.sum() ** 2 / (len(valid) * np.sum(valid**2))
        per_token = -weight * np.clip(ratio, 0, ess) * adv + (1 - ess) * (1.0 - np.exp(x["old"] - logp)) + kl_ref
    else:  # gspo: d/dlogp_t of -min(s A, clip(s) A) with s's value and grad s * dlogp_t
        per_token = np.zeros_like(logp)
        for b in range(B):
            m = mask[b] > 0
            if m.any():
                s = np.exp(np.mean(logp[b][m] - x["old"][b][m]))
                unclipped = s * adv[b] <= np.clip(s, 1 - hp["clip_low"], 1 + hp["clip_high"]) * adv[b]
                inside = (s >= 1 - hp["clip_low"]) & (s <= 1 + hp["clip_high"])
                per_token[b] = -weight[b] * s * adv[b] * (unclipped | inside)
        per_token = per_token + kl_ref
    if hp["loss_agg"] == "token_mean":
        return per_token * mask / mask.sum()
    lengths = mask.sum(axis=1, keepdims=True)
    n_seq = np.sum(lengths > 0)
    scale = lengths if hp["loss_agg"] == "seq_mean_token_mean" else hp["max_tokens"]
    return per_token * mask / (np.maximum(scale, 1) * n_seq)


def _finite_difference(reference, x, hp, h=1e-6):
    grad = np.zeros((B, T))
    for b in range(B):
        for t in range(T):
            plus, minus = x["logprobs"].copy(), x["logprobs"].copy()
            plus[b, t] += h
            minus[b, t] -= h
            grad[b, t] = (reference(x, plus, hp) - reference(x, minus, hp)) / (2 * h)
    return grad


@pytest.mark.parametrize(("seed", "name", "overrides"), [(i, *case) for i, case in enumerate(CASES)], ids=IDS)
def test_loss_matches_numpy_float64_reference(seed, name, overrides):
    x = _inputs(seed)
    hp = ALGORITHMS[name].hyperparameters | overrides
    value, grad = _jax_loss(name, overrides, x)
    expected = REFERENCES[name](x, x["logprobs"], hp)
    np.testing.assert_allclose(value, expected, rtol=RTOL)
    if name in STOP_GRADIENT_LOSSES:
        np.testing.assert_allclose(grad, _analytic_gradient(name, hp, x), rtol=RTOL, atol=1e-12)
    else:
        np.testing.assert_allclose(grad, _finite_difference(REFERENCES[name], x, hp), rtol=1e-5, atol=1e-8)
