"""Load-time config validation: shipped configs pass, each bad config fails naming exactly its key."""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys
import textwrap

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
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
    validation,
)
from feynrl_jax.config.validation import cpu_device_count_hint, flatten
from feynrl_jax.config.variants import parse_variants

CONFIG_DIR = pathlib.Path(__file__).resolve().parents[1] / "configs"
SHIPPED = {
    "grpo_demo": (None, "runlocal", "chain_sum", "dapo", "runlocal,dapo"),
    "sft_smollm2_arith": (None, "runlocal", "packing", "tiny,runlocal"),
    "dpo_smollm2": (None, "runlocal", "tiny"),
    "eval_smollm2": (None, "runlocal", "greedy", "greedy,chain_sum,runlocal"),
    "tiny_rl": (None, "ppo", "dapo", "cispo", "p3o", "gspo", "rloo", "reinforce_pp", "dr_grpo"),
}
NAN, INF = float("nan"), float("inf")


@pytest.fixture(autouse=True)
def unknown_device_count(monkeypatch):
    """Validates as a CLI that cannot count the devices; the suite's 8 fake CPU devices would otherwise count.

    `validate(config)` asks `cpu_device_count_hint()` when no count is given; its own tests below set it.
    """
    monkeypatch.setattr(validation, "cpu_device_count_hint", lambda: None)


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


def _parent(config, path):
    """The section holding the dotted `path`, and the key's name in it."""
    *parents, leaf = path.split(".")
    node = config
    for part in parents:
        node = node[part]
    return node, leaf


def _set(path, value, make=rl_config):
    def build():
        config = make()
        node, leaf = _parent(config, path)
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


def _nan_reward_argument(config):
    config.rollout.reward_kwargs = {"reasoning_gym": {"x": NAN}}


