"""Math answer verification with math-verify (Hugging Face, https://github.com/huggingface/Math-Verify).

The completion's final answer is located first (last ``<answer>`` block, else last ``\\boxed{}``, else text after
the last GSM8K ``####`` marker, else the whole completion, where math-verify takes the last expression), parsed
to SymPy by math-verify's LaTeX and plain-expression extractors, and compared with the parsed gold answer
symbolically and numerically (``\\frac{1}{2}`` == ``0.5`` == ``1/2``, ``(1, 2)`` == ``(1,2)``).

Each parse and each comparison runs under a time bound of its own (``_Bound``: ``SIGALRM`` from an interval timer),
which works only in the main thread of a process: this reward must run in a worker process (the
:class:`~feynrl_jax.rollout.rewards.scorer.RewardScorer` pool does that), never in a thread. math-verify's own bound
(``signal.alarm`` once) is off: its exception can land where Python drops it (a garbage-collection callback such as
JAX's, a ``__del__``) or inside math-verify's and SymPy's ``except Exception`` handlers, and the call then runs on
unbounded; ours raises an exception those handlers do not catch, and again every 0.1 s until it gets through. When
a bound fires, the reward raises
:class:`~feynrl_jax.rollout.rewards.process_pool.RewardTimeout` (naming the bound), which the pool scores 0 and
counts as a timeout, so a timeout is never mistaken for a wrong answer; a comparison that timed out raises only when
no other (gold, predicted) pair is equal. Any other error inside math-verify means what it means in math-verify by
default: an unparseable text yields no answer, a comparison that fails is "not equal". The pool's per-item timeout
is the hard bound on top.
"""

from __future__ import annotations

import functools
import itertools
import logging
import signal
import threading
from typing import Any

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from feynrl_jax.rollout.rewards.answer_extraction import (
    after_last_gsm8k_marker,
    last_boxed_content,
    last_nonempty_line,
    last_tag_content,
)
from feynrl_jax.rollout.rewards.process_pool import RewardTimeout

# \boxed{} first (priority 0), then the other LaTeX anchors, then plain expressions.
_EXTRACTION = (LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig())

# After a bound's first signal, the next ones: a raise that was dropped is raised again this much later.
_REPEAT_S = 0.1


class _Overrun(BaseException):
    """A bound fired (``_Bound``). Not an ``Exception``: math-verify's and SymPy's ``except Exception`` let it
    through."""


class _OwnBoundNotice(logging.Filter):
    """Drops math-verify's warning that its bound is off and the caller must bound it: ``_Bound`` does."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_OwnBoundNotice())


class _Bound:
    """A time bound on a block of code: raises :class:`_Overrun` in it once it has run ``seconds`` (0: no bound), and
    every ``_REPEAT_S`` after until it ends, so that a raise that landed where Python drops exceptions is raised
    again. Not reentrant (one interval timer per process). A signal that lands in ``__exit__`` before it disarms
    raises from there: ``_bounded`` catches :class:`_Overrun` outside the ``with`` and calls ``disarm`` again, which
    the next signal, ``_REPEAT_S`` away, cannot interrupt."""

    def __init__(self, seconds: int):
        self.seconds, self.armed, self.previous = seconds, False, None

    def _overrun(self, signum, frame) -> None:
        if self.armed:
            raise _Overrun

    def __enter__(self) -> _Bound:
        if self.seconds:
            self.previous = signal.signal(signal.SIGALRM, self._overrun)
            self.armed = True
            signal.setitimer(signal.ITIMER_REAL, self.seconds, _REPEAT_S)
        return self

    def disarm(self) -> None:
        """Stops the timer and restores the previous handler; does nothing the second time."""
        if not self.seconds:
            return
        self.armed = False
        signal.setitimer(signal.ITIMER_REAL, 0)
        if self.previous is not None:
            signal.signal(signal.SIGALRM, self.previous)
            self.previous = None

    def __exit__(self, *exc) -> None:
        self.disarm()


def _bounded(seconds: int, fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` under a :class:`_Bound` of ``seconds``: :class:`_Overrun` when it fires, the timer
    then stopped and the previous handler back."""
    bound = _Bound(seconds)
    try:
        with bound:
            return fn(*args, **kwargs)
    except _Overrun:
        bound.disarm()
        raise


def _parse_once(text: str, timeout_s: int, what: str) -> list:
    """math-verify's parse with our extractors: ``[]`` when it fails; :class:`RewardTimeout` when the bound fires."""
    try:
        return _bounded(timeout_s, parse, text, _EXTRACTION, parsing_timeout=None, raise_on_error=True)
    except _Overrun:
        raise RewardTimeout(f"math-verify parsing {what} exceeded parsing_timeout_s={timeout_s} s") from None
    except Exception:  # math-verify's default (raise_on_error=False): no answer.
        return []


