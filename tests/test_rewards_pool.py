"""The reward worker pool: per-call timeouts, exceptions, dying workers, and no leaked processes.

The rewards below are module-level functions: the spawned workers import this module to unpickle them.
"""

import gc
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from feynrl_jax.errors import InputError
from feynrl_jax.rollout.rewards import (
    RewardError,
    RewardScorer,
    RewardTimeout,
    TimeoutProcessPool,
    WeightedSum,
    bind_reward,
)
from feynrl_jax.rollout.rewards.process_pool import STATUS_ERROR, STATUS_OK, STATUS_TIMEOUT, worker_imports

# The pool's timeouts are checked against the wall clock, to a few seconds: nothing runs beside these tests.
pytestmark = pytest.mark.serial

TIMEOUT_S = 1.0


def sleepy_reward(prompt, completion, example):
    """Sleeps forever on rows marked "sleep", else scores 1."""
    if example.get("sleep"):
        while True:
            time.sleep(3600)
    return 1.0


def raising_reward(prompt, completion, example):
    """Raises on rows marked "raise", else scores the completion's length."""
    if example.get("raise"):
        raise ZeroDivisionError("bad row")
    return float(len(completion))


def dying_reward(prompt, completion, example):
    """Kills its own worker process on rows marked "die"."""
    if example.get("die"):
        os._exit(3)
    return 0.5


def nan_reward(prompt, completion, example):
    return float("nan")


def giving_up_reward(prompt, completion, example):
    """Gives up on rows marked "give_up" (as a reward whose own time bound fired), else scores its worker's pid."""
    if example.get("give_up"):
        raise RewardTimeout("my own 2 s bound fired")
    return float(os.getpid())