# (id, build a bad config, the one key the error must name, a part of its message)
BAD_CONFIGS = [
    ("unknown_key", _with(rl_config, _unknown_key), "optim.lrr", "unknown key optim.lrr (did you mean optim.lr?)"),
    ("unknown_paradigm", _set("paradigm", "ppo"), "paradigm", "is not one of"),
    (
        "unknown_algorithm",
        _set("algo.name", "grpoo"),
        "algo.name",
        "is not a registered algorithm (did you mean grpo?)",
    ),
    ("algorithm_of_other_paradigm", _set("algo.name", "dpo"), "algo.name", "is a dpo algorithm"),
    ("negative_lr", _set("optim.lr", -1e-5), "optim.lr", "must be positive"),
    ("zero_lr", _set("optim.lr", 0.0), "optim.lr", "must be positive"),
    ("unknown_schedule", _set("optim.schedule", "linear"), "optim.schedule", "is not one of"),
    (
        "warmup_longer_than_cosine",
        _set("optim.warmup_steps", 200, make=sft_config),
        "optim.warmup_steps",
        "leaves nothing of the",
    ),
    ("b2_of_one", _set("optim.b2", 1.0), "optim.b2", "must be in [0, 1)"),
    # 1 in float32: Adam's bias correction 1 - b2**t would be 0, and the update infinite.
    ("b2_of_one_in_float32", _set("optim.b2", 0.99999999), "optim.b2", "below 1 in float32 (at most 1 - 2**-24)"),
    ("zero_eps", _set("optim.eps", 0.0), "optim.eps", "must be at least 1.175e-38"),
    # 0 in float32: a weight whose gradient has always been 0 would get 0 / 0.
    ("subnormal_eps", _set("optim.eps", 1e-45), "optim.eps", "(float32's smallest normal number)"),
    (
        "generation_longer_than_row",
        _set("rollout.max_new_tokens", 17),
        "rollout.max_new_tokens",
        "plus data.max_prompt_len=112 exceeds data.max_seq_len=128",
    ),
    ("prompt_fills_row", _set("data.max_prompt_len", 128), "data.max_prompt_len", "leaves no room for"),
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
        "sequences is not divisible",
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
        "is not a whole number of groups",
    ),
    (
        "mini_batches_do_not_split",
        _set("train.mini_batches", 3),
        "train.mini_batches",
        "does not split into train.mini_batches=3",
    ),
    ("micro_batch_does_not_divide", _set("train.micro_batch_size", 3), "train.micro_batch_size", "does not divide the"),
    (
        "kl_without_reference",
        _set("algo.reference", "none"),
        "algo.reference",
        "penalises the distance to a reference model",
    ),
    (
        "dpo_without_reference",
        _set("algo.reference", "none", make=lambda: load("dpo_smollm2")),
        "algo.reference",
        "dpo compares against a",
    ),
    ("group_of_one", _set("rollout.n_samples", 1), "rollout.n_samples", "grpo compares samples within"),
    ("negative_kl", _set("algo.kl_coef", -0.1), "algo.kl_coef", "is negative"),
    ("clip_low_of_one", _set("algo.clip_low", 1.0), "algo.clip_low", "must be below 1"),
    ("unknown_loss_agg", _set("algo.loss_agg", "token-mean"), "algo.loss_agg", "is not one of"),
    (
        "reference_path_missing",
        _set("algo.reference", "/no/such/model"),
        "algo.reference",
        "is neither 'none', 'initial'",
    ),
    (
        "dynamic_sampling_without_groups",
        _with(lambda: load("tiny_rl", "reinforce_pp"), lambda c: setattr(c.algo, "dynamic_sampling", True)),
        "algo.dynamic_sampling",
        "drops groups with equal",
    ),
    ("unknown_engine", _set("rollout.engine", "sglang"), "rollout.engine", "is not one of"),
    ("top_p_zero", _set("rollout.top_p", 0.0), "rollout.top_p", "must be in (0, 1]"),
    ("negative_temperature", _set("rollout.temperature", -1.0), "rollout.temperature", "must be at least"),
    (
        "two_free_mesh_axes",
        _with(rl_config, lambda c: setattr(c.mesh, "fsdp", -1), lambda c: setattr(c.mesh, "data", -1)),
        "mesh.fsdp",
        "only one mesh axis",
    ),
    ("zero_mesh_axis", _set("mesh.tensor", 0), "mesh.tensor", "must be a positive"),
    ("tensor_axis_without_tp_rules", _set("mesh.tensor", 2), "mesh.rules", "needs mesh.rules='fsdp_tp'"),
    ("unknown_rules", _set("mesh.rules", "zero3"), "mesh.rules", "is not one of"),
    (
        "no_model",
        _with(
            rl_config, lambda c: setattr(c.model, "random_init", False), lambda c: setattr(c.model, "tokenizer", None)
        ),
        "model.path",
        "is unset: set model.path",
    ),
    ("gguf_missing", _set("model.gguf", "/no/such.gguf", make=sft_config), "model.gguf", "is not a file"),
    (
        "path_and_gguf",
        _with(sft_config, lambda c: setattr(c.model, "path", str(CONFIG_DIR))),
        "model.gguf",
        "and model.path are both",
    ),
    ("bad_dtype", _set("model.param_dtype", "fp8"), "model.param_dtype", "is not one of"),
    ("bf16_masters", _set("model.master_dtype", "bfloat16"), "model.master_dtype", "is not one of '', 'float32'"),
    ("no_heartbeat", _set("distributed.heartbeat_timeout_s", 0), "distributed.heartbeat_timeout_s", "at least 1"),
    ("no_trainer", _set("ray.trainer_processes", 0), "ray.trainer_processes", "at least 1"),
    (
        "no_join_time",
        _set("distributed.initialization_timeout_s", -5),
        "distributed.initialization_timeout_s",
        "at least 1",
    ),
    (
        "kv_heads_do_not_divide",
        _set("model.arch.num_kv_heads", 3),
        "model.arch.num_kv_heads",
        "must divide model.arch.num_heads=4",
    ),
    ("unknown_source_kind", _with(rl_config, _bad_source_kind), "data.sources.extra.kind", "is not one of"),
    ("jsonl_without_path", _with(rl_config, _jsonl_without_path), "data.sources.extra.path", "is unset but a"),
    (
        "options_on_a_file_source",
        _with(rl_config, _options_on_a_file_source),
        "data.sources.extra.options",
        "is only read by",
    ),
    ("zero_source_weight", _set("data.sources.sums.weight", 0.0), "data.sources.sums.weight", "must be positive"),
    ("no_train_source", _set("data.sources.sums.split", "test"), "data.sources", "has no source with"),
    ("no_eval_source", _set("eval.split", "validation"), "eval.split", "matches no source in"),
    ("bad_row_policy", _set("data.on_bad_row", "ignore"), "data.on_bad_row", "is not one of"),
    ("zero_steps", _set("train.steps", 0), "train.steps", "must be at least"),
    ("eval_k_above_n", _set("eval.k", (1, 4)), "eval.k", "must list integers between 1 and eval.n_samples=2"),
    (
        "eval_generation_too_long",
        _set("eval.max_new_tokens", 64),
        "eval.max_new_tokens",
        "plus data.max_prompt_len=112 exceeds data.max_seq_len=128",
    ),
    ("keep_zero_checkpoints", _set("checkpoint.keep", 0), "checkpoint.keep", "must be at least"),
    (
        "wandb_without_project",
        _with(
            rl_config, lambda c: setattr(c.tracking, "wandb", True), lambda c: setattr(c.tracking, "wandb_project", "")
        ),
        "tracking.wandb_project",
        "tracking.wandb is on but",
    ),
    ("zero_ray_cpus", _set("ray.num_cpus", 0), "ray.num_cpus", "must be at least"),
    ("negative_staleness", _set("train.max_staleness", -1), "train.max_staleness", "must be at least"),
    ("staleness_outside_rl", _set("train.max_staleness", 1, make=sft_config), "train.max_staleness", "is read by RL"),
    ("unknown_off_policy", _set("algo.off_policy", "is"), "algo.off_policy", "is not one of"),
    (
        "tis_without_cap",
        _with(rl_config, lambda c: setattr(c.algo, "off_policy", "tis"), lambda c: setattr(c.algo, "tis_cap", 0.0)),
        "algo.tis_cap",
        "algo.off_policy='tis' truncates its importance",
    ),
    ("negative_tis_cap", _set("algo.tis_cap", -1.0), "algo.tis_cap", "must be a finite number >= 0"),
    ("infinite_tis_cap", _set("algo.tis_cap", float("inf")), "algo.tis_cap", "must be a finite"),
    (
        "off_policy_without_recompute",
        _with(
            rl_config,
            lambda c: setattr(c.train, "max_staleness", 1),
            lambda c: setattr(c.train, "recompute_old_logprobs", False),
        ),
        "train.recompute_old_logprobs",
        "algo.off_policy='decoupled' weights tokens by",
    ),
    (
        "tis_cap_as_hparam",
        _with(rl_config, lambda c: set_algorithm_hparams(c, tis_cap=2.0)),
        "algo.hparams.tis_cap",
        "is set by algo.off_policy",
    ),
    (
        "missing_core",
        _set("rollout.cpu_cores", (0, 4096)),
        "rollout.cpu_cores",
        "names a core this machine does not have",
    ),
    ("repeated_core", _set("train.cpu_cores", (0, 0)), "train.cpu_cores", "must list distinct CPU core numbers"),
    ("cores_outside_rl", _set("train.cpu_cores", (0,), make=sft_config), "train.cpu_cores", "pins Ray actors"),
    ("empty_run_dir", _set("run_dir", ""), "run_dir", "must not be empty"),
    # Non-finite values (the hypothesis test below covers every float key; these are the reported ones).
    ("infinite_lr", _set("optim.lr", INF), "optim.lr", "optim.lr=inf must be a finite number."),
    ("nan_temperature", _set("rollout.temperature", NAN), "rollout.temperature", "=nan must be a finite number."),
    ("nan_max_grad_norm", _set("optim.max_grad_norm", NAN), "optim.max_grad_norm", "=nan must be a finite number."),
    ("nan_kl_coef", _set("algo.kl_coef", NAN), "algo.kl_coef", "algo.kl_coef=nan must be a finite number."),
    ("nan_weight_decay", _set("optim.weight_decay", NAN), "optim.weight_decay", "=nan must be a finite number."),
    ("nan_hparam", _with(rl_config, lambda c: set_algorithm_hparams(c, delta=NAN)), "algo.hparams.delta", "=nan must"),
    ("infinite_source_weight", _set("data.sources.sums.weight", INF), "data.sources.sums.weight", "=inf must be"),
    ("nan_reward_weight", _set("rollout.rewards.reasoning_gym", NAN), "rollout.rewards.reasoning_gym", "=nan must"),
    ("nan_reward_argument", _with(rl_config, _nan_reward_argument), "rollout.reward_kwargs.reasoning_gym.x", "=nan"),
    ("infinite_success_threshold", _set("eval.success_threshold", -INF), "eval.success_threshold", "=-inf must be"),
    # Values out of their documented range.
    ("zero_reward_timeout", _set("rollout.reward_timeout_s", 0.0), "rollout.reward_timeout_s", "must be positive"),
    ("zero_reward_workers", _set("rollout.reward_workers", 0), "rollout.reward_workers", "=0 must be at least 1"),
    ("negative_max_retries", _set("rollout.max_retries", -1), "rollout.max_retries", "=-1 must be at least 0"),
    (
        "failure_frac_above_one",
        _set("rollout.max_reward_failure_frac", 1.5),
        "rollout.max_reward_failure_frac",
        "=1.5 must be in [0, 1]",
    ),
    ("negative_max_restarts", _set("ray.max_restarts", -1), "ray.max_restarts", "=-1 must be at least 0"),
    ("zero_stall_timeout", _set("ray.stall_timeout_s", 0.0), "ray.stall_timeout_s", "=0.0 must be positive"),
    ("negative_clip_high", _set("algo.clip_high", -0.1), "algo.clip_high", "=-0.1 is negative"),
    ("negative_critic_lr", _set("algo.critic_lr", -1e-5), "algo.critic_lr", "must be positive"),
    ("zero_critic_lr", _set("algo.critic_lr", 0.0), "algo.critic_lr", "must be positive"),
    ("gae_gamma_above_one", _set("algo.gae_gamma", 1.5), "algo.gae_gamma", "=1.5 must be in [0, 1]"),
    ("negative_gae_lambda", _set("algo.gae_lambda", -0.1), "algo.gae_lambda", "=-0.1 must be in [0, 1]"),
    ("negative_refill_draws", _set("algo.max_refill_draws", -1), "algo.max_refill_draws", "must be at least 0"),
    ("unknown_reference_mode", _set("algo.reference_mode", "cached"), "algo.reference_mode", "is not one of"),
    ("negative_shuffle_seed", _set("data.shuffle_seed", -1), "data.shuffle_seed", "=-1 must be at least 0"),
    ("negative_checkpoint_every", _set("checkpoint.every_steps", -1), "checkpoint.every_steps", "must be at least 0"),
    # Rewards: names the registry knows, import paths that import.
    (
        "unknown_reward",
        _set("rollout.rewards", {"gsm8kk": 1.0}),
        "rollout.rewards",
        "rollout.rewards: unknown reward 'gsm8kk' (did you mean gsm8k?); known: dapo_overlong, format, gsm8k,",
    ),
    (
        "reward_module_missing",
        _set("rollout.rewards", {"no_such_module:score": 1.0}),
        "rollout.rewards",
        "rollout.rewards: reward 'no_such_module:score': cannot import module 'no_such_module'",
    ),
    (
        "reward_function_missing",
        _set("rollout.rewards", {"math:no_such_function": 1.0}),
        "rollout.rewards",
        "rollout.rewards: reward 'math:no_such_function': module 'math' has no attribute",
    ),
    ("no_rewards", _set("rollout.rewards", {}), "rollout.rewards", "rollout.rewards is empty"),
    (
        "reward_weight_not_a_number",
        _set("rollout.rewards", {"gsm8k": "1"}),
        "rollout.rewards.gsm8k",
        "must be a number",
    ),
    (
        "arguments_of_a_missing_reward",
        _set("rollout.reward_kwargs", {"gsm8k": {"fallback_last_number": True}}),
        "rollout.reward_kwargs.gsm8k",
        "gives arguments to a reward missing from rollout.rewards (reasoning_gym)",
    ),
    ("unknown_eval_reward", _set("eval.reward", "gsm8kk"), "eval.reward", "eval.reward: unknown reward 'gsm8kk'"),
    (
        "eval_reward_function_missing",
        _set("eval.reward", "feynrl_jax.rollout.rewards.gsm8k:no_such_reward"),
        "eval.reward",
        "module 'feynrl_jax.rollout.rewards.gsm8k' has no attribute",
    ),
    ("unknown_eval_reward_sft", _set("eval.reward", "gsm8kk", make=sft_config), "eval.reward", "unknown reward"),
    (
        "vllm_dtype",
        _with(
            rl_config, lambda c: setattr(c.rollout, "engine", "vllm"), lambda c: setattr(c.rollout.vllm, "dtype", "fp8")
        ),
        "rollout.vllm.dtype",
        "is not one of 'float32', 'bfloat16', 'float16'",
    ),
    (
        "vllm_negative_kv_cache",
        _with(
            rl_config,
            lambda c: setattr(c.rollout, "engine", "vllm"),
            lambda c: setattr(c.rollout.vllm, "kv_cache_gib", -1.0),
        ),
        "rollout.vllm.kv_cache_gib",
        "must be at least 0",
    ),
    (
        "vllm_engine_kwargs_set_by_a_key",
        _with(
            rl_config,
            lambda c: setattr(c.rollout, "engine", "vllm"),
            lambda c: setattr(c.rollout.vllm, "engine_kwargs", {"max_num_seqs": 4}),
        ),
        "rollout.vllm.engine_kwargs.max_num_seqs",
        "is set by rollout.max_slots",
    ),
    ("negative_rollout_gpus", _set("ray.gpus_per_rollout_worker", -1), "ray.gpus_per_rollout_worker", "integer >= 0"),
    ("negative_trainer_gpus", _set("ray.trainer_gpus", -2), "ray.trainer_gpus", "integer >= 0"),
    ("empty_eval_reward_rl", _set("eval.reward", ""), "eval.reward", "the RL loop's evaluation scores completions"),
    (
        "empty_eval_reward_eval",
        _set("eval.reward", "", make=lambda: load("eval_smollm2")),
        "eval.reward",
        "eval.reward is empty but `feynrl-jax eval` scores completions with it.",
    ),
]


