"""Two processes joined by ``jax.distributed`` (4 fake CPU devices each, coordinator on loopback) run the same
sharded train step as one process and must agree with it.

The file is also the worker: ``python tests/test_multihost_train_step.py OUT.npz`` with the ``FEYNRL_*``
variables set joins the job through ``feynrl_jax.sharding.initialize_distributed``.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from test_launch_scripts import free_port
from xla_codegen import with_suite_codegen

MESH_NAME = "fsdp4_tp2"
PROCESSES = 2


def _worker(out_path: str) -> None:
    import jax
    from jax.experimental import multihost_utils

    from feynrl_jax.sharding import initialize_distributed, place_process_batch

    spec = initialize_distributed(initialization_timeout=120)
    assert spec.source == "explicit" and jax.process_count() == PROCESSES, (spec, jax.process_count())
    assert jax.local_device_count() == 4 and jax.device_count() == 8

    from test_train_step import STEPS, build_step, initial_params, make_batch

    train_step = build_step("grpo", MESH_NAME)
    # The mesh spans both processes; every process passes the same host params and batches.
    assert {d.process_index for d in train_step.mesh.devices.flat} == {0, 1}
    state = train_step.init_state(initial_params())
    losses = []
    for i in range(STEPS):
        full = make_batch("grpo", seed=i)
        if i % 2:
            # A real pipeline: each process reads only its own half of the rows.
            rows = full.tokens.shape[0] // PROCESSES
            mine_rows = slice(jax.process_index() * rows, (jax.process_index() + 1) * rows)
            mine = jax.tree.map(lambda x, r=mine_rows: x[r], full)
            batch = place_process_batch(mine, train_step.mesh)
            gathered = multihost_utils.process_allgather(batch.tokens, tiled=True)
            np.testing.assert_array_equal(np.asarray(gathered), full.tokens)
        else:
            batch = train_step.place_batch(full)
        state, metrics = train_step(state, batch)
        losses.append(float(metrics["train/loss"].value))
    params = multihost_utils.process_allgather(state.params, tiled=True)
    if jax.process_index() == 0:
        flat = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(params)}
        np.savez(out_path, losses=np.asarray(losses), trace_count=train_step.trace_count, **flat)
    jax.distributed.shutdown()


def coordinator_port() -> int:
    """A free port for the coordinator, below Linux's ephemeral range (32768 up) and above Ray's worker ports
    (10002-19999): the Ray runs beside this test in the first pass open ports in both, and one that took the port
    between this draw and the coordinator's bind would keep the workers from joining."""
    return free_port(20000, 32768)


@pytest.mark.multiprocess
def test_two_processes_match_one_process(tmp_path: Path):
    import jax
    from test_train_step import max_relative_difference, run

    out = tmp_path / "params.npz"
    port = coordinator_port()
    # Each worker writes to a file of its own: a pipe left unread while the test waits for the other worker would
    # block a worker that wrote more than the pipe holds, and with it the other, in their collectives.
    procs, outputs = [], []
    for rank in range(PROCESSES):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "JAX_", "FEYNRL_", "TPU_"))}
        env.update(
            JAX_PLATFORMS="cpu",
            XLA_FLAGS=with_suite_codegen("--xla_force_host_platform_device_count=4"),
            FEYNRL_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
            FEYNRL_NUM_PROCESSES=str(PROCESSES),
            FEYNRL_PROCESS_ID=str(rank),
            PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")]),
        )
        outputs.append(tempfile.TemporaryFile())
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, str(out)], env=env, stdout=outputs[-1], stderr=subprocess.STDOUT
            )
        )
    # The one-process references compile and run while the workers do.
    reference, single = run("grpo", MESH_NAME), run("grpo", "single")
    for proc in procs:
        try:
            proc.wait(timeout=420)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail("multi-process workers did not finish within 420 s")
    logs = []
    for output in outputs:
        output.seek(0)
        logs.append(output.read().decode(errors="replace"))
        output.close()
    for rank, (proc, log) in enumerate(zip(procs, logs, strict=True)):
        assert proc.returncode == 0, f"process {rank} failed:\n{log[-4000:]}"

    got = np.load(out)
    assert int(got["trace_count"]) == 1
    want_params = reference.params[-1]
    got_params = jax.tree_util.tree_map_with_path(lambda p, _: got[jax.tree_util.keystr(p)], want_params)
    assert max_relative_difference(got_params, want_params) < 1e-5
    np.testing.assert_allclose(got["losses"], [m["train/loss"] for m in reference.metrics], rtol=1e-5)
    assert max_relative_difference(got_params, single.params[-1]) < 1e-5


if __name__ == "__main__":
    _worker(sys.argv[1])
