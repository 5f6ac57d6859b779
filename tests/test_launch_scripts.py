"""The scripts in launch/ run for real, each where this machine can stand in for its target.

* `local.sh`: a tiny SFT run with `FAKE_CPU_DEVICES=8` (the test process's own fake devices are not passed on),
  started from outside the repository; the mesh needs all 8 devices.
* `slurm.sbatch`: run by bash as sbatch would, with the job's variables set and a fake `srun` on the PATH that
  starts one local process per node with SLURM's task variables; the 2 processes (4 fake CPU devices each) must
  join one job through `feynrl_jax.sharding.multihost`'s SLURM rules (coordinator port from the job id).
* `ray_cluster.sh`: a tiny RL run submitted with `ray job submit` to a Ray head started here on loopback, with
  token authentication; the driver must join that cluster (`--config.ray.address=auto`), not start its own.
* `tpu_pod.sh`: a fake `gcloud` records its arguments; the recorded remote command then runs in a sandbox home
  whose `make`, `pip` and `feynrl-jax` are stubs, so the quoting of overrides and the environment are checked.
  How `feynrl_jax.sharding.multihost` classifies a TPU VM is tested in tests/test_sharding_multihost.py.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import pathlib
import random
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap

import pytest

from feynrl_jax.tracking import read_metrics

ROOT = pathlib.Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch"
VENV_BIN = pathlib.Path(sys.executable).parent

# A tiny SFT run: 2 steps, no evaluation, a checkpoint at the end, parameters split over all 8 devices (an explicit
# fsdp=8, so a run that sees fewer devices fails instead of shrinking its mesh).
CONFIG = textwrap.dedent(
    """
    import os
    from feynrl_jax.config.base import add_data_source, base_config, data_source

    def get_config(name):
        root = os.environ["TINY_ROOT"]
        config = base_config()
        config.paradigm = "sft"
        config.run_dir = os.path.join(root, name)
        config.model.random_init = True
        config.model.tokenizer = os.path.join(root, "tokenizer")
        arch = config.model.arch
        arch.vocab_size, arch.hidden_size, arch.intermediate_size, arch.num_layers = 320, 32, 64, 1
        arch.num_heads, arch.num_kv_heads, arch.head_dim = 4, 2, 8
        add_data_source(config, "toy", data_source("jsonl", path=os.path.join(root, "train.jsonl")))
        config.data.max_seq_len = 32
        config.data.max_prompt_len = 24
        config.algo.name = "sft"
        config.algo.reference = "none"
        config.train.steps = 2
        config.train.global_batch_size = 8
        config.mesh.data = 1
        config.mesh.fsdp = 8
        config.mesh.rules = "fsdp"
        config.checkpoint.every_steps = 0
        config.tracking.progress_bar = False
        config.eval.during_training = False
        return config
    """
)
STEPS = 2
MESH_LINE = "mesh {'data': 1, 'fsdp': 8, 'tensor': 1} (rules 'fsdp') over 8 devices in "


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from feynrl_jax.data.toy_tokenizer import build_toy_tokenizer

    root = tmp_path_factory.mktemp("launch")
    rows = []
    for i in range(40):
        a, b = i % 7 + 1, (i * 3) % 5 + 1
        rows.append({"prompt": f"What is {a} plus {b}?", "response": f"#### {a + b}", "answer": str(a + b)})
    with open(root / "train.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    build_toy_tokenizer([r["prompt"] + " " + r["response"] for r in rows], vocab_size=300).save_pretrained(
        root / "tokenizer"
    )
    (root / "tiny.py").write_text(CONFIG)
    return root


def script_env(**extra: str) -> dict[str, str]:
    """This process's environment without the XLA flags conftest.py set (fake devices, the CLI's scheduler flag):
    each script chooses its devices, and `feynrl-jax` adds the scheduler flag itself."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env.update(extra)
    return env


def run_log(run_dir: pathlib.Path) -> str:
    return (run_dir / "run.log").read_text()


def assert_finished(run_dir: pathlib.Path) -> None:
    """The run logged every step once and saved its final checkpoint."""
    assert [r["step"] for r in read_metrics(str(run_dir))] == list(range(1, STEPS + 1))
    assert (run_dir / "checkpoints" / str(STEPS)).is_dir()


def write_executable(path: pathlib.Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip())
    path.chmod(0o755)


def free_port(low: int, high: int) -> int:
    """A port in [low, high) free on 127.0.0.1 now, drawn at random (a test running beside this one draws another)."""
    ports = list(range(low, high))
    random.shuffle(ports)
    for port in ports:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{low}, {high})")


