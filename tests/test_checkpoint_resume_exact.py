"""Exact resume: an SFT run killed with SIGKILL at three random points and resumed equals a run that never stopped.

Every run is a real `feynrl-jax train` subprocess (tiny random model, toy tokenizer, JSONL data, a 2 x 2
data x fsdp mesh, gradient accumulation over 2 micro-batches, asynchronous checkpoints every 5 steps). The
straight run and the interrupted chain must produce bitwise-identical per-step losses and gradient norms and
bitwise-identical final params. A persistent compilation cache shared by the subprocesses keeps this fast; it
does not weaken the check (the compiled programs are the same either way).
"""

import json
import random
import textwrap

import pytest
import resume_harness as harness

from feynrl_jax.tracking import read_metrics

TOTAL_STEPS = 40
SAVE_EVERY = 5

CONFIG = textwrap.dedent(
    """
    import os
    from feynrl_jax.config.base import add_data_source, base_config, data_source

    def get_config(arg=None):
        root = os.environ["TINY_ROOT"]
        config = base_config()
        config.paradigm = "sft"
        config.name = "tiny_sft_resume"
        config.run_dir = os.path.join(root, arg)
        config.seed = 3
        config.model.random_init = True
        config.model.tokenizer = os.path.join(root, "tokenizer")
        arch = config.model.arch
        arch.vocab_size, arch.hidden_size, arch.intermediate_size = 320, 32, 64
        arch.num_heads, arch.num_kv_heads, arch.head_dim = 4, 2, 8
        add_data_source(config, "toy", data_source("jsonl", path=os.path.join(root, "train.jsonl")))
        config.data.max_seq_len = 64
        config.data.max_prompt_len = 48
        config.algo.name = "sft"
        config.algo.reference = "none"
        config.optim.lr = 3e-3
        config.optim.schedule = "cosine"
        config.optim.warmup_steps = 3
        config.train.steps = {steps}
        config.train.global_batch_size = 8
        config.train.micro_batch_size = 4
        config.mesh.data = 2
        config.mesh.fsdp = 2
        config.mesh.rules = "fsdp"
        config.checkpoint.every_steps = {every}
        config.checkpoint.keep = 2
        config.checkpoint.async_save = True
        config.tracking.progress_bar = False
        config.eval.during_training = False
        return config
    """
).format(steps=TOTAL_STEPS, every=SAVE_EVERY)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from feynrl_jax.data.toy_tokenizer import build_toy_tokenizer

    root = tmp_path_factory.mktemp("exact_resume")
    rows = []
    for i in range(61):  # not a multiple of the batch: epochs wrap mid-batch
        a, b = i % 9 + 1, (i * 7) % 11 + 1
        rows.append({"prompt": f"What is {a} plus {b}?", "response": f"{a} plus {b} is {a + b}."})
    with open(root / "train.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    build_toy_tokenizer([r["prompt"] + " " + r["response"] for r in rows], vocab_size=300).save_pretrained(
        root / "tokenizer"
    )
    (root / "tiny_sft.py").write_text(CONFIG)
    return root, harness.subprocess_env(devices=4, TINY_ROOT=str(root))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_sigkill_at_three_points_then_resume_is_bitwise_identical(workspace):
    root, env = workspace
    config = str(root / "tiny_sft.py")
    harness.wait_success(harness.start_train(f"{config}:straight", env), timeout=600)

    run_dir = str(root / "interrupted")
    kill_points = sorted(random.Random(7).sample(range(SAVE_EVERY + 1, TOTAL_STEPS - 2), 3))
    resumed_from = []
    for kill_at in kill_points:
        proc = harness.start_train(f"{config}:interrupted", env)
        resumed_from.append(
            harness.kill_after_logged_step(
                proc, run_dir, kill_at, save_every=SAVE_EVERY, total_steps=TOTAL_STEPS, timeout=600
            )
        )
    harness.wait_success(harness.start_train(f"{config}:interrupted", env), timeout=600)

    # The interrupted chain re-ran the steps logged after each last checkpoint; a resumed run drops their old
    # records from metrics.jsonl, so every step is logged exactly once.
    assert all(r <= k for r, k in zip(resumed_from, kill_points, strict=True)), (resumed_from, kill_points)
    assert harness.logged_steps(run_dir) == list(range(1, TOTAL_STEPS + 1))
    assert resumed_from == sorted(resumed_from)
    keys = ("train/loss", "train/grad_norm", "train/learning_rate", "loss/nll")
    harness.assert_same_metrics(str(root / "straight"), run_dir, keys, total_steps=TOTAL_STEPS)
    want = read_metrics(str(root / "straight"))
    assert want[-1]["train/loss"] < want[0]["train/loss"], "the run trains"
    harness.assert_same_final_state(str(root / "straight"), run_dir, total_steps=TOTAL_STEPS)
