"""The real `feynrl-jax train` as 2 processes x 4 fake CPU devices (joined by `jax.distributed` on a loopback
coordinator) against 1 process x 8 devices, for SFT and DPO; then one process killed mid-run.

The mesh is the same in both layouts (data 2 x fsdp 4, parameters split over fsdp), so the programs are the same
partitioned computation: only which process drives which devices differs, and the cross-process collectives go
through gloo instead of in-process copies. The tolerance on the per-step losses (rtol 1e-5) allows for a different
order of float32 summation in those collectives (each all-reduce rounds to 2^-24 relative per addition; a few
hundred values per reduction and a few steps of drift stay far below 1e-5), not for any difference in the data a
step sees: a row trained on by the wrong process, or twice, changes the loss at the first decimal.

Killing one process: the other must stop within `distributed.heartbeat_timeout_s` plus a margin with the
one-line message of `feynrl_jax.cli.supervisor` (exit code 1), never hang; both started again with `--resume`,
the job ends with the per-step losses of a run that never stopped.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import resume_harness as harness

from feynrl_jax.tracking import read_metrics

# jax.distributed heartbeats every few seconds (HEARTBEAT_S): `make test` runs the module in the serial pass, alone.
pytestmark = pytest.mark.serial

STEPS = 8
SAVE_EVERY = 3
HEARTBEAT_S = 5

CONFIG = textwrap.dedent(
    """
    import os
    from feynrl_jax.config.base import add_data_source, base_config, data_source

    def get_config(arg):
        paradigm, run = arg.split("/")
        root = os.environ["TINY_ROOT"]
        config = base_config()
        config.paradigm = paradigm
        config.run_dir = os.path.join(root, paradigm + "_" + run)
        config.seed = 5
        config.model.random_init = True
        config.model.tokenizer = os.path.join(root, "tokenizer")
        arch = config.model.arch
        arch.vocab_size, arch.hidden_size, arch.intermediate_size = 320, 32, 64
        arch.num_heads, arch.num_kv_heads, arch.head_dim = 4, 2, 8
        add_data_source(config, "toy", data_source("jsonl", path=os.path.join(root, paradigm + "_train.jsonl")))
        add_data_source(
            config, "toy_test", data_source("jsonl", path=os.path.join(root, paradigm + "_test.jsonl"), split="test")
        )
        config.data.max_seq_len = 48
        config.data.max_prompt_len = 32
        config.algo.name = paradigm
        config.algo.reference = "initial" if paradigm == "dpo" else "none"
        config.optim.lr = 3e-3
        config.optim.schedule = "constant"
        config.train.steps = {steps}
        # Examples (a DPO pair is 2 rows) split over data x fsdp = 8 devices, 2 micro-batches per step.
        config.train.global_batch_size = 16
        config.train.micro_batch_size = 8
        config.mesh.data = 2
        config.mesh.fsdp = 4
        config.mesh.rules = "fsdp"
        config.checkpoint.every_steps = {every}
        config.checkpoint.async_save = True
        config.tracking.progress_bar = False
        config.train.eval_every = 4
        config.eval.num_prompts = 4
        if paradigm == "sft":  # generation on process 0 with the gathered params, scored
            config.eval.reward = "gsm8k"
            config.eval.n_samples = 2
            config.eval.k = (1,)
            config.eval.max_new_tokens = 4
            config.rollout.max_slots = 4
        else:  # preference accuracy: every process computes log-probabilities on the shared mesh
            config.eval.reward = ""
        config.distributed.heartbeat_timeout_s = {heartbeat}
        config.distributed.initialization_timeout_s = 120
        return config
    """
).format(steps=STEPS, every=SAVE_EVERY, heartbeat=HEARTBEAT_S)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from feynrl_jax.data.toy_tokenizer import build_toy_tokenizer

    root = tmp_path_factory.mktemp("multiprocess")
    sft, dpo = [], []
    for i in range(40):
        a, b = i % 7 + 1, (i * 3) % 5 + 1
        sft.append({"prompt": f"What is {a} plus {b}?", "response": f"#### {a + b}", "answer": str(a + b)})
        question = f"What is {a} plus {b}?"
        dpo.append({"prompt": question, "chosen": f"It is {a + b}.", "rejected": f"It is {a + b + 1}!!"})
    for name, rows in (("sft", sft), ("dpo", dpo)):
        for split, part in (("train", rows[8:]), ("test", rows[:8])):
            with open(root / f"{name}_{split}.jsonl", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in part)
    texts = [r["prompt"] + " " + r["response"] for r in sft] + [r["chosen"] + " " + r["rejected"] for r in dpo]
    build_toy_tokenizer(texts, vocab_size=300).save_pretrained(root / "tokenizer")
    (root / "tiny.py").write_text(CONFIG)
    return root


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_job(
    root, spec: str, processes: int, *, resume: bool = False, command: str = "train"
) -> list[subprocess.Popen]:
    """Starts `feynrl-jax <command> --config=<root>/tiny.py:<spec>` as `processes` processes sharing 8 CPU
    devices."""
    address = f"127.0.0.1:{_free_port()}"
    procs = []
    for rank in range(processes):
        launch = {}
        if processes > 1:
            launch = dict(
                FEYNRL_COORDINATOR_ADDRESS=address, FEYNRL_NUM_PROCESSES=str(processes), FEYNRL_PROCESS_ID=str(rank)
            )
        env = harness.subprocess_env(devices=8 // processes, TINY_ROOT=str(root), **launch)
        argv = [sys.executable, "-m", "feynrl_jax.cli.main", command, f"--config={root / 'tiny.py'}:{spec}"]
        if resume:
            argv.append("--resume")
        procs.append(harness.popen(argv, env))
    return procs


def wait_job(procs: list[subprocess.Popen], timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    for rank, proc in enumerate(procs):
        proc.wait(timeout=max(1.0, deadline - time.monotonic()))
        err = harness.stderr_text(proc)
        assert proc.returncode == 0, f"process {rank} exited with {proc.returncode}: {err[-3000:]}"


def losses(run_dir) -> list[float]:
    records = [r for r in read_metrics(str(run_dir)) if r["step"] >= 1 and "train/loss" in r]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    return [r["train/loss"] for r in records]


def run_log(run_dir) -> str:
    with open(os.path.join(run_dir, "run.log")) as f:
        return f.read()


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.parametrize("paradigm", ["sft", "dpo"])
def test_two_processes_train_like_one(workspace, paradigm):
    root = workspace
    wait_job(start_job(root, f"{paradigm}/one", 1))
    wait_job(start_job(root, f"{paradigm}/two", 2))
    one, two = root / f"{paradigm}_one", root / f"{paradigm}_two"
    np.testing.assert_allclose(losses(two), losses(one), rtol=1e-5)

    log = run_log(two)
    for rank in (0, 1):  # both processes joined one job and built one mesh over all 8 devices
        assert f"p{rank} INFO feynrl_jax.cli: joined the job as process {rank} of 2" in log
        assert f"p{rank} INFO feynrl_jax.train.run_setup: mesh {{'data': 2, 'fsdp': 4, 'tensor': 1}}" in log
    assert "over 8 devices in 2 process(es), 4 of them here" in log
    # Process 0 alone wrote the metrics (each step once) and evaluated.
    steps = [r["step"] for r in read_metrics(str(two))]
    assert sorted(steps) == sorted(set(steps))
    evaluated = [r for r in read_metrics(str(two)) if any(k.startswith("eval/") for k in r)]
    assert [r["step"] for r in evaluated] == [0, 4, 8]
    if paradigm == "sft":
        assert (two / "eval_results_step8.json").is_file()
        want = [r for r in read_metrics(str(one)) if r["step"] == 8][0]
        got = [r for r in read_metrics(str(two)) if r["step"] == 8][0]
        assert got["eval/num_prompts"] == want["eval/num_prompts"] > 0
    else:  # the same preference accuracy from the gathered log-probabilities
        want = [r for r in read_metrics(str(one)) if r["step"] == 8][0]
        got = [r for r in read_metrics(str(two)) if r["step"] == 8][0]
        assert got["eval/num_pairs"] == want["eval/num_pairs"] > 0
        np.testing.assert_allclose(got["eval/reward_margin"], want["eval/reward_margin"], rtol=1e-4, atol=1e-6)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_killed_process_stops_the_other_then_the_job_resumes(workspace):
    root = workspace
    reference = root / "sft_two"
    if not (reference / "metrics.jsonl").is_file():
        wait_job(start_job(root, "sft/two", 2))
    run_dir = root / "sft_killed"
    procs = start_job(root, "sft/killed", 2)
    deadline = time.monotonic() + 300
    while not harness.logged_and_committed(run_dir, SAVE_EVERY + 1):
        exited = [harness.stderr_text(p)[-2000:] for p in procs if p.poll() is not None]
        assert not exited, exited
        assert time.monotonic() < deadline, "the job never got past its first committed checkpoint"
        time.sleep(0.01)
    procs[1].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    procs[1].wait()
    procs[0].wait(timeout=HEARTBEAT_S + 60)
    err = harness.stderr_text(procs[0])
    stopped_after = time.monotonic() - killed_at
    assert procs[0].returncode == 1, (procs[0].returncode, err[-3000:])
    lines = err.strip().splitlines()
    # Usually the coordination service notices first; a collective whose peer vanished may abort sooner.
    assert lines[-1].startswith("feynrl-jax: error: process 0 of 2 stopped: "), err
    assert "--resume" in lines[-1]
    assert not any(line.lstrip().startswith("@ 0x") or "Fatal Python error" in line for line in lines), err
    assert stopped_after < HEARTBEAT_S + 60

    wait_job(start_job(root, "sft/killed", 2, resume=True))
    assert "resumed" in run_log(run_dir)
    np.testing.assert_array_equal(losses(run_dir), losses(reference))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_eval_in_two_processes_evaluates_once(workspace):
    """`feynrl-jax eval` joins the job too: process 0 evaluates and writes the results, process 1 waits for it."""
    root = workspace
    wait_job(start_job(root, "sft/eval", 2, command="eval"))
    with open(root / "sft_eval" / "eval_results.json") as f:
        report = json.load(f)
    assert report["metrics"]["eval/num_prompts"] == 4
    log = run_log(root / "sft_eval")
    assert "p0 INFO feynrl_jax.cli: joined the job as process 0 of 2" in log
    assert "p1 INFO feynrl_jax.cli: joined the job as process 1 of 2" in log
