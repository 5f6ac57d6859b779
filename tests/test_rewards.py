"""Rewards: the math answer table, math-verify's timeouts, GSM8K extraction, reasoning-gym scoring, format, DAPO
overlong, weighted sums, the registry and the import rules.

The math rewards run through the real RewardScorer (worker processes), since math_verify_reward bounds math-verify
with SIGALRM.
"""

import json
import signal
import subprocess
import sys
import threading
import time
from fractions import Fraction

import hypothesis
import hypothesis.strategies as st
import numpy as np
import pytest
import reasoning_gym

from feynrl_jax.rollout.rewards import (
    FORMAT_PATTERNS,
    RewardScorer,
    RewardTimeout,
    WeightedSum,
    available_rewards,
    dapo_overlong_penalty,
    format_reward,
    gsm8k_reward,
    last_boxed_content,
    math_answer,
    parse_number,
    register_reward,
    resolve_reward,
)
from feynrl_jax.rollout.rewards.math_answer import math_verify_reward
from feynrl_jax.rollout.rewards.reasoning_gym_reward import reasoning_gym_reward

# (gold answer, completion, expected math_verify, expected gsm8k (strict: needs "####")).
MATH_TABLE = [
    ("13", "#### 12 ... wait, that is wrong. #### 13", 1.0, 1.0),
    ("12", "#### 12 ... wait, that is wrong. #### 13", 0.0, 0.0),
    ("42", "So the total is 42.\n#### 42.", 1.0, 1.0),
    ("1000", "#### $1,000", 1.0, 1.0),
    ("3.5", "#### 3.50", 1.0, 1.0),
    ("3.50", "The answer is 3.5", 1.0, 0.0),
    ("1000", "#### 1000.00", 1.0, 1.0),
    ("10", "#### 10 apples", 1.0, 1.0),
    ("-0.25", "#### -1/4", 1.0, 1.0),
    ("-7", "so the answer is $-7$", 1.0, 0.0),
    ("-7", "#### -7", 1.0, 1.0),
    ("-7", "#### 7", 0.0, 0.0),
    ("100", "#### 1,000", 0.0, 0.0),
    ("5", "#### five", 0.0, 0.0),
    ("0.5", r"The probability is \boxed{\frac{1}{2}}.", 1.0, 0.0),
    ("1/2", r"The probability is \boxed{\frac{1}{2}}.", 1.0, 0.0),
    (r"\frac{1}{2}", "#### 0.5", 1.0, 0.0),
    (r"\frac{1}{2}", r"\boxed{\frac{1}{3}}", 0.0, 0.0),
    ("1/3", r"\boxed{0.33}", 0.0, 0.0),
    ("(1, 2)", "$(1,2)$", 1.0, 0.0),
    ("(1,2)", r"The point is \boxed{(1, 2)}", 1.0, 0.0),
    ("(1, 2)", r"\boxed{(2, 1)}", 0.0, 0.0),
    (r"\sqrt{2}", r"\boxed{\sqrt 2}", 1.0, 0.0),
    ("x^2+1", r"\boxed{1+x^2}", 1.0, 0.0),
    ("x^2+1", r"\boxed{x^2-1}", 0.0, 0.0),
    (r"2\pi", r"The circumference is \boxed{2\pi}.", 1.0, 0.0),
    (r"\{1,2\}", r"\boxed{\{2,1\}}", 1.0, 0.0),
    ("2", r"First \boxed{1}; no, corrected: \boxed{2}", 1.0, 0.0),
    ("1", r"First \boxed{1}; no, corrected: \boxed{2}", 0.0, 0.0),
    ("72", "<think>48 + 24</think><answer>72</answer>", 1.0, 0.0),
    ("72", "<think>48 + 24</think><answer>71</answer>", 0.0, 0.0),
    ("72", "She sold 48/2 = 24 clips in May.\nShe sold 48+24 = 72 clips.\n#### 72", 1.0, 1.0),
    ("She sold 48+24 = 72 clips.\n#### 72", "#### 72", 1.0, 1.0),
    ("She sold 48+24 = 72 clips.\n#### 72", "#### 73", 0.0, 0.0),
    ("5", "", 0.0, 0.0),
    ("5", "I don't know.", 0.0, 0.0),
]


