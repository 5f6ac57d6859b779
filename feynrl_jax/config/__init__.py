"""Experiment configs: the shared schema, load-time validation and the values derived from a config.

Nothing here imports JAX, so the command line validates a config before any heavy start-up.
"""

from feynrl_jax.config.algorithms import ALGORITHM_TRAITS, PARADIGMS, AlgorithmTraits
from feynrl_jax.config.base import SOURCE_KINDS, add_data_source, base_config, data_source, set_algorithm_hparams
from feynrl_jax.config.derived import BatchPlan, algorithm_hyperparameters, batch_plan
from feynrl_jax.config.errors import ConfigError, Problem
from feynrl_jax.config.validation import validate

__all__ = [
    "ALGORITHM_TRAITS",
    "PARADIGMS",
    "SOURCE_KINDS",
    "AlgorithmTraits",
    "BatchPlan",
    "ConfigError",
    "Problem",
    "add_data_source",
    "algorithm_hyperparameters",
    "base_config",
    "batch_plan",
    "data_source",
    "set_algorithm_hparams",
    "validate",
]
