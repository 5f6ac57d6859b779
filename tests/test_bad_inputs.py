"""Bad input, tried the way a user meets it: the real `feynrl-jax` command, one case per mistake.

Every case asserts what the user sees and what is left behind:

* the exit code: 2 for bad input (config, data, checkpoint, tokenizer, reward output, disk), 1 for a run that
  cannot go on;
* one line on stderr, `feynrl-jax: error: ...`, naming the key, the file and row, the checkpoint step or the
  reward, and no traceback (that goes to `<run_dir>/run.log` once the run folder is known);
* the time to fail: a mistake the config alone shows fails before JAX or Ray start, in seconds;
* the run folder: every file that was there before is byte for byte the same, and nothing new is
  half-written (JSON files parse, a checkpoint step is either committed or left as orbax's temporary folder).

The cases run as subprocesses, two at a time (the CI machine has two cores); each test asserts its own case.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

# Each case is a real `feynrl-jax` process (some start Ray, one kills a lock holder), two at a time (the fixture
# below), each held to a time bound: the module runs in `make test`'s serial pass, with nothing beside it.
pytestmark = pytest.mark.serial

ROOT = Path(__file__).resolve().parents[1]
TINY_RL = str(ROOT / "configs" / "tiny_rl.py")
FAST = 20.0  # seconds: a config mistake fails before JAX or Ray start (about 1-2 s alone; the bound allows a busy CI)
LOAD = 90.0  # seconds: a data, model or checkpoint mistake fails while loading, before Ray starts
RUN = 240.0  # seconds: a mistake that only a running job can show (Ray, actors, a first step)


@dataclasses.dataclass(frozen=True)
class Case:
    """One bad input.

    Attributes:
        id: the test id.
        args: the command line after `feynrl-jax`; `{case}` is the case's folder, `{data}` the shared data.
        names: what the one-line message must contain (a key, a file, a row), each a regular expression.
        exit_code: 2 for bad input, 1 for a run that cannot go on.
        seconds: the most seconds the command may take to fail.
        setup: writes the case's files into its folder (gets the folder and the shared data folder).
    """

    id: str
    args: tuple[str, ...]
    names: tuple[str, ...]
    exit_code: int = 2
    seconds: float = FAST
    setup: Callable[[Path, Path], None] | None = None


def rl(*overrides: str, config: str = TINY_RL) -> tuple[str, ...]:
    return ("train", f"--config={config}", "--config.run_dir={case}/run", *overrides)


def sft(*overrides: str) -> tuple[str, ...]:
    return ("train", "--config={data}/tiny_sft.py", "--config.run_dir={case}/run", *overrides)


def _write(path: Path, text: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text if isinstance(text, bytes) else text.encode())


def _jsonl(rows: list) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


def _config_file(body: str) -> Callable[[Path, Path], None]:
    """A config file `{case}/config.py`: tiny_rl's config changed by `body` (statements on `config`)."""

    def setup(case: Path, data: Path) -> None:
        _write(
            case / "config.py",
            f"import sys\nsys.path.insert(0, {str(ROOT / 'configs')!r})\nimport tiny_rl\n\n"
            f"def get_config(arg=None):\n    config = tiny_rl.get_config()\n"
            + textwrap.indent(textwrap.dedent(body), "    ")
            + "\n    return config\n",
        )

    return setup


def _file(name: str, content: str | bytes) -> Callable[[Path, Path], None]:
    def setup(case: Path, data: Path) -> None:
        _write(case / name, content)

    return setup