def free_ports(count: int) -> list[int]:
    """`count` different ports free on 127.0.0.1 now."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def terminate_session(session_id: int) -> None:
    """Stops every process of the session this test started (SIGTERM, then SIGKILL), and nothing else."""
    import psutil

    def members() -> list[psutil.Process]:
        found = []
        for proc in psutil.process_iter():
            try:
                if os.getsid(proc.pid) == session_id:
                    found.append(proc)
            except (ProcessLookupError, PermissionError):
                continue
        return found

    for sig in (signal.SIGTERM, signal.SIGKILL):
        procs = members()
        for proc in procs:
            try:
                proc.send_signal(sig)
            except psutil.NoSuchProcess:
                pass
        _, alive = psutil.wait_procs(procs, timeout=3)
        if not alive:
            return


def run_script(argv: list[str], *, env: dict[str, str], cwd: pathlib.Path, timeout: float = 300):
    """Runs a launch script in a session of its own; whatever it started is stopped if it runs out of time."""
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        terminate_session(proc.pid)
        out, err = proc.communicate()
        pytest.fail(f"{argv[0]} ran past {timeout} s: {err[-3000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def documented_commands() -> list[tuple[str, list[str]]]:
    """The example command lines of launch/ (script headers, README) that name a config file: (file, arguments
    after `train` or `eval`)."""
    found = []
    for path in sorted(LAUNCH.iterdir()):
        text = "\n".join(re.sub(r"^#\s?", "", line) for line in path.read_text().splitlines())
        text = text.replace("\\\n", " ")  # continuation lines
        for match in re.finditer(r"launch/\S+ (?:train|eval) (--config=configs/[^\n`]*)", text):
            found.append((path.name, shlex.split(match.group(1))))
    return found


def test_documented_command_lines_name_real_configs_and_keys(monkeypatch):
    from feynrl_jax.cli.main import load_config
    from feynrl_jax.config.errors import ConfigError
    from feynrl_jax.config.overrides import check_overrides, parse_argv

    monkeypatch.chdir(ROOT)
    commands = documented_commands()
    assert {name for name, _ in commands} == {"local.sh", "ray_cluster.sh", "slurm.sbatch", "tpu_pod.sh"}
    for name, args in commands:
        spec, overrides = parse_argv(args)
        try:
            check_overrides(load_config(spec), overrides)
        except ConfigError as e:
            pytest.fail(f"{name}: {shlex.join(args)}: {e}")


@pytest.mark.slow
def test_local_sh_trains_on_fake_cpu_devices(workspace, tmp_path):
    env = script_env(TINY_ROOT=str(workspace), FAKE_CPU_DEVICES="8")
    # Started outside the repository: the script finds it.
    result = run_script(
        [str(LAUNCH / "local.sh"), "train", f"--config={workspace / 'tiny.py'}:local"], env=env, cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run_dir = workspace / "local"
    assert_finished(run_dir)
    assert MESH_LINE + "1 process(es), 8 of them here" in run_log(run_dir)


FAKE_SRUN = """
    #!/usr/bin/env bash
    # Stand-in for SLURM's srun on one machine: --ntasks copies of the command, as if one per node, each with
    # SLURM's task variables; exits 1 when any task fails, after all have ended.
    set -euo pipefail
    ntasks=1
    while [[ $# -gt 0 && $1 == -* ]]; do
      case $1 in
        --ntasks=*) ntasks=${1#*=} ;;
        --ntasks-per-node=1) ;;
        *) echo "fake srun: unexpected option $1" >&2; exit 2 ;;
      esac
      shift
    done
    pids=()
    for ((i = 0; i < ntasks; i++)); do
      SLURM_PROCID=$i SLURM_NODEID=$i SLURM_LOCALID=0 SLURM_NTASKS=$ntasks SLURM_STEP_NODELIST=localhost \\
        "$@" >"$FAKE_SRUN_LOGS/task$i.log" 2>&1 &
      pids+=($!)
    done
    status=0
    for pid in "${pids[@]}"; do wait "$pid" || status=1; done
    exit "$status"