@pytest.fixture(scope="module")
def math_scorer():
    with RewardScorer({"math_verify": 1.0, "gsm8k": 1.0}, timeout_s=20.0, num_workers=2) as scorer:
        yield scorer


def test_math_answer_table(math_scorer):
    assert len(MATH_TABLE) >= 30
    golds, completions, want_mv, want_gsm = zip(*MATH_TABLE)
    examples = [{"answer": g} for g in golds]
    rewards, per_reward, metrics = math_scorer.score(["question"] * len(golds), list(completions), examples)
    bad = [
        (gold, completion, float(mv), float(gs), w_mv, w_gs)
        for gold, completion, mv, gs, w_mv, w_gs in zip(
            golds, completions, per_reward["math_verify"], per_reward["gsm8k"], want_mv, want_gsm
        )
        if (mv, gs) != (w_mv, w_gs)
    ]
    assert not bad, (
        "rows (gold, completion, math_verify, gsm8k, want math_verify, want gsm8k):\n"
        + "\n".join(map(repr, bad))
        + f"\nfailed calls (a math-verify bound that fired reads RewardTimeout): {math_scorer.last_errors}"
    )
    np.testing.assert_allclose(rewards, np.add(want_mv, want_gsm))
    assert metrics["rollout/reward/math_verify/timeouts"] == 0
    assert metrics["rollout/reward/math_verify/errors"] == 0
    assert metrics["rollout/reward/math_verify/mean"] == pytest.approx(np.mean(want_mv))


def test_math_verify_reads_configured_answer_field_and_tag():
    with RewardScorer(
        {"math_verify": 1.0},
        reward_kwargs={"math_verify": {"answer_key": "solution", "answer_tag": "final"}},
        timeout_s=20.0,
        num_workers=1,
    ) as scorer:
        _, per_reward, metrics = scorer.score(
            ["q", "q", "q"],
            ["<final>\\frac{3}{4}</final>", "<final>0.7</final> 0.75", "0.75"],
            [{"solution": "0.75"}, {"solution": "0.75"}, {"answer": "0.75"}],
        )
    np.testing.assert_array_equal(per_reward["math_verify"], [1.0, 0.0, 0.0])
    # The third example lacks "solution": an error, scored 0 and counted.
    assert metrics["rollout/reward/math_verify/errors"] == 1


# Completions that make math-verify overrun a 1 s bound: parsing 60 nested parentheses and comparing 2000000! with a
# number each take 15-25 s unbounded on a 2-core machine, so far more than 1 s anywhere.
PARSE_OVERRUN = r"\boxed{" + "(" * 60 + "1" + ")" * 60 + "}"
VERIFY_OVERRUN = r"\boxed{2000000!}"


def test_math_verify_reward_raises_reward_timeout_when_a_bound_fires():
    with pytest.raises(RewardTimeout, match="^math-verify parsing the completion exceeded parsing_timeout_s=1 s$"):
        math_verify_reward("q", PARSE_OVERRUN, {"answer": "1"}, parsing_timeout_s=1)
    with pytest.raises(RewardTimeout, match="^math-verify comparison exceeded verify_timeout_s=1 s$"):
        math_verify_reward("q", VERIFY_OVERRUN, {"answer": "1"}, verify_timeout_s=1)
    # A gold answer whose parse overruns is a timeout each time, not a cached "could not be parsed".
    for _ in range(2):
        with pytest.raises(RewardTimeout, match="parsing the gold answer exceeded parsing_timeout_s=1 s"):
            math_verify_reward("q", "#### 1", {"answer": PARSE_OVERRUN}, parsing_timeout_s=1)


