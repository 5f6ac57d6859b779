"""Supervised fine-tuning of SmolLM2-135M-Instruct on reasoning-gym arithmetic (prompt -> answer).

Launch:
    feynrl-jax train --config=configs/sft_smollm2_arith.py
    feynrl-jax train --config=configs/sft_smollm2_arith.py:runlocal      # 2-step smoke run
    feynrl-jax train --config=configs/sft_smollm2_arith.py:packing --config.optim.lr=2e-5

Variants (comma-separated after the colon):
    runlocal  shrink everything for a smoke run.
    packing   pack several examples per row (segment ids) instead of padding each.
    tiny      a tiny random-init model with SmolLM2's tokenizer (tests).

Short CPU run (the before/after numbers of the P6 note; held-out accuracy = greedy pass@1 on 64 test-split
prompts not in the train split, graded by the reasoning_gym reward; eval at step 0 and at the last step):
    feynrl-jax train --config=configs/sft_smollm2_arith.py --config.run_dir=runs/sft_easy \
        --config.train.steps=12 --config.train.global_batch_size=8 --config.train.micro_batch_size=0 \
        --config.data.max_seq_len=80 --config.data.max_prompt_len=64 --config.optim.lr=5e-5 \
        --config.optim.schedule=constant --config.optim.warmup_steps=2 --config.eval.num_prompts=64 \
        --config.eval.max_new_tokens=16 --config.train.eval_every=0 --config.checkpoint.every_steps=10
    Measured (shared 2-core CPU, ~1.5 min/step): held-out eval/accuracy (= pass@1) 0.000 -> 0.109 (0 -> 7 of 64),
    mean response 15.8 -> 3.9 tokens (the base model explains and is cut off at 16 tokens; the tuned one answers
    with the number and stops); train loss 3.30 -> 0.98. (That run was OOM-killed by the shared machine after
    step 10 and resumed from its step-10 checkpoint by re-running the command.)
"""

from feynrl_jax.config.base import add_data_source, base_config, data_source
from feynrl_jax.config.variants import parse_variants, use_tiny_model

# Two terms of at most two digits: within reach of a 135M model, so held-out accuracy can move.
EASY_ARITHMETIC = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}


def get_config(arg=None):
    variants = parse_variants(arg, ("runlocal", "packing", "tiny"))
    config = base_config()
    config.paradigm = "sft"
    config.name = "sft_smollm2_arith"
    config.run_dir = "runs/sft_smollm2_arith"
    config.model.gguf = "smollm2"

    add_data_source(
        config,
        "arith",
        data_source("reasoning_gym", task="basic_arithmetic", size=5000, seed=0, options=EASY_ARITHMETIC),
    )
    add_data_source(
        config,
        "arith_test",
        data_source("reasoning_gym", task="basic_arithmetic", split="test", size=200, seed=0, options=EASY_ARITHMETIC),
    )
    config.data.system_prompt = "Reply with only the final answer."
    config.data.response_template = "{answer}"  # The target response: the bare answer, as the reward reads it.
    config.data.max_prompt_len = 160
    config.data.max_seq_len = 256
    config.data.packing = "packing" in variants

    config.algo.name = "sft"
    config.algo.reference = "none"
    config.optim.lr = 1e-5
    config.optim.schedule = "cosine"
    config.optim.warmup_steps = 10
    config.optim.weight_decay = 0.01
    config.train.steps = 200
    config.train.global_batch_size = 32
    config.train.micro_batch_size = 16
    config.train.eval_every = 50

    config.eval.n_samples = 1
    config.eval.k = (1,)
    config.eval.temperature = 0.0
    config.eval.max_new_tokens = 64
    config.eval.num_prompts = 100
    config.checkpoint.every_steps = 50

    if "tiny" in variants:
        use_tiny_model(config)
        config.run_dir += "_tiny"
    if "runlocal" in variants:
        config.train.steps = 2
        config.optim.warmup_steps = 0
        config.train.global_batch_size = 8
        config.train.micro_batch_size = 0
        config.train.eval_every = 0
        config.eval.max_new_tokens = 16
        config.eval.num_prompts = 4
        config.checkpoint.every_steps = 0
        config.run_dir += "_runlocal"
    return config
