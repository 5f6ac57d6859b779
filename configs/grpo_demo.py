"""GRPO on SmolLM2-135M-Instruct with reasoning-gym arithmetic: the project's main job (about 10 minutes on CPU).

Launch:
    feynrl-jax train --config=configs/grpo_demo.py
    feynrl-jax train --config=configs/grpo_demo.py:runlocal          # 2-step smoke run
    feynrl-jax train --config=configs/grpo_demo.py:chain_sum --config.optim.lr=3e-6

Variants (comma-separated after the colon):
    runlocal   shrink everything for a smoke run (2 steps, short generations, few prompts).
    chain_sum  train on reasoning-gym `chain_sum` instead of `basic_arithmetic`.
    dapo       DAPO (clip-higher, token-mean, no KL, dynamic sampling) instead of GRPO.

References:
    Shao et al., "DeepSeekMath" (GRPO), 2024. Yu et al., "DAPO", 2025.
"""

from feynrl_jax.config.base import add_data_source, base_config, data_source
from feynrl_jax.config.variants import parse_variants


def get_config(arg=None):
    variants = parse_variants(arg, ("runlocal", "chain_sum", "dapo"))
    config = base_config()
    config.paradigm = "rl"
    config.name = "grpo_demo"
    config.run_dir = "runs/grpo_demo"
    config.model.gguf = "smollm2"

    task = "chain_sum" if "chain_sum" in variants else "basic_arithmetic"
    add_data_source(config, "arith", data_source("reasoning_gym", task=task, size=2000, seed=0))
    # Held out: reasoning-gym's test split is drawn from entries the train split never uses.
    add_data_source(config, "arith_test", data_source("reasoning_gym", task=task, split="test", size=200, seed=0))
    config.data.max_prompt_len = 160
    config.data.max_seq_len = 288
    config.data.system_prompt = "Reply with only the final answer."

    config.algo.name = "grpo"
    config.algo.kl_coef = 0.0  # Rule-based reward on a small model: no KL, so no reference forward pass.
    config.algo.reference = "none"
    config.rollout.n_samples = 8
    config.rollout.max_new_tokens = 96
    config.rollout.temperature = 1.0
    config.rollout.max_slots = 64

    config.optim.lr = 2e-6
    config.optim.warmup_steps = 2
    config.train.steps = 20
    config.train.global_batch_size = 64  # 8 prompts x 8 samples.
    config.train.micro_batch_size = 16
    config.train.eval_every = 10

    config.eval.n_samples = 1
    config.eval.k = (1,)
    config.eval.temperature = 0.0  # Greedy accuracy before and after.
    config.eval.max_new_tokens = 96
    config.eval.num_prompts = 100
    config.checkpoint.every_steps = 10

    if "dapo" in variants:
        config.name = "dapo_demo"
        config.run_dir = "runs/dapo_demo"
        config.algo.name = "dapo"
        config.algo.clip_high = 0.28
        config.algo.loss_agg = "token_mean"
        config.algo.dynamic_sampling = True
    if "runlocal" in variants:
        config.train.steps = 2
        config.optim.warmup_steps = 0
        config.train.global_batch_size = 8  # 2 prompts x 4 samples.
        config.train.micro_batch_size = 8
        config.train.eval_every = 0
        config.rollout.n_samples = 4
        config.rollout.max_new_tokens = 16
        config.eval.max_new_tokens = 16
        config.eval.num_prompts = 4
        config.checkpoint.every_steps = 0
        config.run_dir += "_runlocal"
    return config