def test_the_bound_fires_again_after_a_dropped_raise():
    # Python drops an exception raised in a garbage-collection callback or a `__del__` (JAX registers a gc
    # callback), and math-verify's and SymPy's handlers catch `Exception`: math-verify's own one-shot
    # `signal.alarm` then never interrupts the call. Here the body drops the first raise and spins on; the bound
    # raises again _REPEAT_S later, long before the 30 s spin ends.
    dropped = []
    start = time.monotonic()

    def spin(seconds):
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass

    handler = signal.getsignal(signal.SIGALRM)
    with pytest.raises(math_answer._Overrun):
        with math_answer._Bound(1):
            try:
                spin(30)
            except BaseException as e:  # noqa: BLE001 - what a gc callback does to it
                dropped.append(time.monotonic() - start)
                del e
            spin(30)
    elapsed = time.monotonic() - start
    assert len(dropped) == 1 and 0.9 < dropped[0] < 5, dropped
    assert elapsed < dropped[0] + 5, elapsed
    # The timer and handler are gone: nothing fires afterwards.
    assert signal.getsignal(signal.SIGALRM) is handler
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    spin(1.5)


def test_math_verify_timeouts_are_counted_as_timeouts_not_wrong_answers():
    kwargs = {"math_verify": {"parsing_timeout_s": 1, "verify_timeout_s": 1}}
    completions = [PARSE_OVERRUN, "#### 1", VERIFY_OVERRUN, "#### 2"]
    with RewardScorer({"math_verify": 1.0}, reward_kwargs=kwargs, timeout_s=60.0, num_workers=1) as scorer:
        pids = scorer.worker_pids
        _, per_reward, metrics = scorer.score(["q"] * 4, completions, [{"answer": "1"}] * 4)
        assert scorer.worker_pids == pids  # the reward returned control: no worker was killed
        errors = scorer.last_errors
    np.testing.assert_array_equal(per_reward["math_verify"], [0.0, 1.0, 0.0, 0.0])
    assert metrics["rollout/reward/math_verify/timeouts"] == 2
    assert metrics["rollout/reward/math_verify/errors"] == 0
    assert metrics["rollout/reward/math_verify/failed_frac"] == 0.5
    assert errors == [
        (0, "math_verify", "RewardTimeout: math-verify parsing the completion exceeded parsing_timeout_s=1 s"),
        (2, "math_verify", "RewardTimeout: math-verify comparison exceeded verify_timeout_s=1 s"),
    ]


@hypothesis.settings(max_examples=100, deadline=None)
@hypothesis.given(
    # No "^", "*" or "!": a power tower or a huge factorial is a (legitimate) timeout, not an unparseable answer.
    completion=st.text(alphabet="0123456789+-/(){}[]\\$ xyabcfrqst.,=<>_&", max_size=30),
    gold=st.sampled_from(["1", "(1, 2)", r"\{1,2\}", "x^2+1", "x=1", r"\frac{1}{2}"]),
)
def test_math_verify_reward_scores_any_text_without_raising(completion, gold):
    assert math_verify_reward("q", completion, {"answer": gold}) in (0.0, 1.0)


@pytest.mark.parametrize(
    "completion", ["I don't know.", r"\boxed{\frac{1}{", r"\boxed{)(}", "$$$", "<answer></answer>"]
)
def test_math_verify_reward_scores_an_unparseable_answer_zero(completion):
    assert math_verify_reward("q", completion, {"answer": "1"}) == 0.0