def _alive(pid):
    """Whether process ``pid`` exists and is not a zombie (orphans may be reaped late in containers)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


SPECS = {
    f"{__name__}:sleepy_reward": 1.0,
    f"{__name__}:raising_reward": 1.0,
    f"{__name__}:dying_reward": 1.0,
}
SLEEPY, RAISING, DYING = SPECS


@pytest.fixture(scope="module")
def scorer():
    with RewardScorer(SPECS, timeout_s=TIMEOUT_S, num_workers=2) as scorer:
        scorer.score(["warm-up"] * 4, ["x"] * 4, [{}] * 4)  # Wait for the workers to start.
        yield scorer


def test_forever_sleeping_reward_is_cut_off_at_its_timeout(scorer):
    examples = [{}] * 8
    examples[2] = {"sleep": True}
    pids_before = set(scorer.worker_pids)
    start = time.monotonic()
    rewards, per_reward, metrics = scorer.score(["p"] * 8, ["abc"] * 8, examples)
    elapsed = time.monotonic() - start
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 3.0
    want_sleepy = np.ones(8)
    want_sleepy[2] = 0.0
    np.testing.assert_array_equal(per_reward[SLEEPY], want_sleepy)
    # The other rewards of the timed-out row still ran (the rest of its chunk went to a live worker).
    np.testing.assert_array_equal(per_reward[RAISING], 3.0)
    np.testing.assert_array_equal(per_reward[DYING], 0.5)
    np.testing.assert_allclose(rewards, want_sleepy + 3.5)
    assert metrics[f"rollout/reward/{SLEEPY}/timeouts"] == 1
    assert metrics[f"rollout/reward/{SLEEPY}/errors"] == 0
    assert metrics[f"rollout/reward/{RAISING}/timeouts"] == 0
    # A timeout is a failed call: counted in the failure fractions and kept as an example error.
    assert metrics[f"rollout/reward/{SLEEPY}/failed_frac"] == 1 / 8
    assert metrics[f"rollout/reward/{RAISING}/failed_frac"] == 0.0
    assert metrics["rollout/reward_failed_frac"] == 1 / 24
    assert scorer.last_errors == [(2, SLEEPY, f"timed out after {TIMEOUT_S} s")]
    # The hung worker was killed and replaced.
    pids_after = set(scorer.worker_pids)
    killed = pids_before - pids_after
    assert len(killed) == 1 and len(pids_after) == 2
    assert not any(_alive(pid) for pid in killed)

    # The pool keeps working, including two hangs at once (each call gets its own timeout).
    examples = [{}] * 6
    examples[1] = examples[4] = {"sleep": True}
    rewards, per_reward, metrics = scorer.score(["p"] * 6, ["ab"] * 6, examples)
    np.testing.assert_array_equal(per_reward[SLEEPY], [1, 0, 1, 1, 0, 1])
    assert metrics[f"rollout/reward/{SLEEPY}/timeouts"] == 2
    rewards, per_reward, metrics = scorer.score(["p"] * 5, ["ab"] * 5, [{}] * 5)
    np.testing.assert_allclose(rewards, 3.5)
    assert metrics[f"rollout/reward/{SLEEPY}/timeouts"] == 0


def test_exception_scores_zero_and_is_counted(scorer):
    examples = [{}, {"raise": True}, {}, {}, {"raise": True}]
    completions = ["a", "bb", "ccc", "dddd", "eeeee"]
    rewards, per_reward, metrics = scorer.score(["p"] * 5, completions, examples)
    np.testing.assert_array_equal(per_reward[RAISING], [1.0, 0.0, 3.0, 4.0, 0.0])
    np.testing.assert_array_equal(per_reward[SLEEPY], 1.0)
    np.testing.assert_allclose(rewards, per_reward[RAISING] + 1.5)
    assert metrics[f"rollout/reward/{RAISING}/errors"] == 2
    assert metrics[f"rollout/reward/{RAISING}/timeouts"] == 0
    assert metrics[f"rollout/reward/{SLEEPY}/errors"] == 0


def test_a_reward_failing_on_too_many_items_stops_the_run_naming_it(caplog):
    # RL data without the `answer` field that the reward reads: every call raises KeyError.
    examples = [{"prompt": "p", "source": "train", "row": 1 + i} for i in range(4)]
    with RewardScorer({"gsm8k": 1.0}, timeout_s=5.0, num_workers=1, max_failure_frac=0.5) as scorer:
        with pytest.raises(RewardError) as info:
            scorer.score(["p"] * 4, ["#### 4"] * 4, examples)
        assert isinstance(info.value, InputError) and info.value.exit_code == 2
        assert str(info.value).startswith(
            "reward 'gsm8k' failed on 4/4 completions (limit rollout.max_reward_failure_frac=0.5); "
            "first error, row 0 (data.sources.train, row 1): KeyError: \"example has no gold answer field 'answer'"
        )
        assert [(row, name) for row, name, _ in scorer.last_errors] == [
            (0, "gsm8k"),
            (1, "gsm8k"),
            (2, "gsm8k"),
            (3, "gsm8k"),
        ]
        # At the limit (2/4 = 0.5, not more) the batch is scored, the failures counted and logged in one line.
        examples[1]["answer"] = examples[3]["answer"] = "4"
        rewards, _, metrics = scorer.score(["p"] * 4, ["#### 4"] * 4, examples)
    np.testing.assert_array_equal(rewards, [0.0, 1.0, 0.0, 1.0])
    assert metrics["rollout/reward/gsm8k/failed_frac"] == metrics["rollout/reward_failed_frac"] == 0.5
    assert metrics["rollout/reward/gsm8k/errors"] == 2
    (line,) = [r.getMessage() for r in caplog.records if r.name.endswith("scorer")]
    assert line.startswith("reward 'gsm8k' failed on 2/4 completions; first error, row 0 (data.sources.train, row 1)")
    with pytest.raises(ValueError, match="max_failure_frac"):
        RewardScorer({"gsm8k": 1.0}, max_failure_frac=1.5)


def test_dying_worker_scores_zero_and_is_replaced(scorer):
    examples = [{}, {}, {"die": True}, {}]
    pids_before = set(scorer.worker_pids)
    _, per_reward, metrics = scorer.score(["p"] * 4, ["x"] * 4, examples)
    np.testing.assert_array_equal(per_reward[DYING], [0.5, 0.5, 0.0, 0.5])
    np.testing.assert_array_equal(per_reward[RAISING], 1.0)
    assert metrics[f"rollout/reward/{DYING}/errors"] == 1
    assert len(pids_before - set(scorer.worker_pids)) == 1
    _, per_reward, _ = scorer.score(["p"] * 3, ["x"] * 3, [{}] * 3)
    np.testing.assert_array_equal(per_reward[DYING], 0.5)


def test_hang_in_the_middle_of_a_chunk_with_a_single_worker():
    # Three rewards, one row per chunk: the hang is the chunk's second call; the third call must be requeued and
    # run by the replacement worker (the only worker left, still starting when the hang is detected).
    functions = [raising_reward, sleepy_reward, dying_reward]
    rows = [("p", "ab", {}), ("p", "abc", {"sleep": True}), ("p", "abcd", {})]
    with TimeoutProcessPool(functions, num_workers=1, timeout_s=TIMEOUT_S, max_chunk=3) as pool:
        start = time.monotonic()
        result = pool.map(rows)
        assert time.monotonic() - start >= TIMEOUT_S
        assert pool.workers_replaced == 1
    np.testing.assert_array_equal(result.values, [[2.0, 1.0, 0.5], [3.0, 0.0, 0.5], [4.0, 1.0, 0.5]])
    np.testing.assert_array_equal(result.status, [[0, 0, 0], [0, 2, 0], [0, 0, 0]])
    assert result.errors == [(1, 1, f"timed out after {TIMEOUT_S} s")]


def test_non_finite_reward_is_an_error():
    with TimeoutProcessPool([nan_reward, raising_reward], num_workers=1, timeout_s=10.0) as pool:
        result = pool.map([("p", "xy", {})])
    np.testing.assert_array_equal(result.values, [[0.0, 2.0]])
    np.testing.assert_array_equal(result.status, [[1, 0]])
    assert result.errors == [(0, 0, "ValueError: reward returned a non-finite value nan")]


def test_a_reward_reporting_its_own_timeout_is_a_timeout_and_keeps_its_worker():
    functions = [giving_up_reward, raising_reward]
    rows = [("p", "a", {}), ("p", "bb", {"give_up": True, "raise": True}), ("p", "ccc", {})]
    # One call per chunk, and a pool timeout the test never reaches: the timeout below is the reward's own.
    with TimeoutProcessPool(functions, num_workers=1, timeout_s=600.0, max_chunk=1) as pool:
        result = pool.map(rows)
        (pid,) = pool.worker_pids
        assert pool.workers_replaced == 0
    # The worker that gave up on row 1 went on to serve row 2.
    np.testing.assert_array_equal(result.values, [[pid, 1.0], [0.0, 0.0], [pid, 3.0]])
    np.testing.assert_array_equal(
        result.status,
        [[STATUS_OK, STATUS_OK], [STATUS_TIMEOUT, STATUS_ERROR], [STATUS_OK, STATUS_OK]],
    )
    assert result.errors == [(1, 0, "RewardTimeout: my own 2 s bound fired"), (1, 1, "ZeroDivisionError: bad row")]


def test_the_scorer_counts_a_reward_reporting_its_own_timeout_as_a_timeout():
    name = f"{__name__}:giving_up_reward"
    examples = [{}, {"give_up": True}, {}, {"give_up": True}]
    with RewardScorer({name: 0.0}, timeout_s=600.0, num_workers=1) as scorer:
        _, per_reward, metrics = scorer.score(["p"] * 4, ["c"] * 4, examples)
        assert per_reward[name][1] == per_reward[name][3] == 0.0
        assert per_reward[name][0] == per_reward[name][2] == scorer.worker_pids[0]
        assert scorer.last_errors == [(i, name, "RewardTimeout: my own 2 s bound fired") for i in (1, 3)]
    assert metrics[f"rollout/reward/{name}/timeouts"] == 2
    assert metrics[f"rollout/reward/{name}/errors"] == 0
    assert metrics[f"rollout/reward/{name}/failed_frac"] == 0.5


def test_many_cheap_items_are_fast_and_ordered():
    n = 2000
    completions = [f"#### {i}" for i in range(n)]
    examples = [{"answer": str(i if i % 3 else i + 1)} for i in range(n)]
    with RewardScorer({"gsm8k": 1.0, "format": 1.0}, timeout_s=10.0, num_workers=2) as scorer:
        scorer.score(["p"], ["#### 1"], [{"answer": "1"}])
        start = time.monotonic()
        _, per_reward, _ = scorer.score(["p"] * n, completions, examples)
        elapsed = time.monotonic() - start
    np.testing.assert_array_equal(per_reward["gsm8k"], [float(i % 3 != 0) for i in range(n)])
    np.testing.assert_array_equal(per_reward["format"], 0.0)
    assert elapsed < 5.0, f"{n} cheap items took {elapsed:.2f} s"


def test_close_leaves_no_child_process():
    scorer = RewardScorer({"gsm8k": 1.0}, timeout_s=5.0, num_workers=2)
    rewards, _, _ = scorer.score(["p"], ["#### 4"], [{"answer": "4"}])
    assert rewards.tolist() == [1.0]
    pids = scorer.worker_pids
    assert all(_alive(pid) for pid in pids)
    scorer.close()
    scorer.close()  # Idempotent.
    assert not any(_alive(pid) for pid in pids)
    assert not {p.pid for p in multiprocessing.active_children()} & set(pids)
    with pytest.raises(RuntimeError, match="closed"):
        scorer.score(["p"], ["#### 4"], [{"answer": "4"}])

    with RewardScorer({"gsm8k": 1.0}, timeout_s=5.0, num_workers=1) as scorer:
        pids = scorer.worker_pids
    assert not any(_alive(pid) for pid in pids)

    # A scorer dropped without close() stops its workers when garbage collected.
    scorer = RewardScorer({"gsm8k": 1.0}, timeout_s=5.0, num_workers=1)
    scorer.score(["p"], ["#### 4"], [{"answer": "4"}])
    pids = scorer.worker_pids
    del scorer
    gc.collect()
    assert not any(_alive(pid) for pid in pids)


def test_unpicklable_reward_is_rejected_by_name():
    with pytest.raises(TypeError, match="cannot be pickled"):
        TimeoutProcessPool([lambda p, c, e: 1.0], num_workers=1, timeout_s=1.0)


def test_bad_inputs_are_named():
    with RewardScorer({"gsm8k": 1.0}, timeout_s=5.0, num_workers=1) as scorer:
        with pytest.raises(ValueError, match="one entry per item"):
            scorer.score(["p", "p"], ["c"], [{}])
        with pytest.raises(ValueError, match="row 1 must be a mapping"):
            scorer.score(["p", "p"], ["c", "c"], [{}, "answer"])
        with pytest.raises(ValueError, match="completion_lengths has 1 entries for 2"):
            scorer.score(["p", "p"], ["c", "c"], [{}, {}], completion_lengths=[3])
        with pytest.raises(ValueError, match="row 1 cannot be pickled"):
            scorer.score(["p", "p"], ["c", "c"], [{}, {"answer": lambda: 1}])
        # The pool is intact after rejected input.
        assert scorer.score(["p"], ["#### 2"], [{"answer": "2"}])[0].tolist() == [1.0]
        rewards, per_reward, metrics = scorer.score([], [], [])
        assert rewards.shape == (0,) and per_reward["gsm8k"].shape == (0,)
        assert np.isnan(metrics["rollout/reward/gsm8k/mean"])


_ORPHAN_SCRIPT = """
import sys
sys.path.insert(0, {tests_dir!r})
from feynrl_jax.rollout.rewards import RewardScorer
scorer = RewardScorer({{"test_rewards_pool:sleepy_reward": 1.0}}, timeout_s=600.0, num_workers=2)
scorer.score(["p"], ["x"], [{{}}])
print(*scorer.worker_pids, flush=True)
scorer.score(["p"], ["x"], [{{"sleep": True}}])
"""


def test_workers_exit_when_the_parent_is_killed():
    script = _ORPHAN_SCRIPT.format(tests_dir=os.path.dirname(__file__))
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(pid) for pid in pids)
        time.sleep(0.5)  # One worker is now stuck in the sleeping reward.
    finally:
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
    deadline = time.monotonic() + 10.0
    while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids)


_REASONING_GYM_SCRIPT = """
import json, sys
from feynrl_jax.rollout.rewards import RewardScorer
entry = json.loads(sys.argv[1])
completions = [f"<answer>{{entry['answer']}}</answer>", "<answer>not it</answer>"]
with RewardScorer({{"reasoning_gym": 1.0}}, timeout_s={timeout_s}, num_workers=1) as scorer:
    built = "reasoning_gym" in sys.modules
    rewards, _, metrics = scorer.score(["q", "q"], completions, [entry, entry])
