"""Multi-host start-up: the environment parsing, as a pure function of an environment mapping."""

from __future__ import annotations

import pytest

from feynrl_jax.sharding import DistributedConfigError, DistributedSpec, detect_distributed_env, expand_slurm_nodelist
from feynrl_jax.sharding.multihost import initialize_distributed

EXPLICIT = {"FEYNRL_COORDINATOR_ADDRESS": "10.0.0.1:1234", "FEYNRL_NUM_PROCESSES": "4", "FEYNRL_PROCESS_ID": "2"}
SLURM = {
    "SLURM_JOB_ID": "4242",
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "8",
    "SLURM_STEP_NODELIST": "gpu[007-008,012],cpu1",
}


def test_no_variables_is_a_single_process():
    spec = detect_distributed_env({"HOME": "/root"})
    assert spec == DistributedSpec("single", None, 1, 0)
    assert not spec.is_multiprocess
    # A single process never touches jax.distributed.
    assert initialize_distributed({}) == spec


def test_explicit_variables_ray_or_by_hand():
    spec = detect_distributed_env({**EXPLICIT, "FEYNRL_LOCAL_DEVICE_IDS": "0,1"})
    assert spec == DistributedSpec("explicit", "10.0.0.1:1234", 4, 2, (0, 1))
    assert spec.is_multiprocess


def test_jax_names_are_aliases_and_may_repeat_the_same_values():
    jax_env = {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
    assert detect_distributed_env(jax_env) == DistributedSpec("explicit", "h:1", 2, 1)
    assert detect_distributed_env({**EXPLICIT, "JAX_NUM_PROCESSES": "4"}).num_processes == 4
    with pytest.raises(DistributedConfigError, match=r"FEYNRL_NUM_PROCESSES='4' and JAX_NUM_PROCESSES='3' disagree"):
        detect_distributed_env({**EXPLICIT, "JAX_NUM_PROCESSES": "3"})


@pytest.mark.parametrize(
    "change, message",
    [
        ({"FEYNRL_PROCESS_ID": "4"}, r"FEYNRL_PROCESS_ID=4 is outside \[0, 4\)"),
        ({"FEYNRL_PROCESS_ID": "-1"}, r"FEYNRL_PROCESS_ID=-1 is outside"),
        ({"FEYNRL_NUM_PROCESSES": "0", "FEYNRL_PROCESS_ID": "0"}, r"FEYNRL_NUM_PROCESSES=0 must be at least 1"),
        ({"FEYNRL_NUM_PROCESSES": "four"}, r"FEYNRL_NUM_PROCESSES='four' is not an integer"),
        ({"FEYNRL_COORDINATOR_ADDRESS": "10.0.0.1"}, r"FEYNRL_COORDINATOR_ADDRESS='10.0.0.1' must be 'host:port'"),
        ({"FEYNRL_COORDINATOR_ADDRESS": "h:70000"}, r"port in 1..65535"),
        ({"FEYNRL_PROCESS_ID": ""}, r"FEYNRL_COORDINATOR_ADDRESS, FEYNRL_NUM_PROCESSES set but FEYNRL_PROCESS_ID"),
        ({"FEYNRL_LOCAL_DEVICE_IDS": "0;1"}, r"FEYNRL_LOCAL_DEVICE_IDS='0;1' must be comma-separated"),
    ],
)
def test_explicit_variables_errors(change, message):
    with pytest.raises(DistributedConfigError, match=message):
        detect_distributed_env({**EXPLICIT, **change})


def test_half_set_explicit_variables_name_the_missing_ones():
    with pytest.raises(
        DistributedConfigError,
        match=r"FEYNRL_NUM_PROCESSES set but FEYNRL_COORDINATOR_ADDRESS, "
        r"FEYNRL_PROCESS_ID missing",
    ):
        detect_distributed_env({"FEYNRL_NUM_PROCESSES": "2"})


def test_slurm_coordinator_is_the_first_node_with_a_job_derived_port():
    spec = detect_distributed_env(SLURM)
    assert spec == DistributedSpec("slurm", "gpu007:24242", 8, 3)
    assert detect_distributed_env({**SLURM, "FEYNRL_COORDINATOR_PORT": "5555"}).coordinator_address == "gpu007:5555"
    job_nodelist = {k: v for k, v in SLURM.items() if k != "SLURM_STEP_NODELIST"} | {"SLURM_JOB_NODELIST": "n1,n2"}
    assert detect_distributed_env(job_nodelist).coordinator_address == "n1:24242"


def test_slurm_single_task_needs_no_coordinator():
    spec = detect_distributed_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "1"})
    assert spec == DistributedSpec("slurm", None, 1, 0)
    assert not spec.is_multiprocess


@pytest.mark.parametrize(
    "env, message",
    [
        ({"SLURM_PROCID": "0"}, r"SLURM_NTASKS is missing"),
        ({**SLURM, "SLURM_PROCID": "8"}, r"SLURM_PROCID=8 is outside \[0, 8\)"),
        ({k: v for k, v in SLURM.items() if k != "SLURM_STEP_NODELIST"}, r"neither SLURM_STEP_NODELIST nor"),
        ({k: v for k, v in SLURM.items() if k != "SLURM_JOB_ID"}, r"set FEYNRL_COORDINATOR_PORT"),
        ({**SLURM, "SLURM_STEP_NODELIST": "gpu[1-"}, r"unmatched '\['"),
    ],
)
def test_slurm_errors(env, message):
    with pytest.raises(DistributedConfigError, match=message):
        detect_distributed_env(env)


def test_explicit_and_slurm_must_agree():
    agreeing = {**SLURM, "FEYNRL_COORDINATOR_ADDRESS": "head:9", "FEYNRL_NUM_PROCESSES": "8", "FEYNRL_PROCESS_ID": "3"}
    assert detect_distributed_env(agreeing) == DistributedSpec("explicit", "head:9", 8, 3)
    with pytest.raises(DistributedConfigError, match=r"FEYNRL_NUM_PROCESSES=4 contradicts SLURM_NTASKS=8"):
        detect_distributed_env({**SLURM, **EXPLICIT})
    with pytest.raises(DistributedConfigError, match=r"FEYNRL_PROCESS_ID=2 contradicts SLURM_PROCID=3"):
        detect_distributed_env({**SLURM, **EXPLICIT, "FEYNRL_NUM_PROCESSES": "8"})


def test_tpu_pod_defers_to_jax_auto_detection():
    spec = detect_distributed_env({"TPU_WORKER_ID": "1", "TPU_WORKER_HOSTNAMES": "t0,t1"})
    assert spec == DistributedSpec("tpu")
    assert spec.is_multiprocess
    # Explicit variables win over the TPU markers (e.g. a multi-slice launcher that sets them).
    assert detect_distributed_env({"TPU_WORKER_ID": "1", **EXPLICIT}).source == "explicit"


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("node001", ["node001"]),
        ("a,b", ["a", "b"]),
        ("node[001-003]", ["node001", "node002", "node003"]),
        ("gpu[8-10,12],cpu7", ["gpu8", "gpu9", "gpu10", "gpu12", "cpu7"]),
        ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
        ("x[09-11]-ib", ["x09-ib", "x10-ib", "x11-ib"]),
    ],
)
def test_expand_slurm_nodelist(nodelist, hosts):
    assert expand_slurm_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["n[3-1]", "n[a-b]", "n]1[", ""])
def test_expand_slurm_nodelist_rejects_malformed_lists(bad):
    with pytest.raises(DistributedConfigError):
        expand_slurm_nodelist(bad)
