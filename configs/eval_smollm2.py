"""Evaluation of SmolLM2-135M-Instruct (or any trained run) on held-out reasoning-gym arithmetic: pass@k.

Launch:
    feynrl-jax eval --config=configs/eval_smollm2.py
    feynrl-jax eval --config=configs/eval_smollm2.py:runlocal            # a few prompts
    feynrl-jax eval --config=configs/eval_smollm2.py:greedy --config.model.gguf= \
        --config.model.path=runs/grpo_demo/export                        # a trained, exported model

Variants (comma-separated after the colon):
    runlocal   a handful of prompts, short generations.
    greedy     one greedy sample per prompt (pass@1 = accuracy).
    chain_sum  reasoning-gym `chain_sum` instead of `basic_arithmetic`.
"""

from feynrl_jax.config.base import add_data_source, base_config, data_source
from feynrl_jax.config.variants import parse_variants


def get_config(arg=None):
    variants = parse_variants(arg, ("runlocal", "greedy", "chain_sum"))
    config = base_config()
    config.paradigm = "eval"
    config.name = "eval_smollm2"
    config.run_dir = "runs/eval_smollm2"
    config.model.gguf = "smollm2"

    task = "chain_sum" if "chain_sum" in variants else "basic_arithmetic"
    add_data_source(config, "arith", data_source("reasoning_gym", task=task, split="test", size=500, seed=0))
    config.data.system_prompt = "Reply with only the final answer."
    config.data.max_prompt_len = 160
    config.data.max_seq_len = 416
    config.algo.name = "grpo"  # Unused by eval; any registered name passes validation.
    config.algo.reference = "none"

    config.eval.n_samples = 8
    config.eval.k = (1, 4, 8)
    config.eval.temperature = 0.7
    config.eval.max_new_tokens = 256
    config.eval.num_prompts = 200
    config.eval.split = "test"

    if "greedy" in variants:
        config.eval.n_samples = 1
        config.eval.k = (1,)
        config.eval.temperature = 0.0
    if "runlocal" in variants:
        config.eval.num_prompts = 4
        config.eval.max_new_tokens = 16
        config.eval.n_samples = min(config.eval.n_samples, 2)
        config.eval.k = tuple(k for k in config.eval.k if k <= config.eval.n_samples)
        config.run_dir += "_runlocal"
    return config