def _hf_folder(mutate: Callable[[dict], None] | None = None, *, config_edit: dict | None = None, truncate=False):
    """A tiny Hugging Face folder `{case}/model` (toy tokenizer, random weights), changed by `mutate`."""

    def setup(case: Path, data: Path) -> None:
        src = data / "hf_model"
        dst = case / "model"
        shutil.copytree(src, dst)
        from safetensors.numpy import load_file, save_file

        weights = dst / "model.safetensors"
        if mutate is not None:
            tensors = load_file(weights)
            mutate(tensors)
            save_file(tensors, weights)
        if config_edit:
            cfg = json.loads((dst / "config.json").read_text())
            cfg.update(config_edit)
            (dst / "config.json").write_text(json.dumps(cfg))
        if truncate:
            raw = weights.read_bytes()
            weights.write_bytes(raw[: len(raw) // 2])

    return setup


def _first(tensors: dict, predicate) -> str:
    return next(name for name in sorted(tensors) if predicate(name))


def _nan_weight(tensors: dict) -> None:
    name = _first(tensors, lambda n: "q_proj" in n)
    tensors[name] = tensors[name].copy()
    tensors[name].flat[3] = np.nan


def _int_weight(tensors: dict) -> None:
    name = _first(tensors, lambda n: "down_proj" in n)
    tensors[name] = tensors[name].astype(np.int32)


def _missing_weight(tensors: dict) -> None:
    del tensors[_first(tensors, lambda n: "o_proj" in n)]


def _wrong_shape(tensors: dict) -> None:
    name = _first(tensors, lambda n: "up_proj" in n)
    tensors[name] = np.zeros((3, 3), tensors[name].dtype)


def _checkpoints(damage: Callable[[Path], None]) -> Callable[[Path, Path], None]:
    """`{case}/run` holds the shared SFT run (steps 2 and 4 committed), then `damage` is applied to it."""

    def setup(case: Path, data: Path) -> None:
        shutil.copytree(data / "sft_run", case / "run")
        damage(case / "run" / "checkpoints")

    return setup


def _damage_all_steps(ckpt: Path) -> None:
    for step in ckpt.iterdir():
        if step.name.isdigit():
            for item in (step / "state").rglob("*"):
                if item.is_file() and item.stat().st_size > 0 and "metadata" not in item.name:
                    item.write_bytes(b"\0" * 16)


def _nan_checkpoint(ckpt: Path) -> None:
    """The latest step holds NaN weights (as a run diverged by another tool, or an older version, would save)."""
    import jax
    import jax.numpy as jnp

    from feynrl_jax.checkpoints.train_state import TrainCheckpointer, abstract_like

    with TrainCheckpointer(ckpt.parent, save_every=1, keep=10, async_save=False) as checkpointer:
        step = checkpointer.latest_step()
        raw = checkpointer.restore_state_unsharded(step)
        state, progress = checkpointer.restore(abstract_like(jax.tree.map(jnp.asarray, raw)), step=step)
    poisoned = dict(state, params=jax.tree.map(lambda x: jnp.full_like(x, jnp.nan), state["params"]))
    shutil.rmtree(ckpt / str(step))
    with TrainCheckpointer(ckpt.parent, save_every=1, keep=10, async_save=False) as checkpointer:
        assert checkpointer.save(poisoned, progress, force=True)


def _lock_run(case: Path, data: Path) -> None:
    """Another process holds the run folder's lock for the whole case."""
    (case / "run").mkdir(parents=True, exist_ok=True)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from feynrl_jax.train.run_lock import RunLock\n"
            "with RunLock(sys.argv[1]):\n    print('locked', flush=True); time.sleep(600)",
            str(case / "run"),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "locked"
    (case / "holder.pid").write_text(str(holder.pid))


HF = ("--config.model.random_init=False", "--config.model.path={case}/model", "--config.model.tokenizer=")
GOOD = {"prompt": "What is 1 + 2?", "answer": "3"}
JSONL_ARGS = (  # the training source read from the case's `data.jsonl`
    "--config.data.sources.sums.kind=jsonl",
    "--config.data.sources.sums.path={case}/data.jsonl",
    "--config.data.sources.sums.task=",
)

CASES = [
    # --- Values that are impossible: the config alone shows them (exit 2 before JAX or Ray) -----------------
    Case("lr_inf", rl("--config.optim.lr=inf"), (r"optim\.lr",)),
    Case("lr_nan", rl("--config.optim.lr=nan"), (r"optim\.lr",)),
    Case("lr_beyond_float32", rl("--config.optim.lr=1e39"), (r"optim\.lr", "float32")),
    Case("lr_negative", rl("--config.optim.lr=-1e-3"), (r"optim\.lr",)),
    Case("temperature_nan", rl("--config.rollout.temperature=nan"), (r"rollout\.temperature",)),
    Case("max_grad_norm_nan", rl("--config.optim.max_grad_norm=nan"), (r"optim\.max_grad_norm",)),
    Case("kl_coef_nan", rl("--config.algo.kl_coef=nan"), (r"algo\.kl_coef",)),
    Case("weight_decay_nan", rl("--config.optim.weight_decay=nan"), (r"optim\.weight_decay",)),
    Case("eval_temperature_nan", rl("--config.eval.temperature=nan"), (r"eval\.temperature",)),
    Case("reward_timeout_zero", rl("--config.rollout.reward_timeout_s=0"), (r"rollout\.reward_timeout_s",)),
    Case("reward_timeout_negative", rl("--config.rollout.reward_timeout_s=-5"), (r"rollout\.reward_timeout_s",)),
    Case("reward_workers_zero", rl("--config.rollout.reward_workers=0"), (r"rollout\.reward_workers",)),
    Case("max_restarts_negative", rl("--config.ray.max_restarts=-1"), (r"ray\.max_restarts",)),
    Case("max_retries_negative", rl("--config.rollout.max_retries=-1"), (r"rollout\.max_retries",)),
    Case("stall_timeout_zero", rl("--config.ray.stall_timeout_s=0"), (r"ray\.stall_timeout_s",)),
    Case(
        "reward_failure_frac_above_one",
        rl("--config.rollout.max_reward_failure_frac=1.5"),
        (r"rollout\.max_reward_failure_frac",),
    ),
    Case("top_p_zero", rl("--config.rollout.top_p=0"), (r"rollout\.top_p",)),
    Case("top_p_above_one", rl("--config.rollout.top_p=1.5"), (r"rollout\.top_p",)),
    Case("b1_one", rl("--config.optim.b1=1.0"), (r"optim\.b1",)),
    Case("eps_zero", rl("--config.optim.eps=0"), (r"optim\.eps",)),
    Case("gae_lambda_above_one", rl("--config.algo.gae_lambda=1.5"), (r"algo\.gae_lambda",)),
    Case("tis_cap_negative", rl("--config.algo.tis_cap=-1"), (r"algo\.tis_cap",)),
    Case("steps_zero", rl("--config.train.steps=0"), (r"train\.steps",)),
    Case("batch_not_whole_groups", rl("--config.train.global_batch_size=10"), (r"train\.global_batch_size",)),
    Case("mini_batches_do_not_divide", rl("--config.train.mini_batches=3"), (r"train\.mini_batches",)),
    Case("prompt_longer_than_sequence", rl("--config.data.max_prompt_len=600"), (r"data\.max_prompt_len",)),
    Case("max_staleness_negative", rl("--config.train.max_staleness=-1"), (r"train\.max_staleness",)),
    Case("checkpoint_keep_zero", rl("--config.checkpoint.keep=0"), (r"checkpoint\.keep",)),
    Case("eval_k_above_samples", rl("--config.eval.k=(1,8)"), (r"eval\.k",)),
    Case("source_weight_zero", rl("--config.data.sources.sums.weight=0"), (r"data\.sources\.sums\.weight",)),
    Case("source_weight_nan", rl("--config.data.sources.sums.weight=nan"), (r"data\.sources\.sums\.weight",)),
    Case("pinned_core_missing", rl("--config.train.cpu_cores=(4096,)"), (r"train\.cpu_cores",)),
    # --- Choices and names ---------------------------------------------------------------------------------
    Case("unknown_key", rl("--config.optim.lrr=1e-3"), (r"optim\.lrr", r"optim\.lr\b")),
    Case("wrong_type", rl("--config.optim.lr=fast"), (r"optim\.lr",)),
    Case("unknown_algorithm", rl("--config.algo.name=grpoo"), (r"algo\.name", "grpo")),
    Case("algorithm_of_another_paradigm", rl("--config.algo.name=dpo"), (r"algo\.name",)),
    Case("unknown_paradigm", rl("--config.paradigm=ppo"), (r"paradigm",)),
    Case("unknown_off_policy_mode", rl("--config.algo.off_policy=is"), (r"algo\.off_policy",)),
    Case("unknown_engine", rl("--config.rollout.engine=sglang"), (r"rollout\.engine",)),
    Case("unknown_bad_row_policy", rl("--config.data.on_bad_row=ignore"), (r"data\.on_bad_row",)),
    Case("unknown_eval_reward", rl("--config.eval.reward=gsm8kk"), (r"eval\.reward", "gsm8k")),
    Case(
        "unknown_rollout_reward",
        rl(config="{case}/config.py"),
        (r"rollout\.rewards", "correctnes"),
        setup=_config_file('config.rollout.rewards = {"correctnes": 1.0}'),
    ),
    Case(
        "reward_import_path_missing",
        rl(config="{case}/config.py"),
        (r"rollout\.rewards", "no_such_module"),
        setup=_config_file('config.rollout.rewards = {"no_such_module:score": 1.0}'),
    ),
    Case("mesh_does_not_fit_devices", rl("--config.mesh.data=3"), (r"mesh\.data", "8 devices")),
    Case("mesh_axis_does_not_divide", rl("--config.mesh.fsdp=3"), (r"mesh\.", "3")),
    Case(
        "model_path_missing",
        rl("--config.model.random_init=False", "--config.model.path=/no/such/model"),
        (r"model\.path", "/no/such/model"),
    ),
    Case(
        "gguf_missing",
        rl("--config.model.random_init=False", "--config.model.gguf=/no/such.gguf"),
        (r"model\.gguf", "/no/such.gguf"),
    ),
    Case("tokenizer_missing", rl("--config.model.tokenizer=/no/such/tokenizer"), (r"model\.tokenizer",)),
    Case("jsonl_source_without_path", rl("--config.data.sources.sums.kind=jsonl"), (r"data\.sources\.sums\.path",)),
    # --- The command line and the config file --------------------------------------------------------------
    Case("config_file_missing", ("train", "--config={case}/nope.py"), ("nope.py",)),
    Case(
        "config_file_syntax_error",
        ("train", "--config={case}/config.py"),
        ("config.py", "SyntaxError"),
        setup=_file("config.py", "def get_config(:\n"),
    ),
    Case(
        "config_file_without_get_config",
        ("train", "--config={case}/config.py"),
        ("config.py", "get_config"),
        setup=_file("config.py", "x = 1\n"),
    ),
    Case("override_without_config", ("train", "--config.optim.lr=1"), (r"--config\.optim\.lr",)),
    Case("unknown_command", ("trian",), ("trian",)),
    Case("export_missing_run", ("export", "{case}/nothing", "--out={case}/out"), ("nothing",)),
    # --- Data files: named by file and row, before Ray starts -----------------------------------------------
    Case(
        "jsonl_malformed_row",
        rl(*JSONL_ARGS),
        (r"data\.jsonl", r"row 2"),
        seconds=LOAD,
        setup=_file("data.jsonl", _jsonl([GOOD, "{not json"])),
    ),
    Case(
        "jsonl_row_without_prompt",
        rl(*JSONL_ARGS),
        (r"data\.jsonl", r"row 2", "prompt"),
        seconds=LOAD,
        setup=_file("data.jsonl", _jsonl([GOOD, {"question": "1 + 1?", "answer": "2"}])),
    ),
    Case(
        "jsonl_prompt_not_text",
        rl(*JSONL_ARGS),
        (r"data\.jsonl", r"row 1", "prompt"),
        seconds=LOAD,
        setup=_file("data.jsonl", _jsonl([{"prompt": 42, "answer": "2"}, GOOD])),
    ),
    Case(
        "jsonl_not_utf8",
        rl(*JSONL_ARGS),
        (r"data\.jsonl", r"row 2"),
        seconds=LOAD,
        setup=_file("data.jsonl", json.dumps(GOOD).encode() + b"\n\xff\xfe{}\n"),
    ),
    Case("jsonl_missing_file", rl(*JSONL_ARGS), (r"data\.jsonl",), seconds=LOAD),
    Case("jsonl_empty_file", rl(*JSONL_ARGS), (r"data\.jsonl",), seconds=LOAD, setup=_file("data.jsonl", "")),
    Case(
        "every_row_bad_with_skip",
        rl(*JSONL_ARGS, "--config.data.on_bad_row=skip"),
        (r"data\.jsonl",),
        seconds=LOAD,
        setup=_file("data.jsonl", _jsonl(["{", "{", {"nope": 1}])),
    ),
    Case(
        "every_prompt_too_long",
        rl("--config.data.max_prompt_len=4", "--config.rollout.max_new_tokens=4", "--config.eval.max_new_tokens=4"),
        (r"data\.sources\.sums", r"data\.max_prompt_len=4"),
        seconds=LOAD,
    ),
    Case(
        "parquet_not_parquet",
        rl(
            "--config.data.sources.sums.kind=parquet",
            "--config.data.sources.sums.path={case}/data.parquet",
            "--config.data.sources.sums.task=",
        ),
        (r"data\.parquet",),
        seconds=LOAD,
        setup=_file("data.parquet", "this is not parquet\n"),
    ),
    # --- Model folders and weights: named by file and tensor ------------------------------------------------
    Case(
        "model_folder_without_config",
        sft("--config.model.random_init=False", "--config.model.path={case}", "--config.model.tokenizer="),
        ("config.json",),
        seconds=LOAD,
    ),
    Case(
        "weights_nan",
        sft(*HF),
        ("model.safetensors", "q_proj", r"non-finite|NaN|nan"),
        seconds=LOAD,
        setup=_hf_folder(_nan_weight),
    ),
    Case(
        "weights_int32",
        sft(*HF),
        ("model.safetensors", "down_proj", "int32"),
        seconds=LOAD,
        setup=_hf_folder(_int_weight),
    ),
    Case("weights_missing_tensor", sft(*HF), ("o_proj",), seconds=LOAD, setup=_hf_folder(_missing_weight)),
    Case("weights_wrong_shape", sft(*HF), ("up_proj", "shape"), seconds=LOAD, setup=_hf_folder(_wrong_shape)),
    Case("weights_truncated", sft(*HF), ("model.safetensors",), seconds=LOAD, setup=_hf_folder(truncate=True)),
    Case(
        "tokenizer_larger_than_vocabulary",
        rl("--config.model.arch.vocab_size=1000"),
        (r"model\.tokenizer|tokenizer", "1000"),
        seconds=LOAD,
    ),
    # --- Checkpoints, the run folder and the disk ------------------------------------------------------------
    Case("every_checkpoint_damaged", sft(), (r"checkpoints",), seconds=LOAD, setup=_checkpoints(_damage_all_steps)),
    Case(
        "checkpoint_with_nan_weights", sft(), (r"checkpoints", r"4"), seconds=LOAD, setup=_checkpoints(_nan_checkpoint)
    ),
    Case("run_dir_in_use", sft(), (r"run", r"in use", r"pid \d+"), seconds=LOAD, setup=_lock_run),
    Case(
        "disk_full_while_checkpointing",
        sft("--config.checkpoint.resume=False"),
        (r"File too large|No space", r"run"),
        seconds=RUN,
    ),
    # --- A reward that fails on every row (RL data without answers): named reward and error ------------------
    Case(
        "reward_fails_on_every_row",
        rl(*JSONL_ARGS, config="{case}/config.py"),
        (r"reward 'gsm8k'", r"rollout\.max_reward_failure_frac", "answer"),
        seconds=RUN,
        setup=lambda case, data: (
            _config_file('config.rollout.rewards = {"gsm8k": 1.0}\nconfig.eval.during_training = False')(case, data),
            _write(case / "data.jsonl", _jsonl([{"prompt": f"What is {i} + 1?"} for i in range(16)])),
        ),
    ),
]

DISK_LIMIT_BYTES = 64 * 1024  # RLIMIT_FSIZE for the disk-full case: any file past 64 KiB fails with EFBIG


@dataclasses.dataclass
class Outcome:
    returncode: int
    stdout: str
    stderr: str
    seconds: float
    before: dict[str, str]
    after: dict[str, str]
    run_dir: Path
    before_run_log: bytes = b""
    run_log_head: bytes = b""


def _hashes(folder: Path) -> dict[str, str]:
    if not folder.exists():
        return {}
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def _limit_file_size() -> None:
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
    resource.setrlimit(resource.RLIMIT_FSIZE, (DISK_LIMIT_BYTES, DISK_LIMIT_BYTES))


def _run_case(case: Case, folder: Path, data: Path) -> Outcome:
    folder.mkdir(parents=True, exist_ok=True)
    if case.setup is not None:
        case.setup(folder, data)
    run_dir = folder / "run"
    # What the user already has in the run folder: it must come out untouched.
    _write(run_dir / "notes" / "precious.txt", "results of an earlier run\n")
    before = _hashes(run_dir)
    log_file = run_dir / "run.log"
    before_run_log = log_file.read_bytes() if log_file.exists() else b""
    args = [a.replace("{case}", str(folder)).replace("{data}", str(data)) for a in case.args]
    env = dict(os.environ, JAX_PLATFORMS="cpu", RAY_AUTH_MODE="disabled", WANDB_MODE="offline")
    t0 = time.monotonic()
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "feynrl_jax.cli.main", *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=folder,
            timeout=case.seconds + 120,
            preexec_fn=_limit_file_size if case.id == "disk_full_while_checkpointing" else None,
        )
    finally:
        holder = folder / "holder.pid"
        if holder.exists():
            os.kill(int(holder.read_text()), signal.SIGKILL)
    seconds = time.monotonic() - t0
    head = log_file.read_bytes()[: len(before_run_log)] if log_file.exists() else b""
    return Outcome(
        proc.returncode, proc.stdout, proc.stderr, seconds, before, _hashes(run_dir), run_dir, before_run_log, head
    )


TINY_SFT_CONFIG = """
import os
from feynrl_jax.config.base import add_data_source, base_config, data_source

HERE = os.path.dirname(os.path.abspath(__file__))


def get_config(arg=None):
    config = base_config()
    config.paradigm = "sft"
    config.run_dir = "runs/tiny_sft"
    config.model.random_init = True
    config.model.tokenizer = os.path.join(HERE, "tokenizer")
    arch = config.model.arch
    arch.vocab_size, arch.hidden_size, arch.intermediate_size = 288, 32, 64
    arch.num_heads, arch.num_kv_heads, arch.head_dim = 4, 2, 8
    add_data_source(config, "toy", data_source("jsonl", path=os.path.join(HERE, "train.jsonl")))
    config.data.max_seq_len = 48
    config.data.max_prompt_len = 32
    config.algo.name = "sft"
    config.algo.reference = "none"
    config.optim.lr = 3e-3
    config.train.steps = 4
    config.train.global_batch_size = 8
    config.checkpoint.every_steps = 2
    config.checkpoint.keep = 5
    config.checkpoint.async_save = False
    config.eval.during_training = False
    config.tracking.progress_bar = False
    return config
"""


@pytest.fixture(scope="module")
def shared_data(tmp_path_factory) -> Path:
    """The tiny SFT config with its toy tokenizer and data, a finished 4-step run of it (checkpoints at steps 2
    and 4), and a tiny Hugging Face model folder."""
    from feynrl_jax.data.toy_tokenizer import build_toy_tokenizer

    root = tmp_path_factory.mktemp("bad_inputs_data")
    rows = [{"prompt": f"What is {i % 7} plus {i % 5}?", "response": f"#### {i % 7 + i % 5}"} for i in range(32)]
    _write(root / "train.jsonl", _jsonl(rows))
    build_toy_tokenizer([r["prompt"] + " " + r["response"] for r in rows], vocab_size=280).save_pretrained(
        root / "tokenizer"
    )
    _write(root / "tiny_sft.py", TINY_SFT_CONFIG)
    env = dict(os.environ, JAX_PLATFORMS="cpu", WANDB_MODE="offline")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "feynrl_jax.cli.main",
            "train",
            f"--config={root}/tiny_sft.py",
            f"--config.run_dir={root}/sft_run",
        ],
        check=True,
        env=env,
        capture_output=True,
        timeout=600,
    )
    _save_hf_folder(root / "hf_model", root / "tokenizer")
    return root