@pytest.mark.parametrize("build,key,message", [row[1:] for row in BAD_CONFIGS], ids=[row[0] for row in BAD_CONFIGS])
def test_bad_config_names_its_key(build, key, message):
    config = build()
    with pytest.raises(ConfigError) as excinfo:
        validate(config)
    assert excinfo.value.keys == (key,), str(excinfo.value)
    (problem,) = excinfo.value.problems
    assert key in problem.message and message in problem.message, problem.message


def test_off_policy_defaults_to_decoupled_when_async():
    from feynrl_jax.config.derived import effective_off_policy

    config = rl_config()
    assert effective_off_policy(config) == "none"
    config.train.max_staleness = 1
    assert effective_off_policy(config) == "decoupled"
    config.algo.off_policy = "none"
    assert effective_off_policy(config) == "none"
    validate(config)


def test_vllm_engine_defaults_to_tis_when_sync():
    from feynrl_jax.config.derived import effective_off_policy

    config = rl_config()
    config.rollout.engine = "vllm"
    assert effective_off_policy(config) == "tis"  # vLLM's log-probabilities differ from the trainer's
    config.train.max_staleness = 1
    assert effective_off_policy(config) == "decoupled"
    config.train.max_staleness = 0
    config.train.recompute_old_logprobs = False  # no pi_old of the trainer's to weight with
    assert effective_off_policy(config) == "none"
    validate(config)


