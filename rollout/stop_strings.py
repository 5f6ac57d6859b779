"""Stop strings, checked on the host between decode dispatches.

Text only exists after detokenisation, so stop strings cannot be checked inside the jitted decode step; the
engine checks them after each dispatch on the tokens that dispatch produced. A sequence that hits one is cut
right after the token that completed the string (the string may span several tokens), and its slot is freed.
Tokens a sequence sampled after that point inside the same dispatch are discarded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence


class StopStringMatcher:
    """Finds the first token at which a completion's text contains one of the stop strings.

    Args:
      stop_strings: non-empty strings.
      detokenize: token ids -> text (e.g. `tokenizer.decode`).
    """

    def __init__(self, stop_strings: Sequence[str], detokenize: Callable[[list[int]], str]):
        self.stop_strings = tuple(stop_strings)
        self.detokenize = detokenize

    def _contains(self, tokens: list[int]) -> bool:
        text = self.detokenize(tokens)
        return any(s in text for s in self.stop_strings)

    def first_stop(self, tokens: list[int], checked: int) -> int | None:
        """The smallest `end > checked` such that `tokens[:end]` contains a stop string, or None.

        Args:
          tokens: the completion so far.
          checked: a prefix length already known to contain no stop string.

        Returns:
          The completion length to keep (the stop string's last token included), or None.
        """
        if len(tokens) <= checked or not self._contains(tokens):
            return None
        for end in range(checked + 1, len(tokens) + 1):
            if self._contains(tokens[:end]):
                return end
        return len(tokens)
