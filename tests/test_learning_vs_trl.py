"""`benchmarks/learning_vs_trl.py`'s verdict, from saved runs: the per-seed and seed-mean times to a common accuracy.

The script reuses finished runs from its `--workdir` (one JSON per side and seed) and only summarises them, so
hand-made curves whose answers are worked out below go through the same code as a measurement does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = {"steps": 2, "eval_every": 1, "trl_eval_every": 1, "precision": "float32"}


def saved_run(side: str, seed: int, seconds: list[float], accuracy: list[float], budget: float | None) -> dict:
    return {
        "eval_steps": list(range(len(seconds))),
        "eval_seconds": seconds,
        "eval_accuracy": accuracy,
        "eval_prompts": 64,
        "wall_seconds": seconds[-1],
        "seed": seed,
        "side": side,
        "settings": SETTINGS,
        "budget": budget,
        "accuracy_before": accuracy[0],
        "accuracy_after": accuracy[-1],
    }


def test_the_verdict_per_seed_and_on_the_mean_over_seeds(tmp_path):
    runs = [
        saved_run("ours", 0, [0.0, 10.0, 20.0], [0.2, 0.5, 0.6], None),
        saved_run("trl", 0, [0.0, 8.0, 19.0], [0.2, 0.6, 0.5], 20.0),
        saved_run("ours", 1, [0.0, 11.0, 21.0], [0.2, 0.4, 0.6], None),
        saved_run("trl", 1, [0.0, 9.0, 20.0], [0.2, 0.2, 0.4], 21.0),
    ]
    for run in runs:
        (tmp_path / f"{run['side']}_seed{run['seed']}.json").write_text(json.dumps(run))
    out = tmp_path / "verdict.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "learning_vs_trl.py"), "--seeds", "0", "1", "--steps", "2"]
    command += ["--workdir", str(tmp_path), "--json", str(out), "--plot", str(tmp_path / "curves.png")]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "reusing" in done.stderr  # nothing was trained
    verdict = json.loads(out.read_text())["verdict"]

    # Per seed, the lower of the two final accuracies: seed 0 0.5 (ours at 10 s, TRL at 8 s), seed 1 0.4 (ours at
    # 11 s, TRL at 20 s).
    assert verdict["common_target_accuracy"] == [0.5, 0.4]
    assert verdict["ours_seconds_to_target"] == [10.0, 11.0]
    assert verdict["trl_seconds_to_target"] == [8.0, 20.0]
    # On the mean over seeds: the common gain is TRL's mean gain, 0.45 - 0.2 = 0.25 (ours' is 0.4). Ours' mean curve
    # is 0.2, 0.35 (10 s), 0.45 (11 s), 0.5, 0.6; TRL's 0.2, 0.4 (8 s), 0.4 (9 s), 0.35 (19 s: seed 0 fell to 0.5),
    # 0.45 (20 s). So TRL reaches half (0.325) and 80% (0.4) of the gain first, ours 90% (0.425) and all of it.
    assert abs(verdict["mean_curve_common_gain"] - 0.25) < 1e-12
    targets = verdict["mean_curve_targets"]
    assert [t["fraction"] for t in targets] == [0.5, 0.8, 0.9, 1.0]
    assert [round(t["accuracy"], 9) for t in targets] == [0.325, 0.4, 0.425, 0.45]
    assert [t["ours_seconds"] for t in targets] == [10.0, 11.0, 11.0, 11.0]
    assert [t["trl_seconds"] for t in targets] == [8.0, 8.0, 20.0, 20.0]
    assert verdict["ours_gain_at_least_trls"] is True
    assert (tmp_path / "curves.png").stat().st_size > 0


def charged(records: list[dict], colocated: bool) -> float:
    """`learning_vs_trl.ours_curve(records, colocated)["wall_seconds"]`, in a child process: importing the script
    in pytest's would re-execute pytest with the allocator's tunables (`python -c` is left as it is)."""
    code = (
        "import json, sys; sys.path.insert(0, 'benchmarks'); import learning_vs_trl as m; "
        "print(json.dumps(m.ours_curve(json.loads(sys.argv[1]), colocated=sys.argv[2] == '1')['wall_seconds']))"
    )
    command = [sys.executable, "-c", code, json.dumps(records), "1" if colocated else "0"]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def step_record(step: int, *, wall: float, evaluation: float, waited: float, rollout: float, engine: float) -> dict:
    return {
        "step": step,
        "perf/step_seconds": wall,
        "perf/eval_seconds": evaluation,
        "perf/trainer_wait_seconds": waited,
        "perf/rollout_seconds": rollout,
        "perf/rollout_engine_seconds": engine,
        "perf/reward_seconds": 0.5,
        "eval/accuracy": 0.5,
        "eval/num_prompts": 64,
    } | ({"perf/rollout_warmup_seconds": 10.0, "perf/rollout_warmup_past_start_seconds": 3.0} if step == 1 else {})


def test_a_colocated_run_is_charged_its_engine_time_in_either_order_of_generation_and_evaluation():
    """Every step trains 4 s, evaluates 6 s, generates 2 s and scores 0.5 s: 6.5 s of training a step, and step 1
    is charged the 3 s of the warm-up that outlasted the start-up (the evaluation before training hid them).

    Evaluation first: the generation queues behind it on the trainer actor, so the step after waits 2.5 s for the
    batch; its rollout time (8 s) holds the queue. Colocated, that is charged 6.5 s a step and the 3 s: 16 s. A
    worker's accounting (`perf/rollout_seconds`, which holds a worker's wait for its warm-up) would charge the
    queue behind the evaluation as generation: 6 s more a step, 3 s more at step 1 (no warm-up term), 25 s.
    Generation first: the evaluation queues behind it (8 s) and the step after waits for nothing; step 1's
    generation then waited the 3 s for the warm-up itself (5 s of engine time), so those are charged twice: 19 s,
    an overcharge of ours, never an undercharge."""
    start = {"step": 0, "perf/eval_seconds": 6.0, "eval/accuracy": 0.2, "eval/num_prompts": 64}
    evaluation_first = [
        start,
        *(step_record(s, wall=2.5 + 4 + 6, evaluation=6.0, waited=2.5, rollout=8.0, engine=2.0) for s in (1, 2)),
    ]
    generation_first = [
        start,
        step_record(1, wall=0 + 4 + 8, evaluation=8.0, waited=0.0, rollout=5.0, engine=5.0),
        step_record(2, wall=0 + 4 + 8, evaluation=8.0, waited=0.0, rollout=2.0, engine=2.0),
    ]
    assert abs(charged(evaluation_first, colocated=True) - 16.0) < 1e-9
    assert abs(charged(generation_first, colocated=True) - 19.0) < 1e-9
    assert abs(charged(evaluation_first, colocated=False) - 25.0) < 1e-9


def test_step_1_is_charged_the_update_compile_that_the_evaluation_hid_past_its_batch():
    """The evaluation-first run above (16 s colocated, 25 s with a worker), whose update compiled ahead until 12 s
    after the start-up. Its batch was ready 5.5 s after the start-up colocated (3 s of warm-up, 2 s of generation,
    0.5 s of scoring) and 8.5 s with a worker (its rollout time and the scoring): a first update with nothing before
    it would have waited 6.5 s and 3.5 s more. Where the update itself still waited 1 s for the compile, its wall
    time holds that second. A compile that ended before the batch was ready, or a step after step 1, costs
    nothing."""
    start = {"step": 0, "perf/eval_seconds": 6.0, "eval/accuracy": 0.2, "eval/num_prompts": 64}

    def run(compiled: float, waited: float) -> list[dict]:
        records = [start]
        for step in (1, 2):
            record = step_record(step, wall=2.5 + 4 + 6, evaluation=6.0, waited=2.5, rollout=8.0, engine=2.0)
            if step == 1:
                record |= {"perf/update_compile_past_start_seconds": compiled}
                record |= {"perf/update_compile_wait_seconds": waited}
            records.append(record)
        return records

    assert abs(charged(run(12.0, 0.0), colocated=True) - (16.0 + 6.5)) < 1e-9
    assert abs(charged(run(12.0, 0.0), colocated=False) - (25.0 + 3.5)) < 1e-9
    assert abs(charged(run(12.0, 1.0), colocated=True) - (16.0 + 5.5)) < 1e-9
    assert abs(charged(run(4.0, 0.0), colocated=True) - 16.0) < 1e-9


def test_the_compile_cache_mode_reaches_ours_runs_and_a_warm_summary_names_its_cache(tmp_path):
    """`--compile-cache`: cold turns JAX's cache off in ours' runs even where the caller's environment names a
    folder; warm points them at the workdir's folder, keeps its runs in folders and saved results of their own (a
    cold run is never read as a warm one), and a folder that holds programs already is used without a filling run."""
    code = (
        "import json, sys, argparse; sys.path.insert(0, 'benchmarks'); import learning_vs_trl as m; out = {}\n"
        "for mode in ('cold', 'warm'):\n"
        "    a = argparse.Namespace(compile_cache=mode, workdir=sys.argv[1], steps=2, eval_every=1,\n"
        "                           trl_eval_every=1, precision='float32', colocate=False)\n"
        "    out[mode] = [m.compile_cache_env(a), m.settings_of(a), m.run_config(a, 0).run_dir]\n"
        "print(json.dumps(out))"
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu", JAX_COMPILATION_CACHE_DIR=str(tmp_path / "callers_cache"))
    command = [sys.executable, "-c", code, str(tmp_path)]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    (cold_env, cold_settings, cold_dir), (warm_env, warm_settings, warm_dir) = out["cold"], out["warm"]
    assert cold_env["JAX_COMPILATION_CACHE_DIR"] == "" and cold_env["JAX_ENABLE_COMPILATION_CACHE"] == "false"
    assert warm_env["JAX_COMPILATION_CACHE_DIR"] == str(tmp_path / "jax_compile_cache")
    assert warm_env["JAX_ENABLE_COMPILATION_CACHE"] == "true"
    assert cold_settings == SETTINGS and warm_settings == SETTINGS | {"compile_cache": "warm"}
    assert cold_dir == str(tmp_path / "ours_seed0") and warm_dir == str(tmp_path / "ours_seed0_warm_cache")

    # A warm summary from saved runs: the folder holds a program, so nothing fills it, and the summary says so.
    (tmp_path / "jax_compile_cache").mkdir()
    (tmp_path / "jax_compile_cache" / "jit_step-0123").write_bytes(b"program")
    for side, budget in (("ours", None), ("trl", 20.0)):
        run = saved_run(side, 0, [0.0, 10.0, 20.0], [0.2, 0.5, 0.6], budget)
        run["settings"] = warm_settings
        (tmp_path / f"{side}_seed0.json").write_text(json.dumps(run))
    summary = tmp_path / "verdict.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "learning_vs_trl.py"), "--seeds", "0", "--steps", "2"]
    command += ["--compile-cache", "warm", "--workdir", str(tmp_path), "--json", str(summary)]
    command += ["--plot", str(tmp_path / "curves.png")]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "1 entries already, used as it is" in done.stderr and "reusing" in done.stderr
    settings = json.loads(summary.read_text())["settings"]
    assert settings["compile_cache"] == "warm"
    assert settings["compile_cache_fill"] == {
        "folder": str(tmp_path / "jax_compile_cache"),
        "filled_by": None,
        "entries_before": 1,
    }
