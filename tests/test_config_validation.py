"""Load-time config validation: shipped configs pass, each bad config fails naming exactly its key."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
from ml_collections import ConfigDict

from feynrl_jax.config import (
    ConfigError,
    add_data_source,
    algorithm_hyperparameters,
    base_config,
    batch_plan,
    data_source,
    set_algorithm_hparams,
    validate,
)
from feynrl_jax.config.variants import parse_variants

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[1] / "configs"
SHIPPED = {
    "grpo_demo": (None, "runlocal", "chain_sum", "dapo", "runlocal,dapo"),
    "sft_smollm2_arith": (None, "runlocal", "packing", "tiny,runlocal"),
    "dpo_smollm2": (None, "runlocal", "tiny"),
    "eval_smollm2": (None, "runlocal", "greedy", "greedy,chain_sum,runlocal"),
    "tiny_rl": (None, "ppo", "dapo", "cispo", "p3o", "gspo", "rloo", "reinforce_pp", "dr_grpo"),
}


def load(name: str, arg: str | None = None) -> ConfigDict:
    spec = importlib.util.spec_from_file_location(f"config_{name}", CONFIG_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config(arg)


@pytest.mark.parametrize("name,arg", [(n, a) for n, args in SHIPPED.items() for a in args])
def test_shipped_configs_validate(name, arg):
    config = load(name, arg)
    assert config.is_locked
    validate(config)
    validate(config, num_devices=8)  # The fake CPU devices of the test suite.


def test_every_config_file_is_covered_and_documents_its_launch_command():
    files = {p.stem for p in CONFIG_DIR.glob("*.py")}
    assert files == set(SHIPPED)
    for name in files:
        module_text = (CONFIG_DIR / f"{name}.py").read_text()
        command = "feynrl-jax eval" if name.startswith("eval") else "feynrl-jax train"
        assert f"{command} --config=configs/{name}.py" in module_text, name


def test_runlocal_shrinks_the_demo():
    full, small = load("grpo_demo"), load("grpo_demo", "runlocal")
    assert small.train.steps < full.train.steps
    assert small.rollout.max_new_tokens < full.rollout.max_new_tokens
    assert small.train.global_batch_size < full.train.global_batch_size
    assert small.run_dir != full.run_dir


def test_unknown_variant_names_the_closest():
    with pytest.raises(ConfigError, match="did you mean runlocal"):
        load("grpo_demo", "runlocl")
    assert parse_variants(" runlocal , dapo", ("runlocal", "dapo")) == {"runlocal", "dapo"}


def rl_config() -> ConfigDict:
    """A valid RL config the table below breaks one key at a time."""
    config = load("tiny_rl")
    config.mesh.data = 2
    config.mesh.fsdp = 2
    return config


def sft_config() -> ConfigDict:
    return load("sft_smollm2_arith")


def _set(path, value, make=rl_config):
    def build():
        config = make()
        *parents, leaf = path.split(".")
        node = config
        for part in parents:
            node = node[part]
        node[leaf] = value
        return config

    return build


def _with(make, *edits):
    def build():
        config = make()
        for edit in edits:
            edit(config)
        return config

    return build


def _unknown_key(config):
    with config.optim.unlocked():
        config.optim.lrr = 1.0


def _bad_source_kind(config):
    add_data_source(config, "extra", data_source("csv", path="x.csv"))


def _jsonl_without_path(config):
    add_data_source(config, "extra", data_source("jsonl"))


def _options_on_a_file_source(config):
    add_data_source(config, "extra", data_source("jsonl", path="x.jsonl", options={"max_terms": 2}))


# (id, build a bad config, the one key the error must name)
BAD_CONFIGS = [
    ("unknown_key", _with(rl_config, _unknown_key), "optim.lrr"),
    ("unknown_paradigm", _set("paradigm", "ppo"), "paradigm"),
    ("unknown_algorithm", _set("algo.name", "grpoo"), "algo.name"),
    ("algorithm_of_other_paradigm", _set("algo.name", "dpo"), "algo.name"),
    ("negative_lr", _set("optim.lr", -1e-5), "optim.lr"),
    ("unknown_schedule", _set("optim.schedule", "linear"), "optim.schedule"),
    ("warmup_longer_than_cosine", _set("optim.warmup_steps", 200, make=sft_config), "optim.warmup_steps"),
    ("b2_of_one", _set("optim.b2", 1.0), "optim.b2"),
    ("zero_eps", _set("optim.eps", 0.0), "optim.eps"),
    ("generation_longer_than_row", _set("rollout.max_new_tokens", 17), "rollout.max_new_tokens"),
    ("prompt_fills_row", _set("data.max_prompt_len", 128), "data.max_prompt_len"),
    (
        "batch_not_divisible_by_dp",
        _with(
            rl_config,
            lambda c: setattr(c.mesh, "fsdp", 4),
            lambda c: setattr(c.train, "global_batch_size", 12),
            lambda c: setattr(c.train, "mini_batches", 1),
            lambda c: setattr(c.train, "micro_batch_size", 0),
        ),
        "train.global_batch_size",
    ),
    (
        "batch_not_whole_groups",
        _with(
            rl_config,
            lambda c: setattr(c.mesh, "fsdp", 1),
            lambda c: setattr(c.train, "global_batch_size", 18),
            lambda c: setattr(c.train, "mini_batches", 1),
            lambda c: setattr(c.train, "micro_batch_size", 2),
        ),
        "train.global_batch_size",
    ),
    ("mini_batches_do_not_split", _set("train.mini_batches", 3), "train.mini_batches"),
    ("micro_batch_does_not_divide", _set("train.micro_batch_size", 3), "train.micro_batch_size"),
    ("kl_without_reference", _set("algo.reference", "none"), "algo.reference"),
    ("dpo_without_reference", _set("algo.reference", "none", make=lambda: load("dpo_smollm2")), "algo.reference"),
    ("group_of_one", _set("rollout.n_samples", 1), "rollout.n_samples"),
    ("negative_kl", _set("algo.kl_coef", -0.1), "algo.kl_coef"),
    ("clip_low_of_one", _set("algo.clip_low", 1.0), "algo.clip_low"),
    ("unknown_loss_agg", _set("algo.loss_agg", "token-mean"), "algo.loss_agg"),
    ("reference_path_missing", _set("algo.reference", "/no/such/model"), "algo.reference"),
    (
        "dynamic_sampling_without_groups",
        _with(lambda: load("tiny_rl", "reinforce_pp"), lambda c: setattr(c.algo, "dynamic_sampling", True)),
        "algo.dynamic_sampling",
    ),
    ("unknown_engine", _set("rollout.engine", "sglang"), "rollout.engine"),
    ("top_p_zero", _set("rollout.top_p", 0.0), "rollout.top_p"),
    ("negative_temperature", _set("rollout.temperature", -1.0), "rollout.temperature"),
    (
        "two_free_mesh_axes",
        _with(rl_config, lambda c: setattr(c.mesh, "fsdp", -1), lambda c: setattr(c.mesh, "data", -1)),
        "mesh.fsdp",
    ),
    ("zero_mesh_axis", _set("mesh.tensor", 0), "mesh.tensor"),
    ("tensor_axis_without_tp_rules", _set("mesh.tensor", 2), "mesh.rules"),
    ("unknown_rules", _set("mesh.rules", "zero3"), "mesh.rules"),
    (
        "no_model",
        _with(
            rl_config, lambda c: setattr(c.model, "random_init", False), lambda c: setattr(c.model, "tokenizer", None)
        ),
        "model.path",
    ),
    ("gguf_missing", _set("model.gguf", "/no/such.gguf", make=sft_config), "model.gguf"),
    ("path_and_gguf", _with(sft_config, lambda c: setattr(c.model, "path", str(CONFIG_DIR))), "model.gguf"),
    ("bad_dtype", _set("model.param_dtype", "fp8"), "model.param_dtype"),
    ("kv_heads_do_not_divide", _set("model.arch.num_kv_heads", 3), "model.arch.num_kv_heads"),
    ("unknown_source_kind", _with(rl_config, _bad_source_kind), "data.sources.extra.kind"),
    ("jsonl_without_path", _with(rl_config, _jsonl_without_path), "data.sources.extra.path"),
    ("options_on_a_file_source", _with(rl_config, _options_on_a_file_source), "data.sources.extra.options"),
    ("zero_source_weight", _set("data.sources.sums.weight", 0.0), "data.sources.sums.weight"),
    ("no_train_source", _set("data.sources.sums.split", "test"), "data.sources"),
    ("no_eval_source", _set("eval.split", "validation"), "eval.split"),
    ("bad_row_policy", _set("data.on_bad_row", "ignore"), "data.on_bad_row"),
    ("zero_steps", _set("train.steps", 0), "train.steps"),
    ("eval_k_above_n", _set("eval.k", (1, 4)), "eval.k"),
    ("eval_generation_too_long", _set("eval.max_new_tokens", 64), "eval.max_new_tokens"),
    ("keep_zero_checkpoints", _set("checkpoint.keep", 0), "checkpoint.keep"),
    (
        "wandb_without_project",
        _with(
            rl_config, lambda c: setattr(c.tracking, "wandb", True), lambda c: setattr(c.tracking, "wandb_project", "")
        ),
        "tracking.wandb_project",
    ),
    ("zero_ray_cpus", _set("ray.num_cpus", 0), "ray.num_cpus"),
    ("negative_staleness", _set("train.max_staleness", -1), "train.max_staleness"),
    ("staleness_outside_rl", _set("train.max_staleness", 1, make=sft_config), "train.max_staleness"),
    ("unknown_off_policy", _set("algo.off_policy", "is"), "algo.off_policy"),
    (
        "tis_without_cap",
        _with(rl_config, lambda c: setattr(c.algo, "off_policy", "tis"), lambda c: setattr(c.algo, "tis_cap", 0.0)),
        "algo.tis_cap",
    ),
    ("negative_tis_cap", _set("algo.tis_cap", -1.0), "algo.tis_cap"),
    ("infinite_tis_cap", _set("algo.tis_cap", float("inf")), "algo.tis_cap"),
    (
        "off_policy_without_recompute",
        _with(
            rl_config,
            lambda c: setattr(c.train, "max_staleness", 1),
            lambda c: setattr(c.train, "recompute_old_logprobs", False),
        ),
        "train.recompute_old_logprobs",
    ),
    ("tis_cap_as_hparam", _with(rl_config, lambda c: set_algorithm_hparams(c, tis_cap=2.0)), "algo.hparams.tis_cap"),
    ("missing_core", _set("rollout.cpu_cores", (0, 4096)), "rollout.cpu_cores"),
    ("repeated_core", _set("train.cpu_cores", (0, 0)), "train.cpu_cores"),
    ("cores_outside_rl", _set("train.cpu_cores", (0,), make=sft_config), "train.cpu_cores"),
    ("empty_run_dir", _set("run_dir", ""), "run_dir"),
]


@pytest.mark.parametrize("build,key", [(b, k) for _, b, k in BAD_CONFIGS], ids=[i for i, _, _ in BAD_CONFIGS])
def test_bad_config_names_its_key(build, key):
    config = build()
    with pytest.raises(ConfigError) as excinfo:
        validate(config)
    assert excinfo.value.keys == (key,), str(excinfo.value)
    assert key in str(excinfo.value)


def test_off_policy_defaults_to_decoupled_when_async():
    from feynrl_jax.config.derived import effective_off_policy

    config = rl_config()
    assert effective_off_policy(config) == "none"
    config.train.max_staleness = 1
    assert effective_off_policy(config) == "decoupled"
    config.algo.off_policy = "none"
    assert effective_off_policy(config) == "none"
    validate(config)


def test_bad_config_table_is_large_and_distinct():
    assert len(BAD_CONFIGS) >= 15
    assert len({i for i, _, _ in BAD_CONFIGS}) == len(BAD_CONFIGS)


def test_suggestions_name_the_closest_valid_value():
    with pytest.raises(ConfigError, match=r"unknown key optim.lrr \(did you mean optim.lr\?\)"):
        validate(_with(rl_config, _unknown_key)())
    with pytest.raises(ConfigError, match=r"did you mean grpo\?"):
        validate(_set("algo.name", "grpoo")())


def test_all_problems_are_reported_together():
    config = rl_config()
    config.optim.lr = -1.0
    config.checkpoint.keep = 0
    with pytest.raises(ConfigError) as excinfo:
        validate(config)
    assert set(excinfo.value.keys) == {"optim.lr", "checkpoint.keep"}


def test_data_parallel_size_is_checked_against_devices_when_an_axis_is_free():
    config = load("tiny_rl")  # mesh.data = -1: unknown until the device count is.
    config.train.global_batch_size = 12
    config.train.mini_batches = 1
    config.train.micro_batch_size = 0
    validate(config)
    validate(config, num_devices=4)
    with pytest.raises(ConfigError) as excinfo:
        validate(config, num_devices=8)
    assert excinfo.value.keys == ("train.global_batch_size",)


def test_explicit_mesh_must_match_device_count():
    with pytest.raises(ConfigError) as excinfo:
        validate(rl_config(), num_devices=8)  # 2 x 2 x 1 = 4 devices.
    assert excinfo.value.keys == ("mesh.data",)


def test_locked_config_rejects_wrong_type_naming_the_field():
    config = base_config()
    with pytest.raises(TypeError, match="lr"):
        config.optim.lr = "fast"
    with pytest.raises(AttributeError, match="lrr"):
        config.optim.lrr = 1.0


def test_batch_plan():
    plan = batch_plan(load("tiny_rl"))
    assert (plan.global_batch_size, plan.mini_batches, plan.mini_batch_size) == (16, 2, 8)
    assert (plan.micro_batch_size, plan.grad_accum_steps, plan.prompts_per_step) == (8, 1, 4)
    config = load("sft_smollm2_arith")
    plan = batch_plan(config)
    assert (plan.mini_batch_size, plan.micro_batch_size, plan.grad_accum_steps) == (32, 16, 2)
    assert plan.prompts_per_step == 32
    config.train.micro_batch_size = 0
    assert batch_plan(config).grad_accum_steps == 1


def test_algorithm_hyperparameters_merge_and_reject():
    accepted = {"clip_low": 0.2, "clip_high": 0.2, "kl_coef": 0.0, "dual_clip": 3.0}
    config = load("tiny_rl")
    config.algo.clip_high = 0.28
    assert algorithm_hyperparameters(config, accepted) == {
        "clip_low": 0.2,
        "clip_high": 0.28,
        "kl_coef": 0.01,
        "dual_clip": 3.0,
    }
    set_algorithm_hparams(config, dual_clp=2.0)
    assert config.algo.hparams.is_locked
    with pytest.raises(ConfigError, match="did you mean dual_clip") as excinfo:
        algorithm_hyperparameters(config, accepted)
    assert excinfo.value.keys == ("algo.hparams.dual_clp",)
    config = load("tiny_rl")
    config.algo.loss_agg = "token_mean"
    with pytest.raises(ConfigError) as excinfo:
        algorithm_hyperparameters(config, accepted)
    assert excinfo.value.keys == ("algo.loss_agg",)


def test_base_config_has_every_section_and_is_locked():
    config = base_config()
    sections = {"model", "data", "optim", "train", "rollout", "algo", "mesh", "checkpoint", "tracking", "eval", "ray"}
    assert sections <= set(config.keys())
    assert {"paradigm", "name", "run_dir", "seed"} <= set(config.keys())
    assert config.is_locked and config.data.sources.is_locked
    add_data_source(config, "a", data_source("reasoning_gym", task="chain_sum"))
    assert config.data.sources.is_locked and config.data.sources.a.is_locked
    config.data.sources.a.weight = 0.5  # What --config.data.sources.a.weight=0.5 does.
    assert config.data.sources.a.weight == 0.5


def test_dpo_batches_count_pairs_as_two_rows_for_data_parallelism():
    """4 pairs are 8 rows: they split over 8 data-parallel devices although 4 sequences would not."""
    config = load("dpo_smollm2", "tiny")
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 8, 1, 1
    config.train.global_batch_size, config.train.mini_batches, config.train.micro_batch_size = 4, 1, 0
    validate(config, num_devices=8)
    config.train.global_batch_size = 3
    with pytest.raises(ConfigError, match=r"global_batch_size=3 pairs \(2 rows each\)"):
        validate(config, num_devices=8)


def test_reasoning_gym_options_are_keys_the_command_line_can_set():
    from feynrl_jax.config.validation import known_keys
    from feynrl_jax.data.from_config import build_source

    config = rl_config()
    options = {"min_terms": 3, "max_terms": 3, "max_digits": 1}
    add_data_source(config, "small", data_source("reasoning_gym", task="basic_arithmetic", size=8, options=options))
    assert "data.sources.small.options.max_terms" in known_keys(config)
    config.data.sources.small.options.min_terms = 2
    config.data.sources.small.options.max_terms = 2
    validate(config)
    source = build_source("small", config.data.sources.small, paradigm="rl", on_bad_row="error")
    terms = {example["metadata"]["entry"]["metadata"]["num_terms"] for example in source.examples}
    assert terms == {2}