def test_vllm_engine_without_vllm_names_the_key_and_the_install_command(monkeypatch):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "vllm" else real_find_spec(name, *a)
    )
    config = rl_config()
    validate(config)  # the native engine needs no vLLM
    config.rollout.engine = "vllm"
    with pytest.raises(ConfigError) as excinfo:
        validate(config)
    assert excinfo.value.keys == ("rollout.engine",)
    assert "pip install 'feynrl-jax[vllm]'" in str(excinfo.value)


def test_bad_config_table_is_large_and_distinct():
    assert len(BAD_CONFIGS) >= 15
    assert len({row[0] for row in BAD_CONFIGS}) == len(BAD_CONFIGS)


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


def test_dpo_pairs_stay_whole_on_each_data_parallel_device():
    """A pair's two rows stay on one device (the train step's `check_divisible`): 8 pairs split over 8 devices,
    4 pairs (8 rows) do not, for the whole batch and for each micro-batch."""
    from feynrl_jax.train.microbatch import check_divisible

    config = load("dpo_smollm2", "tiny")
    config.mesh.data, config.mesh.fsdp, config.mesh.tensor = 8, 1, 1
    config.train.global_batch_size, config.train.mini_batches, config.train.micro_batch_size = 8, 1, 0
    validate(config, num_devices=8)
    check_divisible(2 * 8, 1, 2, 8)
    config.train.global_batch_size = 4
    with pytest.raises(ConfigError, match=r"global_batch_size=4 pairs \(2 rows each\)"):
        validate(config, num_devices=8)
    with pytest.raises(ValueError, match="cannot be split"):
        check_divisible(2 * 4, 1, 2, 8)
    config.train.global_batch_size, config.train.micro_batch_size = 16, 4
    with pytest.raises(ConfigError, match=r"micro-batch of 4 pairs"):
        validate(config, num_devices=8)
    with pytest.raises(ValueError, match="cannot be split"):
        check_divisible(2 * 16, 4, 2, 8)


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


