"""A tiny random-init model doing 2 RL steps on reasoning-gym `chain_sum`: the config of RL integration tests.

Launch:
    feynrl-jax train --config=configs/tiny_rl.py
    feynrl-jax train --config=configs/tiny_rl.py:cispo                   # any registered RL algorithm
    feynrl-jax train --config=configs/tiny_rl.py --config.algo.name=p3o --config.rollout.n_samples=4

Variants (comma-separated after the colon): the name of a registered RL algorithm (`ppo`, `grpo`, `dr_grpo`,
`dapo`, `rloo`, `reinforce_pp`, `cispo`, `p3o`, `gspo`) selects it instead of GRPO, with the reference model
on (KL coefficient 0.01) for the algorithms that use one.
"""

from feynrl_jax.config import ALGORITHMS
from feynrl_jax.config.base import add_data_source, base_config, data_source
from feynrl_jax.config.variants import parse_variants, use_tiny_model

RL_ALGORITHMS = tuple(name for name, algorithm in ALGORITHMS.items() if algorithm.paradigm == "rl")


def get_config(arg=None):
    variants = parse_variants(arg, RL_ALGORITHMS)
    if len(variants) > 1:
        raise ValueError(f"tiny_rl takes at most one algorithm variant, got {sorted(variants)}")
    config = base_config()
    config.paradigm = "rl"
    config.name = "tiny_rl"
    config.run_dir = "runs/tiny_rl"
    use_tiny_model(config)

    add_data_source(config, "sums", data_source("reasoning_gym", task="chain_sum", size=64, seed=0))
    add_data_source(config, "sums_test", data_source("reasoning_gym", task="chain_sum", split="test", size=8, seed=0))
    config.data.max_prompt_len = 112
    config.data.max_seq_len = 128

    name = next(iter(variants), "grpo")
    config.algo.name = name
    if ALGORITHMS[name].needs_reference:
        config.algo.kl_coef = 0.01
        config.algo.reference = "initial"
    else:
        config.algo.reference = "none"
    config.rollout.n_samples = 4
    config.rollout.max_new_tokens = 16
    config.rollout.max_slots = 8
    config.rollout.decode_steps_per_dispatch = 4

    config.optim.lr = 1e-4
    config.train.steps = 2
    config.train.global_batch_size = 16  # 4 prompts x 4 samples; splits evenly over 8 fake CPU devices.
    config.train.mini_batches = 2
    config.train.micro_batch_size = 8

    config.eval.n_samples = 2
    config.eval.k = (1, 2)
    config.eval.max_new_tokens = 16
    config.eval.num_prompts = 4
    config.checkpoint.every_steps = 1
    config.tracking.progress_bar = False
    config.ray.num_cpus = 2
    return config
