"""The `feynrl-jax` command line: fast failures on bad configs, and dispatch to each subcommand's function."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from feynrl_jax.cli import main as cli

ROOT = pathlib.Path(__file__).resolve().parents[1]


def feynrl_jax(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    """Runs the installed console script from the repository root."""
    script = shutil.which("feynrl-jax") or str(pathlib.Path(sys.executable).parent / "feynrl-jax")
    return subprocess.run([script, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.mark.serial  # times the CLI: nothing beside it
def test_misspelt_key_fails_fast_naming_it_and_the_closest_key():
    start = time.monotonic()
    result = feynrl_jax("train", "--config=configs/grpo_demo.py", "--config.optim.lrr=1")
    elapsed = time.monotonic() - start
    assert result.returncode == cli.EXIT_USAGE, result.stderr
    assert "optim.lrr" in result.stderr
    assert "did you mean optim.lr?" in result.stderr
    assert elapsed < 10, f"took {elapsed:.1f} s"


@pytest.mark.parametrize(
    "args,expected",
    [
        (("--config.optim.lr=fast",), "optim.lr expects float, got 'fast'"),
        (("--config.rollout.n_samples=1",), "rollout.n_samples=1; it needs at least 2"),
        (("--config.rollout.max_new_tokens=400",), "rollout.max_new_tokens=400 plus data.max_prompt_len"),
        (("--config.algo.name=grpoo",), "did you mean grpo?"),
        (("--config.data.sources.arith.weigth=0.5",), "did you mean data.sources.arith.weight?"),
    ],
)
def test_bad_overrides_exit_with_one_sentence(args, expected):
    result = feynrl_jax("train", "--config=configs/grpo_demo.py", *args)
    assert result.returncode == cli.EXIT_USAGE
    assert expected in result.stderr


def test_a_loss_in_the_working_directory_is_found_by_module_function(tmp_path):
    """`--config.algo.name=my_losses:fn` imports `my_losses.py` from where the command runs (a console script's
    own import path is its bin/ folder). Stopping at another bad key shows that the name itself resolved."""
    (tmp_path / "my_losses.py").write_text(
        "from feynrl_jax.losses import aggregate\n\n\n"
        "def reinforce(logprobs, batch, *, entropy=None, values=None):\n"
        "    per_token = -batch.advantages * logprobs\n"
        "    return aggregate(per_token, batch.loss_mask, batch.segment_ids, mode='token_mean'), {}\n"
    )
    script = shutil.which("feynrl-jax") or str(pathlib.Path(sys.executable).parent / "feynrl-jax")
    config = f"--config={ROOT / 'configs' / 'grpo_demo.py'}"

    def train(*args):
        command = [script, "train", config, *args]
        return subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=60)

    result = train("--config.algo.name=my_losses:reinforce", "--config.optim.lr=-1")
    assert result.returncode == cli.EXIT_USAGE
    assert "optim.lr" in result.stderr and "algo.name" not in result.stderr, result.stderr
    result = train("--config.algo.name=my_losses:reinforc")
    assert result.returncode == cli.EXIT_USAGE
    assert "algo.name='my_losses:reinforc'" in result.stderr and "has no attribute 'reinforc'" in result.stderr


def test_bad_command_lines():
    cases = [
        (("train",), "needs --config"),
        (("train", "--config=configs/no_such.py"), "does not exist"),
        (("train", "--config=configs/grpo_demo.py:runlocl"), "did you mean runlocal?"),
        (("fly",), "unknown command 'fly'"),
        (("export", "/no/such/run", "--out=/tmp/x"), "does not exist"),
        (("convert", "--gguf=smollm2"), "usage: feynrl-jax convert"),
        (("train", "--config=configs/eval_smollm2.py"), "not trainable"),
    ]
    for args, expected in cases:
        result = feynrl_jax(*args)
        assert result.returncode == cli.EXIT_USAGE, (args, result.stderr)
        assert expected in result.stderr, (args, result.stderr)


def test_validation_path_never_imports_jax():
    code = textwrap.dedent(
        """
        import sys
        from feynrl_jax.cli import main
        sys.argv = ["feynrl-jax", "train", "--config=configs/grpo_demo.py", "--config.optim.lr=-1"]
        try:
            main.run()
        except SystemExit as e:
            assert e.code == main.EXIT_USAGE, e.code
        heavy = sorted(m for m in ("jax", "flax", "optax", "ray", "torch", "transformers") if m in sys.modules)
        assert not heavy, heavy
        """
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "optim.lr=-1.0 must be positive" in result.stderr


def test_entries_name_the_contracted_functions():
    for entry in (*cli.LOOPS.values(), cli.EVALUATE, cli.CONVERT_GGUF, cli.FIND_SMOLLM2, cli.EXPORT, cli.PLOT):
        assert callable(entry.load()), entry
    assert cli.LOOPS["sft"] == cli.Entry("feynrl_jax.train.sft_loop", "run")
    assert cli.LOOPS["dpo"] == cli.Entry("feynrl_jax.train.dpo_loop", "run")
    assert cli.LOOPS["rl"] == cli.Entry("feynrl_jax.orchestration.rl_loop", "run")
    assert cli.EVALUATE == cli.Entry("feynrl_jax.eval.evaluate", "run")
    assert cli.EXPORT == cli.Entry("feynrl_jax.train.export", "export_run")
    assert cli.PLOT == cli.Entry("feynrl_jax.tracking.plots", "plot_run")
    assert cli.CONVERT_GGUF == cli.Entry("feynrl_jax.checkpoints", "convert_gguf")


def test_train_dispatches_on_paradigm_with_overrides_and_resume(tmp_path):
    """A stand-in loop module records what `train` hands it; the real loops are exercised by their own tests."""
    (tmp_path / "recording_loop.py").write_text(
        "import json, os\n"
        "def run(config):\n"
        "    with open(os.environ['RECORD'], 'w') as f:\n"
        "        json.dump({'paradigm': config.paradigm, 'lr': config.optim.lr,\n"
        "                   'resume': config.checkpoint.resume, 'steps': config.train.steps,\n"
        "                   'weight': config.data.sources.arith.weight}, f)\n"
    )
    record = tmp_path / "record.json"
    code = textwrap.dedent(
        f"""
        import sys
        sys.path.insert(0, {str(tmp_path)!r})
        from feynrl_jax.cli import main
        for paradigm in ("sft", "dpo", "rl"):
            main.LOOPS[paradigm] = main.Entry("recording_loop", "run")
        sys.argv = ["feynrl-jax", "train", "--config=configs/sft_smollm2_arith.py:runlocal",
                    "--config.optim.lr=3e-6", "--noresume", "--config.data.sources.arith.weight=0.5"]
        main.run()
        """
    )
    env = dict(os.environ, RECORD=str(record))
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr

    assert json.loads(record.read_text()) == {
        "paradigm": "sft",
        "lr": 3e-6,
        "resume": False,
        "steps": 2,
        "weight": 0.5,
    }
