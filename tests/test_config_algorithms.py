"""`algo.name`: the one registry the config layer and the loops share, and algorithms from outside the package.

A built-in name is a lookup in `feynrl_jax.losses.registry` (plain data: validation imports no JAX, see
tests/test_config_validation.py). A "module:function" name imports the user's module; `register_algorithm`
registers a short name in this process.
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import sys
import textwrap

import pytest

from feynrl_jax import losses
from feynrl_jax.config import ConfigError, algorithm_hyperparameters, validate
from feynrl_jax.config.derived import SHARED_HYPERPARAMETERS
from feynrl_jax.config.validation import LOSS_AGGREGATIONS
from feynrl_jax.losses import registry

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"

USER_MODULE = textwrap.dedent(
    '''
    """A researcher's losses, outside the package."""
    import jax.numpy as jnp

    from feynrl_jax.losses import aggregate, register_algorithm


    def reinforce(logprobs, batch, *, entropy=None, values=None, scale=1.0, loss_agg="token_mean", max_tokens=None):
        per_token = -scale * batch.advantages * logprobs
        return aggregate(per_token, batch.loss_mask, batch.segment_ids, mode=loss_agg, max_tokens=max_tokens), {}


    def leave_one_out(logprobs, batch, *, temperature=1.0):
        per_token = -batch.advantages * logprobs / temperature
        return aggregate(per_token, batch.loss_mask, batch.segment_ids, mode="token_mean"), {}


    LOO = register_algorithm("user_loo", leave_one_out, "rloo", needs_reference=False)


    def registered(logprobs, batch, *, beta=0.1):
        return aggregate(-batch.advantages * logprobs * beta, batch.loss_mask, batch.segment_ids, mode="token_mean"), {}


    register_algorithm("user_registered", registered, "group_mean")
    registered_alias = registered


    def no_default(logprobs, batch, *, clip):
        return aggregate(-batch.advantages * logprobs, batch.loss_mask, batch.segment_ids, mode="token_mean"), {}


    NOT_A_LOSS = 3


    def with_kl(logprobs, batch, *, kl_coef=0.05):
        return aggregate(-batch.advantages * logprobs, batch.loss_mask, batch.segment_ids, mode="token_mean"), {}


    def with_entropy(logprobs, batch, *, entropy=None, entropy_coef=0.01):
        per_token = -batch.advantages * logprobs - entropy_coef * entropy
        return aggregate(per_token, batch.loss_mask, batch.segment_ids, mode="token_mean"), {}
    '''
)


@pytest.fixture
def user_module(tmp_path, monkeypatch, algorithm_registry):
    """`user_losses` importable from a folder on sys.path; the registry is restored afterwards."""
    (tmp_path / "user_losses.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "user_losses"
    sys.modules.pop("user_losses", None)


def load_config(name: str, variant: str | None = None):
    spec = importlib.util.spec_from_file_location(name, CONFIGS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(variant) if variant else module.get_config()


def tiny_rl(algo_name: str):
    config = load_config("tiny_rl")
    config.algo.name = algo_name
    config.algo.reference = "none"
    config.algo.kl_coef = None
    return config


def test_builtin_records_resolve():
    for name in registry.BUILTIN_ALGORITHMS:
        algorithm = losses.ALGORITHMS[name]
        assert callable(algorithm.loss_fn) and algorithm.hyperparameters
        if algorithm.paradigm == "rl":
            assert algorithm.advantage_fn.__name__ == algorithm.advantage
            assert algorithm.group_based == (algorithm.advantage in registry.GROUP_ADVANTAGES)
        else:
            assert algorithm.advantage_fn is None


def test_loss_aggregations_match():
    assert set(LOSS_AGGREGATIONS) == set(losses.AGGREGATIONS)


def test_shared_hyperparameters_are_loss_keywords():
    """`algo.kl_coef`, `algo.clip_*`, `algo.loss_agg` each feed at least one registered loss."""
    accepted = set().union(*(a.hyperparameters for a in losses.ALGORITHMS.values()))
    assert set(SHARED_HYPERPARAMETERS) <= accepted


def test_every_tiny_rl_variant_builds_its_loss():
    """The kwargs `algorithm_hyperparameters` derives from each shipped RL config are accepted by the loss."""
    rl_names = [name for name, a in losses.ALGORITHMS.items() if a.paradigm == "rl"]
    for name in rl_names:
        config = load_config("tiny_rl", name)
        validate(config)
        algorithm = losses.ALGORITHMS[config.algo.name]
        kwargs = algorithm_hyperparameters(config, algorithm.hyperparameters)
        assert set(kwargs) == set(algorithm.hyperparameters), name
        assert callable(algorithm.make_loss(**kwargs))


def test_a_module_function_name_is_a_plain_rl_loss(user_module):
    config = tiny_rl(f"{user_module}:reinforce")
    config.algo.hparams = {"scale": 2.0}
    validate(config)
    algorithm = losses.get_algorithm(config.algo.name)
    assert algorithm is losses.get_algorithm(config.algo.name)  # One record: a jitted step is reused.
    assert (algorithm.paradigm, algorithm.advantage, algorithm.needs_reference, algorithm.needs_critic) == (
        "rl",
        "group_zscore",
        False,
        False,
    )
    assert algorithm.advantage_fn is losses.advantages.group_zscore
    assert algorithm.loss_fn is sys.modules[user_module].reinforce
    kwargs = algorithm_hyperparameters(config, algorithm.hyperparameters)
    assert kwargs == {"scale": 2.0, "loss_agg": "token_mean", "max_tokens": None}


def test_a_name_may_point_at_a_registered_record_or_loss(user_module):
    loo = losses.get_algorithm(f"{user_module}:LOO")
    assert loo is sys.modules[user_module].LOO and loo.name == "user_loo"
    assert loo.advantage_fn is losses.advantages.rloo and loo.group_based
    # The function of a registered record keeps that record's traits, under any name that reaches it.
    for reference in (f"{user_module}:registered", f"{user_module}:registered_alias"):
        record = losses.get_algorithm(reference)
        assert record.advantage == "group_mean" and record.name == reference
    assert f"{user_module}:registered" not in registry.ALGORITHMS  # A reference is not a registration.
    # The short name works in the process that registered it.
    validate(tiny_rl("user_registered"))
    # A function registered twice is ambiguous (registering clears the references resolved so far).
    registry.register_algorithm("user_registered_again", sys.modules[user_module].registered, "rloo")
    with pytest.raises(ConfigError, match="name one of those records") as error:
        validate(tiny_rl(f"{user_module}:registered_alias"))
    assert error.value.keys == ("algo.name",)


def test_a_loss_registered_by_reference_keeps_its_traits(user_module):
    registry.register_algorithm("by_reference", f"{user_module}:reinforce", "rloo")
    record = losses.get_algorithm(f"{user_module}:reinforce")
    assert record.advantage == "rloo" and record.loss_fn is importlib.import_module(user_module).reinforce


def test_a_plain_loss_gets_the_reference_and_entropy_its_keywords_ask_for(user_module):
    with_kl = losses.get_algorithm(f"{user_module}:with_kl")
    assert with_kl.needs_reference and not with_kl.uses_entropy
    with_entropy = losses.get_algorithm(f"{user_module}:with_entropy")
    assert with_entropy.uses_entropy and not with_entropy.needs_reference
    config = tiny_rl(f"{user_module}:with_kl")  # algo.reference="none": the default KL needs a reference.
    with pytest.raises(ConfigError, match="uses a reference model") as error:
        validate(config)
    assert error.value.keys == ("algo.reference",)


def test_a_record_that_contradicts_its_loss_is_refused(user_module):
    module = importlib.import_module(user_module)
    registry.register_algorithm("kl_without_reference", module.with_kl)
    registry.register_algorithm("entropy_never_given", module.with_entropy)
    for name, message in (("kl_without_reference", "needs_reference=False"), ("entropy_never_given", "uses_entropy")):
        with pytest.raises(ConfigError, match=message) as error:
            validate(tiny_rl(name))
        assert error.value.keys == ("algo.name",)


@pytest.mark.parametrize(
    ("body", "raised"), [("def broken(:\n", "SyntaxError"), ("raise RuntimeError('no GPU')\n", "RuntimeError")]
)
def test_a_module_that_fails_to_import_is_a_config_error(tmp_path, monkeypatch, algorithm_registry, body, raised):
    (tmp_path / "broken_losses.py").write_text(body)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match=f"raised {raised}") as error:
        validate(tiny_rl("broken_losses:loss"))
    assert error.value.keys == ("algo.name",)
    sys.modules.pop("broken_losses", None)


def test_the_traits_reach_validation(user_module):
    reinforce = importlib.import_module(user_module).reinforce
    registry.register_algorithm("user_groups", reinforce, "rloo")
    config = tiny_rl("user_groups")
    config.rollout.n_samples = 1
    config.train.global_batch_size = 8
    config.train.micro_batch_size = 4
    with pytest.raises(ConfigError, match="needs at least 2") as error:
        validate(config)
    assert "rollout.n_samples" in error.value.keys
    registry.register_algorithm("user_sft", reinforce, None, paradigm="sft")
    with pytest.raises(ConfigError, match="is a sft algorithm") as error:
        validate(tiny_rl("user_sft"))
    registry.register_algorithm("user_ref", reinforce, needs_reference=True)
    with pytest.raises(ConfigError, match="uses a reference model") as error:
        validate(tiny_rl("user_ref"))
    assert error.value.keys == ("algo.reference",)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("no_such_module_xyz:loss", "cannot import module 'no_such_module_xyz'"),
        ("user_losses:missing", "has no attribute 'missing'"),
        ("user_losses:NOT_A_LOSS", "neither an Algorithm nor a loss function"),
        ("user_losses:no_default", "need a default value"),
        ("user_losses:", "is not a 'package.module:function' reference"),
        ("grpoo", "did you mean grpo"),
    ],
)
def test_a_bad_name_is_a_config_error_naming_algo_name(user_module, name, message):
    with pytest.raises(ConfigError, match=message) as error:
        validate(tiny_rl(name))
    assert error.value.keys == ("algo.name",)


def test_shared_keys_a_users_loss_lacks(user_module):
    """`algo.kl_coef=0` (the demo's "no KL") suits a loss without a KL term; any other shared value is refused."""
    config = tiny_rl(f"{user_module}:reinforce")
    config.algo.kl_coef = 0.0
    algorithm = losses.get_algorithm(config.algo.name)
    assert "kl_coef" not in algorithm_hyperparameters(config, algorithm.hyperparameters)
    config.algo.kl_coef = 0.05
    with pytest.raises(ConfigError, match="takes no kl_coef") as error:
        algorithm_hyperparameters(config, algorithm.hyperparameters)
    assert error.value.keys == ("algo.kl_coef",)
    config.algo.kl_coef = None
    config.algo.clip_low = 0.1
    with pytest.raises(ConfigError, match="takes no clip_low"):
        algorithm_hyperparameters(config, algorithm.hyperparameters)


def test_an_unknown_hyperparameter_of_a_users_loss_names_its_key(user_module):
    config = tiny_rl(f"{user_module}:reinforce")
    config.algo.hparams = {"scael": 2.0}
    with pytest.raises(ConfigError, match="did you mean scale") as error:
        validate(config)  # At validation, before Ray or a trainer starts.
    assert error.value.keys == ("algo.hparams.scael",)


def test_a_loss_without_off_policy_keywords_refuses_an_off_policy_run(user_module):
    from feynrl_jax.train.rl_trainer import algorithm_values

    config = tiny_rl(f"{user_module}:reinforce")
    validate(config)
    assert "decoupled" not in algorithm_values(config)  # Sync: nothing to correct.
    config.train.max_staleness = 1
    with pytest.raises(ConfigError, match="takes no `decoupled` and `tis_cap`") as error:
        validate(config)
    assert error.value.keys == ("algo.off_policy",)
    with pytest.raises(ConfigError, match="takes no `decoupled` and `tis_cap`"):
        algorithm_values(config)  # The trainer holds to it too.
    config.algo.off_policy = "none"
    validate(config)


def test_register_algorithm_checks_its_traits():
    reinforce = losses.grpo_loss
    with pytest.raises(ValueError, match="built-in"):
        registry.register_algorithm("grpo", reinforce)
    with pytest.raises(ValueError, match="has no ':'"):
        registry.register_algorithm("pkg:loss", reinforce)
    with pytest.raises(ValueError, match="paradigm must be one of"):
        registry.algorithm("x", reinforce, paradigm="ppo")
    with pytest.raises(ValueError, match="needs an advantage estimator"):
        registry.algorithm("x", reinforce, None)
    with pytest.raises(ValueError, match="no advantage estimator"):
        registry.algorithm("x", reinforce, "rloo", paradigm="dpo")
    with pytest.raises(ValueError, match="not an estimator"):
        registry.algorithm("x", reinforce, "group_zscor")
    with pytest.raises(ValueError, match="GAE advantages and needs_critic"):
        registry.algorithm("x", reinforce, "gae")
    with pytest.raises(ValueError, match="group_based"):
        registry.algorithm("x", reinforce, lambda rewards, group_id, mask: mask)
    record = registry.algorithm("x", reinforce, lambda rewards, group_id, mask: mask, group_based=False)
    assert not record.group_based
    with pytest.raises(ValueError, match="has no keyword"):
        registry.algorithm("x", reinforce, clip_hihg=0.3).hyperparameters  # noqa: B018