def _save_hf_folder(folder: Path, tokenizer_dir: Path) -> None:
    import jax

    from feynrl_jax.checkpoints.hf_safetensors import export_hf
    from feynrl_jax.models.config import ModelConfig
    from feynrl_jax.models.decoder import init_params

    config = ModelConfig(
        vocab_size=288, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8
    )
    export_hf(init_params(config, jax.random.key(0)), config, folder, tokenizer_dir)


@pytest.fixture(scope="module")
def outcomes(request, shared_data, tmp_path_factory):
    """Runs the selected cases, two at a time; maps the case id to its future `Outcome`."""
    root = tmp_path_factory.mktemp("bad_inputs")
    selected = [
        item.callspec.params["case"]
        for item in request.session.items
        if getattr(item, "originalname", None) == "test_bad_input"
    ]
    pool = ThreadPoolExecutor(max_workers=2)
    futures = {case.id: pool.submit(_run_case, case, root / case.id, shared_data) for case in selected}
    yield futures
    pool.shutdown(wait=True, cancel_futures=True)


def test_the_suite_has_at_least_sixty_cases():
    assert len(CASES) >= 60
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input(case: Case, outcomes):
    out = outcomes[case.id].result()
    assert out.returncode == case.exit_code, f"exit {out.returncode}\nstderr:\n{out.stderr[-3000:]}"
    assert out.stderr.count("feynrl-jax: error:") == 1, f"want one error\nstderr:\n{out.stderr[-3000:]}"
    # The error is the last thing printed: one line (a config with several problems lists one per line).
    message = out.stderr[out.stderr.index("feynrl-jax: error:") :]
    for name in case.names:
        assert re.search(name, message), f"{name!r} not in: {message}"
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.seconds <= case.seconds, f"took {out.seconds:.1f} s (limit {case.seconds:.0f} s)"
    if case.seconds == FAST:  # the config alone showed it: neither JAX's backend nor Ray started
        assert "Ray" not in out.stderr and "Ray" not in out.stdout, out.stderr[-2000:]
    # Nothing the user had in the run folder was lost or changed.
    for path, digest in out.before.items():
        if path == "run.log":  # every attempt appends its own lines to the run's log
            assert out.after.get(path) is not None and out.run_log_head == out.before_run_log, "run.log was rewritten"
            continue
        assert out.after.get(path) == digest, f"{path} was changed or removed"
    # Nothing new is half-written: JSON parses; a log of the run says where the traceback went.
    for path in set(out.after) - set(out.before):
        full = out.run_dir / path
        if full.suffix == ".json" and ".orbax-checkpoint-tmp" not in path:
            json.loads(full.read_text())
        if full.name == "metrics.jsonl":
            for line in full.read_text().splitlines():
                json.loads(line)
    log = out.run_dir / "run.log"
    if log.exists() and "(traceback: " in message:  # claimed: the traceback is there
        assert "Traceback" in log.read_text(errors="replace")
    elif log.exists():
        # Not claimed: only where the log itself reached the disk-full case's size limit (orbax logs a traceback for
        # each of its writer threads that failed, before and after the CLI's own, and how many varies from run to run).
        assert case.id == "disk_full_while_checkpointing" and log.stat().st_size >= DISK_LIMIT_BYTES, message