def _float_keys(config):
    """Every float key of `config`, unset float placeholders (`algo.clip_low`, ...) included."""
    keys = []
    for path, value in flatten(config):
        node, leaf = _parent(config, path)
        if not isinstance(value, ConfigDict) and node.get_type(leaf) is float:
            keys.append(path)
    return keys


FLOAT_KEYS = _float_keys(rl_config())


def test_float_keys_cover_every_section():
    expected = {
        "optim.lr",
        "algo.kl_coef",
        "algo.clip_low",
        "rollout.rewards.reasoning_gym",
        "data.sources.sums.weight",
    }
    assert expected <= set(FLOAT_KEYS)
    assert {key.split(".")[0] for key in FLOAT_KEYS} >= {"optim", "rollout", "algo", "eval", "ray", "data"}


@settings(max_examples=60, deadline=None)
@given(key=st.sampled_from(FLOAT_KEYS), value=st.sampled_from([NAN, INF, -INF]))
def test_any_float_key_rejects_non_finite_values(key, value):
    with pytest.raises(ConfigError) as excinfo:
        validate(_set(key, value)())
    assert excinfo.value.keys == (key,), str(excinfo.value)
    assert str(excinfo.value) == f"invalid config: {key}={value!r} must be a finite number."


def test_eval_reward_is_checked_only_when_the_run_evaluates():
    config = sft_config()
    config.eval.during_training = False
    config.eval.reward = "gsm8kk"
    validate(config)
    config.eval.during_training = True
    config.eval.reward = ""  # SFT and DPO: no generation eval.
    validate(config)
    config = rl_config()
    config.eval.reward = "feynrl_jax.rollout.rewards.gsm8k:gsm8k_reward"  # An import path that resolves.
    validate(config)