def test_math_verify_errors_other_than_timeouts_mean_no_answer_and_not_equal(monkeypatch):
    # No real input found makes math-verify raise an ordinary error (it catches nearly all itself): fake them.
    real_parse, real_verify = math_answer.parse, math_answer.verify

    def parse_failing_on_7(text, *args, **kwargs):
        if "7" in text:
            raise ValueError("cannot parse")
        return real_parse(text, *args, **kwargs)

    def verify_failing(*args, **kwargs):
        raise TypeError("cannot compare")

    monkeypatch.setattr(math_answer, "parse", parse_failing_on_7)
    assert math_verify_reward("q", "#### 7", {"answer": "1"}) == 0.0
    assert math_verify_reward("q", "#### 1", {"answer": "1"}) == 1.0
    monkeypatch.setattr(math_answer, "verify", verify_failing)
    assert math_verify_reward("q", "#### 1", {"answer": "1"}) == 0.0

    # A pair whose comparison times out does not hide an equal pair: parse("1") is [1, "1"], and the string pair
    # ("1", "1") is equal while every pair with a SymPy completion side overruns its 1 s bound (2 pairs per call).
    def verify_overrunning_on_sympy(gold, predicted, **kwargs):
        if not isinstance(predicted[0], str):
            time.sleep(30)
        return real_verify(gold, predicted, **kwargs)

    monkeypatch.setattr(math_answer, "verify", verify_overrunning_on_sympy)
    assert math_verify_reward("q", "#### 1", {"answer": "1"}, verify_timeout_s=1) == 1.0
    with pytest.raises(RewardTimeout, match="verify_timeout_s=1 s"):
        math_verify_reward("q", "#### 2", {"answer": "1"}, verify_timeout_s=1)


