"""`update_packing._segment_of_word` (the segment each data word of a packed update lands in) against NumPy on random
segment lengths with empty segments anywhere (leading, trailing, all), and, for the words inside the data, against
a binary search of the segments' ends. Negative control: a reference off by one word at each segment's start
differs."""

from __future__ import annotations

import jax
import numpy as np

from jaxprep.serving.update_packing import _segment_of_word


def reference_segments(lengths: np.ndarray, length: int, inclusive: bool = True) -> np.ndarray:
    """Per word j < length: the last non-empty segment starting at or before j (0 if none), in plain loops."""
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    out = np.zeros(length, np.int64)
    for j in range(length):
        for s, (start, size) in enumerate(zip(starts, lengths)):
            if size > 0 and start < length and (start <= j if inclusive else start < j):
                out[j] = s
    return out


def random_lengths(rng, count: int) -> np.ndarray:
    lengths = rng.integers(0, 6, count)
    lengths[rng.random(count) < 0.4] = 0  # empty segments anywhere
    return lengths.astype(np.int32)


CASES = [np.zeros(5, np.int32), np.array([0, 0, 3, 0], np.int32), np.array([2, 0, 1, 0, 0], np.int32),
         np.array([7], np.int32)]


def segments(lengths: np.ndarray, length: int) -> np.ndarray:
    ends = np.cumsum(lengths).astype(np.int32)
    return np.asarray(jax.jit(_segment_of_word, static_argnums=2)(ends, lengths, length))


def test_each_word_lands_in_its_segment():
    rng = np.random.default_rng(11)
    for lengths in CASES + [random_lengths(rng, int(rng.integers(1, 30))) for _ in range(24)]:
        total = int(lengths.sum())
        for length in sorted({1, max(1, total // 2), max(1, total), total + 3}):
            seg = segments(lengths, length)
            np.testing.assert_array_equal(seg, reference_segments(lengths, length), err_msg=f"{lengths} {length}")
            inside = np.arange(length) < total  # a word inside the data: the segment that holds it
            np.testing.assert_array_equal(seg[inside],
                                          np.searchsorted(np.cumsum(lengths), np.arange(length), "right")[inside])
    # negative control: a segment's first word counted to the segment before it is seen
    lengths = np.array([2, 0, 3], np.int32)
    assert not np.array_equal(segments(lengths, 5), reference_segments(lengths, 5, inclusive=False))