def test_free_mesh_axis_must_divide_the_devices():
    config = load("tiny_rl")  # mesh.data = -1.
    config.mesh.fsdp = 3
    validate(config)  # The device count is unknown.
    with pytest.raises(ConfigError) as excinfo:
        validate(config, num_devices=8)
    assert excinfo.value.keys == ("mesh.data",)
    assert "mesh.data=-1 cannot fill the 8 devices: mesh.fsdp x mesh.tensor = 3 does not divide them." in str(
        excinfo.value
    )


FORCE_8 = "--xla_force_host_platform_device_count=8"


@pytest.mark.parametrize(
    "environ,expected",
    [
        ({"JAX_PLATFORMS": "cpu"}, 1),
        ({"JAX_PLATFORMS": "cpu", "XLA_FLAGS": FORCE_8}, 8),
        ({"JAX_PLATFORMS": "cpu", "XLA_FLAGS": f"--xla_dump_to=/tmp/x {FORCE_8} {FORCE_8[:-1]}4"}, 4),
        ({"JAX_PLATFORMS": "cpu", "XLA_FLAGS": FORCE_8, "JAX_NUM_CPU_DEVICES": "2"}, 2),
        ({"JAX_PLATFORMS": "cpu", "XLA_FLAGS": FORCE_8, "JAX_NUM_CPU_DEVICES": "-1"}, 8),
        ({"JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=many"}, None),
        ({"JAX_PLATFORMS": "cpu", "XLA_FLAGS": FORCE_8, "FEYNRL_NUM_PROCESSES": "2"}, None),
        ({"JAX_PLATFORMS": "cpu", "XLA_FLAGS": FORCE_8, "SLURM_NTASKS": "1"}, 8),
        ({"JAX_PLATFORMS": "cuda", "XLA_FLAGS": FORCE_8}, None),
        ({"JAX_PLATFORMS": "cpu,cuda"}, None),
        ({"XLA_FLAGS": FORCE_8}, None),
    ],
)
def test_cpu_device_count_hint(environ, expected):
    assert cpu_device_count_hint(environ) == expected