def test_math_verify_reward_refuses_a_thread_unless_its_bounds_are_off():
    results = {}

    def call(name, **kwargs):
        try:
            results[name] = math_verify_reward("q", "#### 1", {"answer": "1"}, **kwargs)
        except ValueError as e:
            results[name] = e

    for name, kwargs in [("bounded", {}), ("unbounded", {"parsing_timeout_s": 0, "verify_timeout_s": 0})]:
        thread = threading.Thread(target=call, args=(name,), kwargs=kwargs)
        thread.start()
        thread.join()
    assert "works only in a process's main thread" in str(results["bounded"])
    assert results["unbounded"] == 1.0


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("42.", Fraction(42)),
        ("$1,000", Fraction(1000)),
        ("3.50", Fraction(7, 2)),
        ("\u22123", Fraction(-3)),
        (".5!", Fraction(1, 2)),
        ("3 / 4 cups", Fraction(3, 4)),
        ("five", None),
        ("", None),
        ("1/0", None),
    ],
)
def test_parse_number(text, value):
    assert parse_number(text) == value


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(
    cents=st.integers(min_value=-(10**9), max_value=10**9),
    trailing_zeros=st.integers(min_value=0, max_value=3),
    suffix=st.sampled_from(["", ".", "!", " dollars.", "\n\nDone."]),
    other=st.integers(min_value=-(10**6), max_value=10**6),
)
def test_gsm8k_formatting_never_changes_the_value(cents, trailing_zeros, suffix, other):
    value = Fraction(cents, 100)
    plain = f"{float(value):.2f}".rstrip("0").rstrip(".") if cents % 100 else str(cents // 100)
    decorated = f"{'-' if cents < 0 else ''}${abs(cents) / 100:,.2f}" + "0" * trailing_zeros
    example = {"answer": f"Work.\n#### {plain}"}
    completion = f"First #### {other}\nActually:\n#### {decorated}{suffix}"
    assert parse_number(decorated) == value
    assert gsm8k_reward("q", completion, example) == 1.0
    wrong = f"#### {decorated}{suffix}\n#### {float(value + 1):.2f}"
    assert gsm8k_reward("q", wrong, example) == 0.0


def test_gsm8k_strict_and_flexible():
    example = {"answer": "Reasoning...\n#### 1,234"}
    assert gsm8k_reward("q", "so it is 1234 in total", example) == 0.0
    assert gsm8k_reward("q", "so it is 1234 in total", example, fallback_last_number=True) == 1.0
    assert gsm8k_reward("q", "so it is 1,234 or maybe 99", example, fallback_last_number=True) == 0.0
    assert gsm8k_reward("q", "#### 1234", {"target": "1234"}, answer_key="target") == 1.0
    with pytest.raises(KeyError, match="'answer'"):
        gsm8k_reward("q", "#### 1", {"target": "1"})
    with pytest.raises(ValueError, match="'answer' holds no number"):
        gsm8k_reward("q", "#### 1", {"answer": "no number here"})


def test_last_boxed_content_balances_braces():
    assert last_boxed_content(r"\boxed{\frac{1}{2}} then \boxed{\frac{a}{b+c}}") == r"\frac{a}{b+c}"
    assert last_boxed_content(r"\boxed{1} and a cut-off \boxed{\frac{1}{") == "1"
    assert last_boxed_content("no box") is None


@pytest.fixture(scope="module")
def reasoning_gym_items():
    items = {}
    for name in ("basic_arithmetic", "chain_sum"):
        items[name] = list(reasoning_gym.create_dataset(name, size=6, seed=123))
    return items


@pytest.mark.parametrize("task", ["basic_arithmetic", "chain_sum"])
def test_reasoning_gym_scores_real_items(task, reasoning_gym_items):
    for entry in reasoning_gym_items[task]:
        assert entry["metadata"]["source_dataset"] == task
        question, answer = entry["question"], entry["answer"]
        wrong = str(int(answer) + 7)
        assert reasoning_gym_reward(question, f"<think>work</think><answer>{answer}</answer>", entry) == 1.0
        assert reasoning_gym_reward(question, f"Let me compute.\nThe result:\n{answer}\n", entry) == 1.0
        assert reasoning_gym_reward(question, f"<answer>{wrong}</answer>", entry) < 1.0
        assert reasoning_gym_reward(question, "", entry) < 1.0
        # A row as stored in a Parquet/JSONL file: metadata serialized, fields renamed.
        row = {"prompt_text": question, "gold": answer, "meta": json.dumps(entry["metadata"])}
        kwargs = {"answer_key": "gold", "metadata_key": "meta", "question_key": "prompt_text"}
        assert reasoning_gym_reward(question, f"<answer>{answer}</answer>", row, **kwargs) == 1.0
        assert reasoning_gym_reward(question, f"<answer>{wrong}</answer>", row, **kwargs) < 1.0


def test_reasoning_gym_through_scorer(reasoning_gym_items):
    entries = reasoning_gym_items["chain_sum"][:3] + reasoning_gym_items["basic_arithmetic"][:3]
    completions = [f"<answer>{e['answer']}</answer>" for e in entries[:3]]
    completions += [f"<answer>{int(e['answer']) - 1}</answer>" for e in entries[3:]]
    with RewardScorer({"reasoning_gym": 1.0}, timeout_s=30.0, num_workers=1) as scorer:
        rewards, _, metrics = scorer.score([e["question"] for e in entries], completions, entries)
    np.testing.assert_array_equal(rewards[:3], 1.0)
    assert np.all(rewards[3:] < 1.0)
    assert metrics["rollout/reward/reasoning_gym/errors"] == 0


def test_reasoning_gym_bad_metadata_is_named():
    with pytest.raises(KeyError, match="'metadata'"):
        reasoning_gym_reward("q", "<answer>1</answer>", {"answer": "1"})
    with pytest.raises(ValueError, match="source_dataset"):
        reasoning_gym_reward("q", "<answer>1</answer>", {"answer": "1", "metadata": {"x": 1}})


@pytest.mark.parametrize(
    ("completion", "think_answer", "answer_only"),
    [
        ("<think>because</think>\n<answer>4</answer>", 1.0, 1.0),
        ("  <think>a\nb</think><answer> 4 </answer>\n", 1.0, 1.0),
        ("<answer>4</answer>", 0.0, 1.0),
        ("Reasoning in prose. <answer>4</answer>", 0.0, 1.0),
        ("<think>x</think><answer>4</answer> trailing text", 0.0, 0.0),
        ("<think>x</think><answer>   </answer>", 0.0, 0.0),
        ("<think>x</think><answer>4</answer><answer>5</answer>", 0.0, 0.0),
        ("<think>x<think>y</think><answer>4</answer>", 0.0, 1.0),
        ("<answer>4", 0.0, 0.0),
        ("", 0.0, 0.0),
    ],
)
def test_format_reward(completion, think_answer, answer_only):
    assert format_reward("q", completion, {}) == think_answer
    assert format_reward("q", completion, {}, pattern="think_answer") == think_answer
    assert format_reward("q", completion, {}, pattern="answer") == answer_only


def test_format_reward_custom_regex():
    assert "think_answer" in FORMAT_PATTERNS
    assert format_reward("q", "Final: 12", {}, pattern=r".*Final: \d+") == 1.0
    assert format_reward("q", "Final: twelve", {}, pattern=r".*Final: \d+") == 0.0


@pytest.mark.parametrize(
    ("length", "penalty"),
    [(0, 0.0), (15, 0.0), (16, 0.0), (17, -0.25), (18, -0.5), (19, -0.75), (20, -1.0), (21, -1.0), (500, -1.0)],
)
def test_dapo_overlong_penalty_boundaries(length, penalty):
    # L_max = 20, L_cache = 4: no penalty up to 16 tokens, linear to -1 at 20, -1 beyond.
    assert dapo_overlong_penalty(length, max_length=20, cache_length=4) == pytest.approx(penalty)


def test_dapo_overlong_penalty_rejects_bad_arguments():
    with pytest.raises(ValueError, match="cache_length"):
        dapo_overlong_penalty(3, max_length=10, cache_length=0)
    with pytest.raises(ValueError, match="cache_length"):
        dapo_overlong_penalty(3, max_length=10, cache_length=11)
    with pytest.raises(ValueError, match=">= 0"):
        dapo_overlong_penalty(-1, max_length=10, cache_length=5)


def test_weighted_sum_scorer_and_overlong_from_lengths():
    specs = {"gsm8k": 1.0, "format": 0.5, "dapo_overlong": 1.0}
    kwargs = {"dapo_overlong": {"max_length": 20, "cache_length": 4}, "format": {"pattern": "answer"}}
    completions = ["<answer>#### 7</answer>", "#### 7", "<answer>6</answer>", "#### 6"]
    examples = [{"answer": "7"}] * 4
    lengths = [5, 17, 20, 30]
    with RewardScorer(specs, reward_kwargs=kwargs, timeout_s=10.0, num_workers=2) as scorer:
        rewards, per_reward, metrics = scorer.score(["q"] * 4, completions, examples, completion_lengths=lengths)
    np.testing.assert_array_equal(per_reward["gsm8k"], [1.0, 1.0, 0.0, 0.0])
    np.testing.assert_array_equal(per_reward["format"], [1.0, 0.0, 1.0, 0.0])
    np.testing.assert_allclose(per_reward["dapo_overlong"], [0.0, -0.25, -1.0, -1.0])
    np.testing.assert_allclose(rewards, [1.5, 0.75, -0.5, -1.0])
    assert metrics["rollout/reward/total/mean"] == pytest.approx(np.mean([1.5, 0.75, -0.5, -1.0]))
    assert metrics["rollout/reward/dapo_overlong/min"] == -1.0
    assert metrics["rollout/reward/format/max"] == 1.0
    assert metrics["rollout/reward/gsm8k/std"] == pytest.approx(0.5)
    # The callers' examples are not modified.
    assert examples[0] == {"answer": "7"}
    # The same weighted sum as one reward callable.
    summed = WeightedSum(specs, reward_kwargs=kwargs)
    direct = [summed("q", c, {**e, "completion_length": n}) for c, e, n in zip(completions, examples, lengths)]
    np.testing.assert_allclose(direct, rewards)


def test_weighted_sum_validation():
    with pytest.raises(ValueError, match="at least one"):
        WeightedSum({})
    with pytest.raises(ValueError, match="'format'.*finite"):
        WeightedSum({"format": float("nan")})
    with pytest.raises(ValueError, match="'gsm8k'.*not among"):
        WeightedSum({"format": 1.0}, reward_kwargs={"gsm8k": {}})


def _exact_match(prompt, completion, example):
    return float(completion.strip() == example["answer"])


def test_registry_names_and_import_paths():
    assert {"math_verify", "gsm8k", "reasoning_gym", "format", "dapo_overlong", "latency"} <= set(available_rewards())
    assert resolve_reward("gsm8k") is gsm8k_reward
    assert resolve_reward("feynrl_jax.rollout.rewards.gsm8k:gsm8k_reward") is gsm8k_reward
    assert resolve_reward(f"{__name__}:_exact_match") is _exact_match
    assert resolve_reward(_exact_match) is _exact_match

    decorated = register_reward("test_rewards_exact_match")(_exact_match)
    assert decorated is _exact_match
    assert resolve_reward("test_rewards_exact_match") is _exact_match
    with pytest.raises(ValueError, match="already registered"):
        register_reward("test_rewards_exact_match")(_exact_match)
    with pytest.raises(ValueError, match="already registered"):
        register_reward("gsm8k")(_exact_match)
    with pytest.raises(ValueError, match="contain neither"):
        register_reward("a:b")


@pytest.mark.parametrize(
    ("spec", "error", "message"),
    [
        ("no_such_reward", ValueError, "unknown reward 'no_such_reward'"),
        ("no_such_module_xyz:fn", ValueError, "'no_such_module_xyz:fn'.*cannot import module 'no_such_module_xyz'"),
        ("feynrl_jax.rollout.rewards.gsm8k:nope", ValueError, "has no attribute 'nope'"),
        ("feynrl_jax.rollout.rewards.gsm8k:", ValueError, "must look like 'package.module:function'"),
        ("math:pi", TypeError, "'math:pi' resolved to float"),
    ],
)
def test_registry_errors_name_the_string(spec, error, message):
    with pytest.raises(error, match=message):
        resolve_reward(spec)


def test_scorer_rejects_bad_specs_early():
    with pytest.raises(ValueError, match="unknown reward 'nope'"):
        RewardScorer({"nope": 1.0})
    with pytest.raises(ValueError, match="'dapo_overlong'.*reward_kwargs"):
        RewardScorer({"dapo_overlong": 1.0})
    with pytest.raises(ValueError, match="'gsm8k'.*finite"):
        RewardScorer({"gsm8k": float("inf")})
    with pytest.raises(ValueError, match="'format'.*not among"):
        RewardScorer({"gsm8k": 1.0}, reward_kwargs={"format": {"pattern": "answer"}})
    with pytest.raises(ValueError, match="reserved"):
        RewardScorer({"total": 1.0})


def test_rewards_package_imports_no_losses_ray_or_torch():
    code = (
        "import sys\n"
        "import feynrl_jax.rollout.rewards as r\n"
        "for name in r.available_rewards(): r.resolve_reward(name)\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in ('ray', 'torch') or m.startswith('feynrl_jax.losses')]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_reasoning_gym_reward_reads_the_entry_nested_by_the_data_source():
    """`feynrl_jax.data`'s reasoning-gym examples keep the original entry under metadata["entry"]."""
    from feynrl_jax.data.reasoning_gym_source import reasoning_gym_split
    from feynrl_jax.rollout.rewards.reasoning_gym_reward import reasoning_gym_reward

    train, _ = reasoning_gym_split("basic_arithmetic", train_size=4, eval_size=2, seed=3)
    example = train.examples[0]
    right = f"<answer>{example['answer']}</answer>"
    assert reasoning_gym_reward("", right, example) == 1.0
    assert reasoning_gym_reward("", "<answer>not a number</answer>", example) < 1.0


def test_latency_reward_waits_and_scores_nothing():
    from feynrl_jax.rollout.rewards.latency import latency_reward

    t0 = time.perf_counter()
    assert latency_reward("p", "c", {}, delay_s=0.05) == 0.0
    assert time.perf_counter() - t0 >= 0.05
    with pytest.raises(ValueError, match="delay_s"):
        latency_reward("p", "c", {}, delay_s=-1.0)
