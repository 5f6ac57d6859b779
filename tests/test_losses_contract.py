"""The contract every registered loss passes (one table; adding an algorithm adds a row).

Every row runs the public kit, ``feynrl_jax.testing.check_loss`` (its module docstring and docs/CONTRACTS.md list
the checks): jit, finite loss and gradients, ``loss/`` metrics, exactly zero gradient at masked positions and no
influence of the garbage there, zero mask, eager == jit, no retrace, exact micro-batch accumulation, right-padding
invariance and packed == unpacked, on hypothesis-drawn examples whose masked and padding positions hold garbage.
P3O's micro-batches do not add up (its ESS is computed over the batch given to the loss, see losses/p3o.py), so its
rows skip that check. The reduction to REINFORCE at ratio one is in tests/test_losses_properties.py.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings

from feynrl_jax.losses import ALGORITHMS
from feynrl_jax.testing import CHECKS, check_loss, loss_inputs

# (row id, registry name, hyperparameter overrides). Every registry entry appears with its defaults; extra rows
# exercise the optional paths (off-policy corrections, dual clip, two-sided CISPO, cDPO, length normalisation).
CASES = [(name, name, {}) for name in ALGORITHMS] + [
    ("grpo+tis", "grpo", {"tis_cap": 2.0}),
    ("ppo+decoupled+dual_clip", "ppo", {"decoupled": True, "tis_cap": 5.0, "dual_clip": 3.0}),
    ("cispo+two_sided+tis", "cispo", {"clip_low": 0.2, "tis_cap": 2.0}),
    ("p3o+kl+decoupled", "p3o", {"kl_coef": 0.1, "decoupled": True}),
    ("gspo+token_mean+kl", "gspo", {"loss_agg": "token_mean", "kl_coef": 0.05}),
    ("dpo+cdpo+length_norm", "dpo", {"label_smoothing": 0.1, "length_normalize": True}),
    ("sft+seq_mean_token_sum", "sft", {"loss_agg": "seq_mean_token_sum", "max_tokens": 16.0}),
]
IDS = [case[0] for case in CASES]
# Losses with batch-level statistics: their gradient accumulation is exact only for unsplit batches.
BATCH_LEVEL = {"p3o"}
# The effective sample size of the importance weights (with `tis_cap` or `decoupled`) is a diagnostic of the batch
# given to the loss; the loss and its gradient still accumulate exactly.
BATCH_LEVEL_METRICS = ("loss/is_ess",)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_contract(case):
    _, name, overrides = case
    accumulates = name not in BATCH_LEVEL
    report = check_loss(
        ALGORITHMS[name].make_loss(**overrides),
        accumulates=accumulates,
        batch_level_metrics=BATCH_LEVEL_METRICS if {"tis_cap", "decoupled"} & set(overrides) else (),
        max_examples=4,
    )
    expected = {"ratio_one"} | (set() if accumulates else {"micro_batches"})
    assert set(report.skipped) == expected and set(report.passed) == set(CHECKS) - expected


def test_registry_records_are_consistent():
    expected = {"sft", "dpo", "ppo", "grpo", "dr_grpo", "dapo", "rloo", "reinforce_pp", "cispo", "p3o", "gspo"}
    assert expected <= set(ALGORITHMS)
    for name, algorithm in ALGORITHMS.items():
        assert algorithm.name == name
        assert algorithm.paradigm in ("sft", "dpo", "rl")
        assert (algorithm.advantage_fn is None) == (algorithm.paradigm != "rl"), name
        hp = algorithm.hyperparameters
        if algorithm.paradigm == "rl":
            assert algorithm.needs_reference == (hp.get("kl_coef", 0.0) > 0), name
        assert algorithm.uses_entropy == (hp.get("entropy_coef", 0.0) > 0), name
        assert algorithm.needs_critic == (hp.get("vf_coef", 0.0) > 0), name
        with pytest.raises(dataclasses.FrozenInstanceError):
            algorithm.name = "other"  # type: ignore[misc]
    assert ALGORITHMS["dapo"].hyperparameters["clip_high"] > ALGORITHMS["dapo"].hyperparameters["clip_low"]
    assert ALGORITHMS["dr_grpo"].hyperparameters["loss_agg"] == "seq_mean_token_sum"


def test_make_loss_rejects_unknown_hyperparameter():
    with pytest.raises(ValueError, match="clip_hihg"):
        ALGORITHMS["grpo"].make_loss(clip_hihg=0.3)


@settings(max_examples=1, deadline=None)
@given(loss_inputs())
def test_bad_inputs_name_the_field(inputs):
    batch = inputs.batch
    with pytest.raises(ValueError, match="ref_logprobs"):
        ALGORITHMS["dpo"].make_loss()(inputs.logprobs, dataclasses.replace(batch, ref_logprobs=None))
    with pytest.raises(ValueError, match="behavior_logprobs"):
        ALGORITHMS["grpo"].make_loss(tis_cap=2.0)(inputs.logprobs, dataclasses.replace(batch, behavior_logprobs=None))
    with pytest.raises(ValueError, match="batch.advantages"):
        ALGORITHMS["cispo"].make_loss()(inputs.logprobs, dataclasses.replace(batch, advantages=batch.advantages[:, 1:]))
    with pytest.raises(ValueError, match="values"):
        ALGORITHMS["ppo"].make_loss()(inputs.logprobs, batch, entropy=inputs.entropy)
    with pytest.raises(ValueError, match="loss_agg"):
        ALGORITHMS["sft"].make_loss(loss_agg="sum")(inputs.logprobs, batch)
    with pytest.raises(ValueError, match="max_tokens"):
        ALGORITHMS["sft"].make_loss(loss_agg="seq_mean_token_sum")(inputs.logprobs, batch)