"""


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.serial  # its coordinator's port is picked free, then bound: nothing beside it may take it in between
def test_slurm_sbatch_joins_one_process_per_node(workspace, tmp_path):
    write_executable(tmp_path / "bin" / "srun", FAKE_SRUN)
    # multihost derives the coordinator port, 20000 + job id mod 20000, from the job id: choose a free one.
    job_id = free_port(20000, 40000)
    env = script_env(
        PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
        FAKE_SRUN_LOGS=str(tmp_path),
        SLURM_SUBMIT_DIR=str(ROOT),
        SLURM_JOB_ID=str(job_id),
        SLURM_NNODES="2",
        JAX_PLATFORMS="cpu",  # kept by the script (cuda otherwise)
        XLA_FLAGS="--xla_force_host_platform_device_count=4",
        TINY_ROOT=str(workspace),
    )
    # sbatch runs a copy of the script from its spool folder, with the submit directory in SLURM_SUBMIT_DIR.
    spooled = tmp_path / "spool" / "slurm_script"
    spooled.parent.mkdir()
    spooled.write_text((LAUNCH / "slurm.sbatch").read_text())
    result = run_script(
        ["bash", str(spooled), "train", f"--config={workspace / 'tiny.py'}:slurm"], env=env, cwd=tmp_path
    )
    tasks = "\n".join(
        (tmp_path / f"task{i}.log").read_text()[-2000:] for i in range(2) if (tmp_path / f"task{i}.log").exists()
    )
    assert result.returncode == 0, result.stderr[-2000:] + tasks
    run_dir = workspace / "slurm"
    assert_finished(run_dir)  # process 0 alone wrote each step's metrics
    log = run_log(run_dir)
    for rank in (0, 1):
        # the coordinator: the first node of SLURM_STEP_NODELIST, on the port derived from the job id
        coordinator = f"localhost:{20000 + job_id % 20000}"
        assert (
            f"p{rank} INFO feynrl_jax.cli: joined the job as process {rank} of 2 (coordinator {coordinator}): "
            f"SLURM_PROCID={rank}"
        ) in log
        assert f"p{rank} INFO feynrl_jax.train.run_setup: {MESH_LINE}2 process(es), 4 of them here" in log


@pytest.fixture
def ray_head():
    """A Ray head on 127.0.0.1 (free ports, its own temp folder, token authentication) with the job server, as a
    cluster would run it: started from the activated .venv so `feynrl-jax` is on its PATH. Yields the environment
    a submitting shell needs, plus the head's ports."""
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must stay below 108 bytes
    names = ("port", "dashboard-port", "ray-client-server-port", "node-manager-port", "object-manager-port")
    names += (
        "metrics-export-port",
        "dashboard-agent-listen-port",
        "dashboard-agent-grpc-port",
        "runtime-env-agent-port",
    )
    ports = dict(zip(names, free_ports(len(names))))
    env = script_env(
        PATH=f"{VENV_BIN}{os.pathsep}{os.environ['PATH']}",
        JAX_PLATFORMS="cpu",
        RAY_AUTH_MODE="token",
        RAY_AUTH_TOKEN=secrets.token_hex(32),
        RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0",  # every Ray process binds to 127.0.0.1
        RAY_USAGE_STATS_ENABLED="0",
    )
    command = [str(VENV_BIN / "ray"), "start", "--head", "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1"]
    command += [f"--{name}={port}" for name, port in ports.items()]
    command += ["--num-cpus=2", f"--temp-dir={temp_dir}", "--disable-usage-stats"]
    head = subprocess.Popen(command, env=env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = head.communicate(timeout=120)
        assert head.returncode == 0, out.decode()[-3000:]
        yield env, ports, pathlib.Path(temp_dir)
    finally:
        terminate_session(head.pid)
        shutil.rmtree(temp_dir, ignore_errors=True)


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.serial  # the head's ports are picked free, then bound: nothing beside it may take them in between
def test_ray_cluster_sh_joins_the_cluster(ray_head, tmp_path):
    head_env, ports, temp_dir = ray_head
    env = dict(head_env, RAY_ADDRESS=f"http://127.0.0.1:{ports['dashboard-port']}")
    run_dir = tmp_path / "rl"
    command = [str(LAUNCH / "ray_cluster.sh"), "train", "--config=configs/tiny_rl.py", f"--config.run_dir={run_dir}"]
    command.append("--config.eval.during_training=False")
    # The cluster runs with token authentication: a submission with another token is refused.
    wrong_token = dict(env, RAY_AUTH_TOKEN="0" * 64)
    refused = run_script(command, env=wrong_token, cwd=tmp_path, timeout=120)
    assert refused.returncode != 0 and "Invalid authentication token" in refused.stderr, refused.stderr[-2000:]
    assert not run_dir.exists()

    result = run_script(command, env=env, cwd=tmp_path, timeout=400)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "succeeded" in output, output[-4000:]
    assert "Connected to Ray cluster" in output and f"127.0.0.1:{ports['port']}" in output, output[-4000:]
    log = run_log(run_dir)
    assert "connecting to the Ray cluster at auto" in log
    assert "started a local Ray instance" not in log
    assert [r["step"] for r in read_metrics(str(run_dir)) if "train/loss" in r] == [1, 2]

    # The actors ran on this head, and the upload left out what .gitignore names.
    actors = subprocess.run(
        [str(VENV_BIN / "ray"), "list", "actors", f"--address=127.0.0.1:{ports['port']}", "--format=json", "--detail"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert actors.returncode == 0, actors.stderr[-2000:]
    classes = {a["class_name"] for a in json.loads(actors.stdout)}
    assert "TrainerActor" in classes, classes
    (uploaded,) = [p for p in temp_dir.glob("session_latest/runtime_resources/working_dir_files/*") if p.is_dir()]
    assert (uploaded / "launch" / "ray_cluster.sh").is_file()
    assert not [name for name in (".venv", "runs", ".git") if (uploaded / name).exists()]


FAKE_GCLOUD = """
    #!{python}
    # Records its arguments as a JSON list.
    import json, os, sys

    with open(os.environ["GCLOUD_RECORD"], "w") as f:
        json.dump(sys.argv[1:], f)
"""
STUB_CALL = """
    #!/usr/bin/env bash
    echo "$(basename "$0") $*" >>"$CALLS"
"""
STUB_PYTHON = """
    #!/usr/bin/env bash
    exec {python} "$@"
"""
STUB_FEYNRL_JAX = """
    #!{python}
    # Prints its working directory, arguments and environment as one JSON object.
    import json, os, sys

    print(json.dumps({{"cwd": os.getcwd(), "argv": sys.argv[1:], "env": dict(os.environ)}}))
"""


def test_tpu_pod_needs_tpu_name_and_zone(tmp_path):
    write_executable(tmp_path / "bin" / "gcloud", FAKE_GCLOUD.format(python=sys.executable))
    base = script_env(PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}", GCLOUD_RECORD=str(tmp_path / "rec"))
    for given, missing in (({}, "TPU_NAME"), ({"TPU_NAME": "pod"}, "ZONE")):
        env = {k: v for k, v in base.items() if k not in ("TPU_NAME", "ZONE")} | given
        result = subprocess.run(
            [str(LAUNCH / "tpu_pod.sh"), "train", "--config=configs/grpo_demo.py"],
            env=env,
            capture_output=True,
            text=True,
        )
        assert result.returncode != 0
        assert f"{missing}: set {missing}" in result.stderr, result.stderr
        assert not (tmp_path / "rec").exists()  # gcloud never called


def test_tpu_pod_runs_the_command_on_every_worker_with_overrides_intact(tmp_path):
    write_executable(tmp_path / "bin" / "gcloud", FAKE_GCLOUD.format(python=sys.executable))
    record = tmp_path / "gcloud_args"
    env = script_env(
        PATH=f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}",
        GCLOUD_RECORD=str(record),
        TPU_NAME="my-pod",
        ZONE="us-central2-b",
        REMOTE_DIR="~/code/feynrl jax",
    )
    args = [
        "train",
        "--config=configs/grpo_demo.py",
        "--config.name=two words",
        '--config.tracking.notes=it\'s "quoted"; echo injected $HOME `id` *',
        "--config.optim.lr=1e-6",
    ]
    result = subprocess.run([str(LAUNCH / "tpu_pod.sh"), *args], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    recorded = json.loads(record.read_text())
    assert recorded[:5] == ["compute", "tpus", "tpu-vm", "ssh", "my-pod"]
    assert "--zone=us-central2-b" in recorded and "--worker=all" in recorded
    (remote,) = [a.removeprefix("--command=") for a in recorded if a.startswith("--command=")]

    # A host: the checkout under the home directory, with stub make, pip and feynrl-jax (python is this one, for
    # the jax version); ssh hands the command to the login shell in the home directory.
    home = tmp_path / "home"
    venv = home / "code" / "feynrl jax" / ".venv" / "bin"
    write_executable(tmp_path / "hostbin" / "make", STUB_CALL)
    write_executable(venv / "pip", STUB_CALL)
    write_executable(venv / "python", STUB_PYTHON.format(python=sys.executable))
    write_executable(venv / "feynrl-jax", STUB_FEYNRL_JAX.format(python=sys.executable))
    calls = tmp_path / "calls"
    host_env = {"HOME": str(home), "PATH": f"{tmp_path / 'hostbin'}{os.pathsep}/usr/bin:/bin", "CALLS": str(calls)}
    host = subprocess.run(["bash", "-c", remote], cwd=home, env=host_env, capture_output=True, text=True, timeout=120)
    assert host.returncode == 0, host.stderr
    jax_version = importlib.metadata.version("jax")
    assert calls.read_text().splitlines() == ["make setup", f"pip install --quiet jax[tpu]=={jax_version}"]
    seen = json.loads(host.stdout)
    assert seen["argv"] == args
    assert seen["cwd"] == str(venv.parent.parent)
    launch_env = {k: seen["env"].get(k) for k in ("JAX_PLATFORMS", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    assert launch_env == {"JAX_PLATFORMS": "tpu", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