def test_validate_counts_cpu_devices_from_the_environment(monkeypatch):
    monkeypatch.setattr(validation, "cpu_device_count_hint", cpu_device_count_hint)
    for name in ("JAX_NUM_CPU_DEVICES", *validation.PROCESS_COUNT_VARIABLES):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
    validate(rl_config())  # mesh 2 x 2 x 1 on 4 devices.
    monkeypatch.setenv("XLA_FLAGS", FORCE_8)
    with pytest.raises(ConfigError, match="= 4 but there are 8 devices") as excinfo:
        validate(rl_config())
    assert excinfo.value.keys == ("mesh.data",)


NO_JAX = textwrap.dedent(
    """
    import importlib.util, pathlib, sys
    from feynrl_jax.config import ConfigError, validate

    def load(name):
        spec = importlib.util.spec_from_file_location(name, pathlib.Path(sys.argv[1]) / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module.get_config()

    for name in ("grpo_demo", "tiny_rl", "sft_smollm2_arith", "eval_smollm2"):
        validate(load(name))
    config = load("tiny_rl")
    config.rollout.rewards = {"gsm8kk": 1.0, "math:no_such_function": 1.0}
    config.eval.reward = "feynrl_jax.rollout.rewards.gsm8k:gsm8k_reward"
    config.optim.lr = float("nan")
    try:
        validate(config)
    except ConfigError as e:
        assert e.keys == ("optim.lr", "rollout.rewards", "rollout.rewards"), e.keys
    else:
        raise AssertionError("accepted")
    heavy = ("jax", "flax", "optax", "ray", "torch", "transformers", "math_verify", "reasoning_gym")
    imported = sorted(m for m in heavy if m in sys.modules)
    assert not imported, imported
    """
)


def test_validation_imports_neither_jax_nor_the_reward_libraries():
    """The reward check imports the registry (numpy) but not JAX, nor the libraries of the built-in rewards."""
    result = subprocess.run([sys.executable, "-c", NO_JAX, str(CONFIG_DIR)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
