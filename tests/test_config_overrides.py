"""Command-line overrides: parsed like absl does, checked with the key, the expected type and a suggestion."""

from __future__ import annotations

import pytest

from feynrl_jax.config import ConfigError, add_data_source, base_config, data_source
from feynrl_jax.config.overrides import Override, check_overrides, parse_argv


def test_parse_argv_forms():
    argv = [
        "train",
        "--config=configs/x.py:runlocal",
        "--config.optim.lr=3e-6",
        "--config.train.steps",
        "5",
        "--noconfig.tracking.wandb",
        "--config.checkpoint.resume",
        "--resume",
        "--config.eval.k=(1, 2)",
    ]
    spec, overrides = parse_argv(argv)
    assert spec == "configs/x.py:runlocal"
    assert overrides == [
        Override("optim.lr", "3e-6"),
        Override("train.steps", "5", separate=True),
        Override("tracking.wandb", None, negated=True),
        Override("checkpoint.resume", None),
        Override("eval.k", "(1, 2)"),
    ]
    assert parse_argv(["--config", "a.py"]) == ("a.py", [])
    assert parse_argv(["--configs=a.py", "--", "--config.x=1"]) == (None, [])


def config_with_source():
    config = base_config()
    add_data_source(config, "arith", data_source("reasoning_gym", task="chain_sum"))
    return config


BAD_OVERRIDES = [
    ("optim.lrr", "1", "optim.lrr", "unknown key optim.lrr (did you mean optim.lr?)"),
    ("optim.lr", "fast", "optim.lr", "optim.lr expects float, got 'fast'"),
    ("train.steps", "2.5", "train.steps", "train.steps expects int, got '2.5'"),
    ("tracking.wandb", "maybe", "tracking.wandb", "tracking.wandb expects bool, got 'maybe'"),
    ("data.sources.arith.weigth", "0.5", "data.sources.arith.weigth", "did you mean data.sources.arith.weight?"),
    ("rollout.nsamples", "4", "rollout.nsamples", "did you mean rollout.n_samples?"),
    ("algo.kl_coef", "high", "algo.kl_coef", "algo.kl_coef expects float, got 'high'"),
    ("ray.num_cpus", "all", "ray.num_cpus", "ray.num_cpus expects int, got 'all'"),
]


@pytest.mark.parametrize("path,raw,key,message", BAD_OVERRIDES)
def test_bad_override_names_key_type_and_value(path, raw, key, message):
    with pytest.raises(ConfigError) as excinfo:
        check_overrides(config_with_source(), [Override(path, raw)])
    assert excinfo.value.keys == (key,)
    assert message in str(excinfo.value)


def test_good_overrides_pass():
    check_overrides(
        config_with_source(),
        [
            Override("optim.lr", "3e-6"),
            Override("optim.lr", "1"),
            Override("train.steps", "7"),
            Override("tracking.wandb", "true"),
            Override("tracking.wandb", None, negated=True),
            Override("data.sources.arith.weight", "0.5"),
            Override("model.gguf", "smollm2"),
            Override("algo.kl_coef", "0.1"),
            Override("eval.k", "(1, 2)"),
        ],
    )


def test_negated_non_bool_and_missing_value():
    with pytest.raises(ConfigError) as excinfo:
        check_overrides(base_config(), [Override("optim.lr", None, negated=True), Override("train.steps", None)])
    assert excinfo.value.keys == ("optim.lr", "train.steps")
