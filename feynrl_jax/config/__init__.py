"""Experiment configs: the shared schema, load-time validation and the values derived from a config.

Nothing here imports JAX, so the command line validates a config before any heavy start-up. The algorithms a
config may name are the registry's (`feynrl_jax.losses.registry`, plain data until a loss is used), re-exported
here for experiment files.
"""

from feynrl_jax.config.base import SOURCE_KINDS, add_data_source, base_config, data_source, set_algorithm_hparams
from feynrl_jax.config.derived import BatchPlan, algorithm_hyperparameters, batch_plan
from feynrl_jax.config.errors import ConfigError, Problem
from feynrl_jax.config.validation import PARADIGMS, validate
from feynrl_jax.losses.registry import ALGORITHMS, get_algorithm, register_algorithm

__all__ = [
    "ALGORITHMS",
    "PARADIGMS",
    "SOURCE_KINDS",
    "BatchPlan",
    "ConfigError",
    "Problem",
    "add_data_source",
    "algorithm_hyperparameters",
    "base_config",
    "batch_plan",
    "data_source",
    "get_algorithm",
    "register_algorithm",
    "set_algorithm_hparams",
    "validate",
]