@pytest.mark.parametrize("room", [True, False], ids=["log_has_room", "log_full"])
def test_the_traceback_is_claimed_only_where_the_run_log_took_it(tmp_path, room):
    """A full disk can fill the run log too (orbax logs a traceback per failed writer): the error stays one line
    and points at the log for its traceback only where the traceback was written there."""
    log = tmp_path / "run.log"
    log.write_bytes(b"x" * (1000 if room else DISK_LIMIT_BYTES - 10))
    code = textwrap.dedent(f"""
        from feynrl_jax.cli import main as cli

        def train(argv):
            raise OSError(28, "No space left on device", "checkpoints/2")

        cli._run_log = {str(log)!r}
        cli.COMMANDS["train"] = train
        cli.main(["feynrl-jax", "train"])
    """)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, preexec_fn=_limit_file_size
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    message = proc.stderr[proc.stderr.index("feynrl-jax: error:") :].strip()
    assert message.startswith("feynrl-jax: error: No space left on device: checkpoints/2")
    written = log.read_bytes()
    if room:
        assert message.endswith(f"(traceback: {log})")
        assert b"feynrl-jax train failed: No space left on device" in written and b"Traceback" in written
    else:
        assert "(traceback" not in message
        assert len(written) == DISK_LIMIT_BYTES  # the append stopped at the limit
