"""The fused op ``index_select`` (the indexer's choice of compressed rows): its numpy reference against a sort by
hand, and the rank counting of its CUDA kernel (``kernels/select.cu``), emulated tile by tile, against both."""

from __future__ import annotations

import numpy as np
import pytest
from ds4_model_deepseek4.ops import index_select

RNG = np.random.default_rng(11)


def by_sorting(scores: np.ndarray, limit: np.ndarray, k: int, offset: int) -> np.ndarray:
    """Each row's complete entries sorted by (score descending, index ascending), the first k plus offset, then -1."""
    T, R = scores.shape
    out = np.full((T, min(k, R)), -1, np.int32)
    for t in range(T):
        complete = range(min(int(limit[t]), R))
        best = sorted(complete, key=lambda j: (-scores[t, j], j))[:k]
        out[t, :len(best)] = np.array(best, dtype=np.int32) + offset
    return out


def kernel_emulation(scores: np.ndarray, limit: np.ndarray, k: int, offset: int, entries: int = 4, slices: int = 2,
                     tile: int = 16) -> np.ndarray:
    """``index_select`` of select.cu step by step (smaller blocks and tiles than the kernel's): each block of
    ``entries`` entries counts NaN-padded tiles of ``tile`` scores in ``slices`` slices, with >= for a slice before
    its entries, > after them and the index test on the slice holding them, then sums the slices' counts."""
    T, n = scores.shape
    k, size = min(k, n), tile // slices
    out = np.full((T, k), 7777, np.int32)  # any slot left unwritten shows
    keys = np.where(np.isnan(scores), -np.inf, scores).astype(np.float32)
    for t in range(T):
        complete = min(max(int(limit[t]), 0), n)
        for first in range(0, n, entries):
            i = first + np.arange(entries)
            pad = (i >= complete) & (i < k)
            out[t, i[pad]] = -1
            if first >= complete:
                continue
            v = np.where(i < complete, keys[t, np.minimum(i, n - 1)], -np.inf)[:, None]
            rank = np.zeros(entries, np.int64)
            for base in range(0, complete, tile):
                j = base + np.arange(tile)
                staged = np.where(j < complete, keys[t, np.minimum(j, n - 1)], np.nan)
                for y in range(slices):
                    lo = base + y * size
                    quads = (min(size, complete - lo) + 3) // 4 if lo < complete else 0
                    w = staged[None, y * size:y * size + 4 * quads]
                    if lo + size <= first:
                        rank += (w >= v).sum(axis=1)
                    elif lo >= first + entries:
                        rank += (w > v).sum(axis=1)
                    else:
                        lower = np.arange(4 * quads)[None, :] < (i - lo)[:, None]
                        rank += ((w > v) | ((w == v) & lower)).sum(axis=1)
            chosen = (i < complete) & (rank < k)
            out[t, rank[chosen]] = i[chosen] + offset
    return out


def cases():
    """(scores, limit, k, offset): ties, -inf and NaN scores, R below and above k, limits 0, partial and R."""
    for R, k in ((5, 8), (8, 8), (37, 6), (64, 16), (3, 1)):
        T = 6
        scores = RNG.integers(-3, 4, (T, R)).astype(np.float32)  # few values: many ties
        scores[RNG.random((T, R)) < 0.15] = -np.inf
        scores[1] = RNG.standard_normal(R)
        limit = np.array([0, R, R // 2, 1, RNG.integers(0, R + 1), R - 1], np.int32)
        yield scores, limit, k, 0
        scores = scores.copy()
        scores[2, ::3] = np.nan  # ranked as -inf, as the core topk kernel does
        yield scores, limit, k, 13


@pytest.mark.parametrize("case", list(cases()), ids=lambda c: f"R{c[0].shape[1]}-k{c[2]}-off{c[3]}")
def test_index_select_takes_the_best_complete_rows_in_order(case):
    scores, limit, k, offset = case
    want = by_sorting(np.where(np.isnan(scores), -np.inf, scores), limit, k, offset)
    if not np.isnan(scores).any():  # numpy's argsort puts NaN last, after -inf: only the kernels rank it as -inf
        got = index_select(scores, limit, k, offset)
        assert got.dtype == np.int32
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(kernel_emulation(scores, limit, k, offset), want)
    np.testing.assert_array_equal(kernel_emulation(scores, limit, k, offset, entries=8, slices=4, tile=32), want)


def test_index_select_of_a_decode_step_sized_row():
    scores = RNG.standard_normal((1, 300)).astype(np.float32)
    scores[0, 40:60] = scores[0, 10]  # a run of ties
    limit = np.array([211], np.int32)
    want = by_sorting(scores, limit, 64, 128)
    np.testing.assert_array_equal(index_select(scores, limit, 64, 128), want)
    np.testing.assert_array_equal(kernel_emulation(scores, limit, 64, 128, entries=32, slices=8, tile=1024), want)


def test_index_select_after_a_prefix():
    """With a prefix (a decode step's window rows), each row is that prefix, then the choice without it."""
    scores = RNG.standard_normal((3, 50)).astype(np.float32)
    limit = np.array([50, 7, 0], np.int32)
    prefix = np.array([-1, 4, 0, 3], np.int32)
    got = index_select(scores, limit, 16, 4, prefix)
    assert got.dtype == np.int32 and got.shape == (3, 4 + 16)
    np.testing.assert_array_equal(got[:, :4], np.broadcast_to(prefix, (3, 4)))
    np.testing.assert_array_equal(got[:, 4:], by_sorting(scores, limit, 16, 4))
