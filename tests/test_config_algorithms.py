"""The config package's JAX-free algorithm table agrees with the registry of record, `feynrl_jax.losses`."""

from __future__ import annotations

from feynrl_jax import losses
from feynrl_jax.config import ALGORITHM_TRAITS
from feynrl_jax.config.derived import SHARED_HYPERPARAMETERS
from feynrl_jax.config.validation import LOSS_AGGREGATIONS


def test_same_algorithm_names():
    assert set(ALGORITHM_TRAITS) == set(losses.ALGORITHMS)


def test_same_properties():
    for name, algorithm in losses.ALGORITHMS.items():
        traits = ALGORITHM_TRAITS[name]
        advantage = algorithm.advantage_fn.__name__ if algorithm.advantage_fn is not None else None
        registry = (algorithm.paradigm, algorithm.needs_reference, algorithm.needs_critic, advantage)
        table = (traits.paradigm, traits.needs_reference, traits.needs_critic, traits.advantage)
        assert table == registry, f"feynrl_jax/config/algorithms.py row {name!r} disagrees with the registry"


def test_group_based_algorithms_use_a_group_estimator():
    group_estimators = {"group_zscore", "group_mean", "rloo"}
    for name, algorithm in losses.ALGORITHMS.items():
        advantage = algorithm.advantage_fn.__name__ if algorithm.advantage_fn is not None else None
        assert ALGORITHM_TRAITS[name].group_based == (advantage in group_estimators), name


def test_loss_aggregations_match():
    assert set(LOSS_AGGREGATIONS) == set(losses.AGGREGATIONS)


def test_shared_hyperparameters_are_loss_keywords():
    """`algo.kl_coef`, `algo.clip_*`, `algo.loss_agg` each feed at least one registered loss."""
    accepted = set().union(*(a.hyperparameters for a in losses.ALGORITHMS.values()))
    assert set(SHARED_HYPERPARAMETERS) <= accepted


def test_every_tiny_rl_variant_builds_its_loss():
    """The kwargs `algorithm_hyperparameters` derives from each shipped RL config are accepted by the loss."""
    import importlib.util
    import pathlib

    from feynrl_jax.config import algorithm_hyperparameters, validate

    path = pathlib.Path(__file__).resolve().parents[1] / "configs" / "tiny_rl.py"
    spec = importlib.util.spec_from_file_location("tiny_rl", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rl_names = [name for name, a in losses.ALGORITHMS.items() if a.paradigm == "rl"]
    for name in rl_names:
        config = module.get_config(name)
        validate(config)
        algorithm = losses.ALGORITHMS[config.algo.name]
        kwargs = algorithm_hyperparameters(config, algorithm.hyperparameters)
        assert set(kwargs) == set(algorithm.hyperparameters), name
        assert callable(algorithm.make_loss(**kwargs))
