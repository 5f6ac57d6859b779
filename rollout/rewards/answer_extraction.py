"""Pulling the final answer out of a completion: ``\\boxed{}``, answer tags, GSM8K ``####`` markers, last line.

Pure string functions without dependencies; the rewards in this package compose them. Every function that looks
for a marker takes the LAST occurrence: a model that corrects itself ("#### 12 ... no, #### 13") is graded on its
final answer.
"""

from __future__ import annotations

import re
from fractions import Fraction

GSM8K_MARKER = "####"

# A leading number: optional sign, digits with an optional decimal part (or a bare ".5"), optional "/denominator".
_NUMBER_RE = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:\s*/\s*\d+)?")
_ANY_NUMBER_RE = re.compile(r"[-+]?(?:\d[\d,]*(?:\.\d+)?|\.\d+)")
_TRAILING_PUNCTUATION = ".,;:!?)]}\"' \t"


def last_tag_content(text: str, tag: str = "answer") -> str | None:
    """Returns the stripped content of the last ``<tag>...</tag>`` block, or None when there is none."""
    matches = re.findall(rf"<{re.escape(tag)}>(.*?)</{re.escape(tag)}>", text, flags=re.DOTALL)
    return matches[-1].strip() if matches else None


def last_boxed_content(text: str) -> str | None:
    """Returns the content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced, or None.

    An unclosed last box (a completion cut off at the length limit) counts as no box.
    """
    starts = [m.end() for m in re.finditer(r"\\(?:boxed|fbox)\s*\{", text)]
    for start in reversed(starts):
        depth = 1
        for i in range(start, len(text)):
            if text[i] == "{":
                depth += 1
            elif text[i] == "}":
                depth -= 1
                if depth == 0:
                    return text[start:i].strip()
    return None


def last_nonempty_line(text: str) -> str | None:
    """Returns the last line with non-space characters, stripped, or None for a blank text."""
    for line in reversed(text.splitlines()):
        if line.strip():
            return line.strip()
    return None


def after_last_gsm8k_marker(text: str) -> str | None:
    """Returns the rest of the line after the last ``####`` marker, stripped, or None when there is no marker."""
    index = text.rfind(GSM8K_MARKER)
    if index < 0:
        return None
    rest = text[index + len(GSM8K_MARKER) :]
    return rest.split("\n", 1)[0].strip()


def parse_number(text: str) -> Fraction | None:
    """Parses the number at the start of ``text`` exactly, GSM8K style.

    ``"$"`` signs, thousands commas and spaces are dropped, a Unicode minus becomes ``-``, and trailing
    punctuation is ignored: ``"$1,000."`` is 1000, ``"3.50"`` equals ``"3.5"``, ``"-7 apples"`` is -7,
    ``"3/4"`` is 3/4.

    Args:
      text: the answer text.

    Returns:
      The exact value as a :class:`fractions.Fraction`, or None when ``text`` does not start with a number.
    """
    cleaned = text.replace("$", "").replace(",", "").replace("\u2212", "-").strip()
    cleaned = cleaned.rstrip(_TRAILING_PUNCTUATION)
    match = _NUMBER_RE.match(cleaned)
    if match is None:
        return None
    number = match.group(0).replace(" ", "")
    numerator, _, denominator = number.partition("/")
    value = Fraction(numerator)
    if denominator:
        if int(denominator) == 0:
            return None
        value /= int(denominator)
    return value


def last_number(text: str) -> Fraction | None:
    """Returns the last number written anywhere in ``text`` (thousands commas allowed), or None."""
    matches = _ANY_NUMBER_RE.findall(text.replace("$", "").replace("\u2212", "-"))
    for candidate in reversed(matches):
        value = parse_number(candidate)
        if value is not None:
            return value
    return None