def _parse(text: str, timeout_s: int, what: str) -> list:
    """Parses ``text``; a bare string that yields nothing is retried as inline math."""
    parsed = _parse_once(text, timeout_s, what)
    if not parsed:
        line = last_nonempty_line(text)
        if line is not None and "$" not in line:
            parsed = _parse_once(f"${line}$", timeout_s, what)
    return parsed


@functools.lru_cache(maxsize=4096)
def _parse_gold(gold_text: str, timeout_s: int) -> list:
    """Parses a gold answer (cached: the n samples of one prompt share it; a timeout raises, so is not cached)."""
    marked = after_last_gsm8k_marker(gold_text)
    if marked is not None:
        gold_text = marked
    if "$" not in gold_text and "\\boxed" not in gold_text:
        # A bare gold answer ("\frac{1}{2}", "(1, 2)", "x^2+1") is math, not prose: parse it as inline LaTeX.
        parsed = _parse_once(f"${gold_text}$", timeout_s, "the gold answer")
        if parsed:
            return parsed
    return _parse(gold_text, timeout_s, "the gold answer")


def _equal(gold: list, predicted: list, timeout_s: int) -> bool:
    """Whether math-verify finds any (gold, predicted) pair equal, comparing pair by pair as its ``verify`` does.

    A pair whose comparison raises is unequal (math-verify's default); a pair whose comparison times out raises
    :class:`RewardTimeout`, but only after every other pair was compared and none was equal.
    """
    timed_out = False
    for gold_item, predicted_item in itertools.product(gold, predicted):
        try:
            if _bounded(timeout_s, verify, [gold_item], [predicted_item], timeout_seconds=None, raise_on_error=True):
                return True
        except _Overrun:
            timed_out = True
        except Exception:  # math-verify's default (raise_on_error=False): not equal.
            pass
    if timed_out:
        raise RewardTimeout(f"math-verify comparison exceeded verify_timeout_s={timeout_s} s")
    return False


def extract_answer_text(completion: str, *, answer_tag: str = "answer") -> str:
    """Returns the part of a completion that holds its final answer.

    The content of the last ``<answer_tag>`` block, else the last ``\\boxed{...}`` (kept boxed), else the rest of
    the line after the last ``####``, else the whole completion.
    """
    tagged = last_tag_content(completion, answer_tag)
    if tagged is not None:
        return tagged
    boxed = last_boxed_content(completion)
    if boxed is not None:
        return f"\\boxed{{{boxed}}}"
    marked = after_last_gsm8k_marker(completion)
    if marked is not None:
        return marked
    return completion


def math_verify_reward(
    prompt: str,
    completion: str,
    example: dict[str, Any],
    *,
    answer_key: str = "answer",
    answer_tag: str = "answer",
    parsing_timeout_s: int = 3,
    verify_timeout_s: int = 3,
) -> float:
    """Scores 1.0 when math-verify finds the completion's final answer equal to the gold answer, else 0.0.

    Args:
      prompt: unused.
      completion: the generated text.
      example: the data row; ``example[answer_key]`` is the gold answer (a bare expression, LaTeX, a
        ``\\boxed{}`` solution or a GSM8K ``#### n`` solution).
      answer_key: the field holding the gold answer.
      answer_tag: the tag whose last block holds the final answer when present (``<answer>...</answer>``).
      parsing_timeout_s: the bound per parse, whole seconds (``SIGALRM``, module docstring); 0 disables it.
      verify_timeout_s: the bound per comparison, whole seconds; 0 disables it.

    Returns:
      1.0 or 0.0.

    Raises:
      KeyError: when the example has no ``answer_key`` field.
      ValueError: when the gold answer cannot be parsed (naming the key), or a bound is set and the reward is called
        outside a process's main thread (where ``SIGALRM`` cannot reach it).
      RewardTimeout: when parsing the gold answer or the completion's answer, or comparing them, exceeds its bound.
    """
    del prompt
    if (parsing_timeout_s or verify_timeout_s) and threading.current_thread() is not threading.main_thread():
        # Checked here: signal.signal's own error for this case is an ordinary exception, which _parse_once and
        # _equal would read as "no answer" and "not equal".
        raise ValueError(
            "math_verify_reward bounds math-verify with SIGALRM, which works only in a process's main thread: "
            "run it in the RewardScorer's worker processes, or set parsing_timeout_s and verify_timeout_s to 0"
        )
    if answer_key not in example:
        raise KeyError(f"example has no gold answer field {answer_key!r} (fields: {sorted(example)})")
    gold_text = str(example[answer_key])
    gold = _parse_gold(gold_text, parsing_timeout_s)
    if not gold:
        raise ValueError(f"gold answer field {answer_key!r} could not be parsed: {gold_text[-200:]!r}")
    if not completion.strip():
        return 0.0
    predicted = _parse(extract_answer_text(completion, answer_tag=answer_tag), parsing_timeout_s, "the completion")
    if not predicted:
        return 0.0
    return float(_equal(gold, predicted, verify_timeout_s))
