"""feynrl_jax.losses: every algorithm as a pure, model-free, jittable function of arrays.

Imports only jax, numpy, chex and the standard library. See losses/README.md for the table of algorithms.
"""

from feynrl_jax.losses import advantages, aggregation, kl, off_policy, sequences, value
from feynrl_jax.losses.aggregation import AGGREGATIONS, LossSum, aggregate
from feynrl_jax.losses.batch import TrainBatch
from feynrl_jax.losses.cispo import cispo_loss
from feynrl_jax.losses.dpo import dpo_loss, ipo_loss
from feynrl_jax.losses.grpo import grpo_loss
from feynrl_jax.losses.gspo import gspo_loss
from feynrl_jax.losses.kl import KL_ESTIMATORS, k1, k2, k3, kl_estimate, kl_reward_penalty
from feynrl_jax.losses.metrics import Metric, combine_metrics, compute_metrics
from feynrl_jax.losses.p3o import p3o_loss
from feynrl_jax.losses.ppo import ppo_loss
from feynrl_jax.losses.registry import ALGORITHMS, Algorithm
from feynrl_jax.losses.sft import sft_loss
from feynrl_jax.losses.value import clipped_value_error

__all__ = [
    "AGGREGATIONS",
    "ALGORITHMS",
    "Algorithm",
    "KL_ESTIMATORS",
    "LossSum",
    "Metric",
    "TrainBatch",
    "advantages",
    "aggregate",
    "aggregation",
    "cispo_loss",
    "clipped_value_error",
    "combine_metrics",
    "compute_metrics",
    "dpo_loss",
    "grpo_loss",
    "gspo_loss",
    "ipo_loss",
    "k1",
    "k2",
    "k3",
    "kl",
    "kl_estimate",
    "kl_reward_penalty",
    "off_policy",
    "p3o_loss",
    "ppo_loss",
    "sequences",
    "sft_loss",
    "value",
]