print(json.dumps(dict(built=built, scored="reasoning_gym" in sys.modules, rewards=rewards.tolist(),
                      timeouts=metrics["rollout/reward/reasoning_gym/timeouts"])))
"""


def test_reasoning_gym_is_imported_by_the_workers_while_they_start_not_by_the_scorers_process():
    import json

    import reasoning_gym

    assert worker_imports(bind_reward("reasoning_gym", {"answer_tag": "answer"})) == ("reasoning_gym",)
    assert WeightedSum({"reasoning_gym": 1.0, "gsm8k": 0.5}).worker_imports == ("reasoning_gym",)
    entry = reasoning_gym.create_dataset("basic_arithmetic", size=1, seed=0)[0]
    # Importing reasoning-gym takes 2-3 s (more on a busy machine): were it imported at the first call, that call
    # would overrun a 1 s timeout and score 0; a worker that imported it while starting scores in milliseconds.
    script = _REASONING_GYM_SCRIPT.format(timeout_s=TIMEOUT_S)
    out = subprocess.run([sys.executable, "-c", script, json.dumps(entry)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"built": False, "scored": False, "rewards": [1.0, 0.0], "timeouts": 0}, out.stderr[-2000:]


def wave_was_imported(prompt, completion, example):
    """1 when the worker process had imported the standard library's `wave` (which nothing here imports) before
    the call, else 0."""
    return float("wave" in sys.modules)


def wave_imported_at_start(prompt, completion, example):
    return wave_was_imported(prompt, completion, example)


wave_imported_at_start.worker_imports = ("wave",)


def test_a_workers_start_up_imports_the_modules_its_rewards_name():
    assert "wave" not in sys.modules
    for reward, imported in ((wave_was_imported, 0.0), (wave_imported_at_start, 1.0)):
        with TimeoutProcessPool([reward], num_workers=1, timeout_s=TIMEOUT_S) as pool:
            assert pool.map([("p", "c", {})]).values.tolist() == [[imported]], reward
    assert "wave" not in sys.modules  # the process that built the pools did not import it


def needs_a_missing_module(prompt, completion, example):
    return 1.0


@pytest.mark.parametrize("module", ["feynrl_jax_no_such_module", "feynrl_jax_no_such_package.sub"])
def test_a_reward_needing_a_module_that_is_not_installed_is_refused_when_the_pool_is_built(monkeypatch, module):
    monkeypatch.setattr(needs_a_missing_module, "worker_imports", (module,), raising=False)
    with pytest.raises(ValueError, match=f"needs module '{module}', which is not installed"):
        TimeoutProcessPool([needs_a_missing_module], num_workers=1, timeout_s=1.0)
    monkeypatch.setattr(needs_a_missing_module, "worker_imports", module)
    with pytest.raises(TypeError, match="must be a tuple of module names"):
        TimeoutProcessPool([needs_a_missing_module], num_workers=1, timeout_s=1.0)
