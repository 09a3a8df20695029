"""The CSA indexer's two decode kernels, each path timed inside CUDA graphs and checked against numpy.

* ``indexer_scores`` for one query row of DeepSeek V4 Flash's indexer (64 heads of 128) over R compressed keys: the
  dispatched one-launch kernel (``indexer_scores_spread`` where its blocks of 8 keys are at most one a
  multiprocessor, else ``indexer_scores_rows``), ``indexer_scores_rows`` pinned, and the two-launch path (products, then
  ``relu_head_sum``), next to the time the key bytes take at 4.5 TB/s.
* ``index_select`` of k = 512 rows of one score row of R: the dispatched kernel, the rank count and the radix select,
  each pinned in turn.

Each call is recorded CALLS times in one graph on a non-default stream, the graph launched LAUNCHES times; a path
whose last output differs from the reference is marked WRONG.

Usage: python benchmarks/indexer_kernels.py   (needs a GPU with the CUDA backend and the DeepSeek V4 plugin)
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import cupy as cp
import numpy as np
from ds4_backend_cuda import attention_ops
from ds4_backend_cuda import deepseek4_ops as d4
from ds4_model_deepseek4.ops import index_select as select_reference

from ds4_core.ops import indexer_scores as scores_reference

CALLS, LAUNCHES, K, OFFSET = 50, 5, 512, 128


def graph_us(fn: Callable[[], Any]) -> tuple[float, np.ndarray]:
    """(µs per call, last output) of ``fn`` recorded CALLS times in one graph, launched LAUNCHES times."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        # compiles the kernels and leaves the pool the blocks that the recorded calls' outputs alternate between
        [fn() for _ in range(2)]
        stream.begin_capture()
        for _ in range(CALLS):
            out = fn()
        graph = stream.end_capture()
        out.fill(-7)  # so a graph that never wrote it fails the check
        graph.launch(stream)
        stream.synchronize()
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        for _ in range(LAUNCHES):
            graph.launch(stream)
        end.record(stream)
        end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) * 1e3 / (CALLS * LAUNCHES), cp.asnumpy(out)


def pinned_scores(name: str, value: int, q: Any, keys: Any, head_weights: Any, scale: float) -> Any:
    """``attention_ops.indexer_scores`` with its dispatch constant ``name`` set to ``value``."""
    kept = getattr(attention_ops, name)
    setattr(attention_ops, name, value)
    try:
        return attention_ops.indexer_scores(q, keys, head_weights, scale)
    finally:
        setattr(attention_ops, name, kept)


def scores_table(rng: np.random.Generator) -> None:
    for R in (512, 1024, 2048, 4096, 8192, 16384):
        q, keys, hw = (rng.standard_normal(s, dtype=np.float32) for s in ((1, 64, 128), (R, 128), (1, 64)))
        want = scores_reference(q, keys, hw, 0.1)
        dq, dk, dh = cp.asarray(q), cp.asarray(keys), cp.asarray(hw)
        line = f"indexer_scores R={R:6d}: keys {R * 512 / 4.5e6:5.2f} us at 4.5 TB/s"
        paths = (("dispatched", attention_ops.indexer_scores),
                 ("blocks of 32", functools.partial(pinned_scores, "_SPREAD_BLOCKS", 0)),  # no spread fits
                 ("two launches", functools.partial(pinned_scores, "_SCORE_HEADS", 0)))  # no one-launch kernel fits
        for name, fn in paths:
            us, got = graph_us(functools.partial(fn, dq, dk, dh, 0.1))
            line += f" | {name} {us:7.2f} us{'' if np.allclose(got, want, rtol=1e-4, atol=1e-4) else ' WRONG'}"
        print(line, flush=True)


def select_table(rng: np.random.Generator) -> None:
    dispatch = d4._select_kernel
    try:
        for R in (512, 2048, 8192, 16384, 32768):
            host = rng.standard_normal((1, R)).astype(np.float32)
            want = select_reference(host, np.array([R], np.int32), K, OFFSET)
            scores, limit = cp.asarray(host), cp.asarray(np.array([R], np.int32))
            line = f"index_select R={R:6d} k={K}: dispatch takes {dispatch(1, R, K)}"
            for name in ("index_select", "index_select_radix"):
                d4._select_kernel = lambda T, n, k, name=name: name
                us, got = graph_us(functools.partial(d4.index_select, scores, limit, K, OFFSET))
                line += f" | {name} {us:7.2f} us{'' if np.array_equal(got, want) else ' WRONG'}"
            print(line, flush=True)
    finally:
        d4._select_kernel = dispatch


if __name__ == "__main__":
    generator = np.random.default_rng(0)
    scores_table(generator)
    select_table(generator)
