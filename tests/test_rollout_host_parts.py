"""Host-side pieces of the native engine: prefill buckets and the stop-string matcher."""

import pytest

from feynrl_jax.rollout.prefill import bucket_lengths, pick_bucket
from feynrl_jax.rollout.stop_strings import StopStringMatcher


def test_bucket_lengths_are_powers_of_two_capped_at_the_cache():
    assert bucket_lengths(16, 200) == (16, 32, 64, 128, 200)
    assert bucket_lengths(16, 128) == (16, 32, 64, 128)
    assert bucket_lengths(4, 3) == (3,)
    with pytest.raises(ValueError, match="min_bucket must be a power of two"):
        bucket_lengths(12, 100)


def test_pick_bucket_takes_the_smallest_that_fits():
    buckets = bucket_lengths(16, 200)
    assert [pick_bucket(buckets, n) for n in (1, 16, 17, 65, 200)] == [16, 16, 32, 128, 200]
    with pytest.raises(ValueError, match="exceeds the largest prefill bucket 200"):
        pick_bucket(buckets, 201)


def test_stop_string_matcher_finds_the_completing_token():
    pieces = {1: "He", 2: "llo", 3: " wor", 4: "ld", 5: "!", 6: "\n", 7: "\n"}
    matcher = StopStringMatcher(["world", "\n\n"], lambda ids: "".join(pieces[i] for i in ids))
    assert matcher.first_stop([1, 2, 3], checked=0) is None
    # "world" spans tokens 3 and 4: the completion keeps up to and including token 4.
    assert matcher.first_stop([1, 2, 3, 4, 5, 6], checked=3) == 4
    assert matcher.first_stop([1, 5, 6, 7, 2], checked=1) == 4
    assert matcher.first_stop([1, 2], checked=2) is None  # nothing new to check
