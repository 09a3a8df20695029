"""A recorded decode step's hyper-connection Sinkhorn, run by a later kernel beside its own work.

``hc_expand_mix_norm`` ends a sub-layer and makes the next one's input in one launch; its last block also ran the
20 Sinkhorn iterations of the next sub-layer's ``comb``, ~1 µs of one lane that only the sub-layer's end reads, yet
the launch ended with them: twice a layer on the step's critical path (as a launch of their own, beside the step or
in it, they cost more: docs/performance.md).
While a decode step is recorded (:func:`hosting`), one token's hyper-connection writes its mix row and leaves the
split (pre, post and comb from that row) pending here; the next int8 GEMV or gate/up launched on the same stream
takes it (:func:`take`) as one extra block, which waits for its predecessor like the other blocks and runs
``hc_split4_lane``: the same bits, in the shadow of a kernel that streams weights for several µs. A split no launch
took runs as ``hc_split`` before anything reads post or comb (:func:`flush`, called by the hyper-connection ops) or
when the step ends.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import cupy as cp
import numpy as np

from .modules import glue_kernel

_state = threading.local()  # per thread, as a session's streams are


@contextmanager
def hosting() -> Iterator[None]:
    """Let one-token hyper-connections leave their splits to later launches of this thread until the block ends;
    whatever is left then runs (or, when the block raises, is dropped with the step that failed)."""
    _state.enabled = True
    try:
        yield
    except BaseException:
        _state.job = None
        raise
    finally:
        _state.enabled = False
    flush()


def enabled() -> bool:
    """Whether this thread is inside :func:`hosting`."""
    return getattr(_state, "enabled", False)


def pending() -> bool:
    """Whether a split waits for a launch to take it."""
    return getattr(_state, "job", None) is not None


def defer(row: Any, scale: Any, base: Any, iters: int, eps: float, pre: Any, post: Any, comb: Any) -> None:
    """Leave the split of the mix row ``row [1, 24]`` (``hc_split4_lane``'s arguments) to a later launch."""
    flush()
    _state.job = (cp.cuda.get_current_stream().ptr, (row, scale, base, np.int32(iters), np.float32(eps), pre, post,
                                                      comb))


def take() -> tuple | None:
    """The pending split's kernel arguments (mix row, scale, base, iterations, eps, pre, post, comb), now the
    caller's to run in the launch it is about to make on the current stream; None if there is none, or it was left
    on another stream (a sibling branch is not ordered after it)."""
    job = getattr(_state, "job", None)
    if job is None or job[0] != cp.cuda.get_current_stream().ptr:
        return None
    _state.job = None
    return job[1]


#: The arguments of a launch that hosts no split.
NO_SPLIT: tuple = (np.uint64(0),) * 3 + (np.int32(0), np.float32(0)) + (np.uint64(0),) * 3


def flush() -> None:
    """Run the pending split, if any, as its own launch: ``hc_split`` (a warp, ``hc_split4_lane``'s bits)."""
    job = getattr(_state, "job", None)
    if job is None:
        return
    _state.job = None
    row, scale, base, iters, eps, pre, post, comb = job[1]
    glue_kernel("hc_split")((1,), (32,), (row, row, np.int32(0), np.int32(0), np.float32(0), scale, base,
                                          np.int32(1), np.int32(pre.shape[1]), iters, eps, pre, post, comb))
