"""The CUDA backend's streams and pool: ``concurrently`` (independent branches on streams of their own, eagerly and
inside a recorded step) and ``release_scratch``."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu


def _branches(cp, big, x, streams):
    def slow():  # tens of microseconds of reads: a reader that did not wait for it would see its output unwritten
        streams.append(cp.cuda.get_current_stream().ptr)
        acc = big
        for _ in range(6):
            acc = cp.tanh(acc * 1.5)  # temporaries freed inside the branch, reused by its later launches
        return acc.sum(axis=0)[:8]

    def quick():
        streams.append(cp.cuda.get_current_stream().ptr)
        return cp.cos(x) * 2

    return slow, quick


def _expected(big: np.ndarray, x: np.ndarray) -> np.ndarray:
    acc = big.astype(np.float64)
    for _ in range(6):
        acc = np.tanh(acc * 1.5)
    return acc.sum(axis=0)[:8] + np.cos(x.astype(np.float64)) * 2


def test_branches_take_their_own_streams_and_join_before_the_caller_goes_on(cuda_backend):
    import cupy as cp

    big = cp.asarray(np.random.default_rng(0).standard_normal((2048, 4096), dtype=np.float32))
    x = cp.arange(8, dtype=cp.float32)
    streams: list[int] = []
    slow, quick = _branches(cp, big, x, streams)
    caller = cp.cuda.get_current_stream().ptr
    a, b = cuda_backend.concurrently(slow, quick)
    out = cp.asnumpy(a + b)
    assert streams[0] == caller and streams[1] != caller  # the first branch stays on the caller's stream
    np.testing.assert_allclose(out, _expected(cp.asnumpy(big), cp.asnumpy(x)), rtol=1e-4)
    assert cuda_backend.concurrently(lambda: 7) == (7,)


def test_a_recorded_step_with_branches_replays_on_new_inputs(cuda_backend):
    import cupy as cp

    rng = np.random.default_rng(1)
    big = cp.asarray(rng.standard_normal((2048, 4096), dtype=np.float32))
    x = cp.arange(8, dtype=cp.float32)
    streams: list[int] = []
    slow, quick = _branches(cp, big, x, streams)

    def step():
        a, b = cuda_backend.concurrently(slow, quick)
        return a + b

    first, replay = cuda_backend.capture(step)
    assert replay is not None  # forked streams that join again are recordable
    np.testing.assert_allclose(cp.asnumpy(first), _expected(cp.asnumpy(big), cp.asnumpy(x)), rtol=1e-4)
    for scale in (0.5, 3.0):  # new values in the same buffers: the replay reads them, after both branches end
        big *= scale
        x += 1
        got = cp.asnumpy(replay())
        np.testing.assert_allclose(got, _expected(cp.asnumpy(big), cp.asnumpy(x)), rtol=1e-4)


def test_nested_branches_take_streams_no_running_branch_holds(cuda_backend):
    import cupy as cp

    big = cp.asarray(np.random.default_rng(2).standard_normal((2048, 4096), dtype=np.float32))
    x = cp.arange(8, dtype=cp.float32)
    streams: list[int] = []
    slow, quick = _branches(cp, big, x, streams)
    outer: list[int] = []

    def nested():
        outer.append(cp.cuda.get_current_stream().ptr)
        a, b = cuda_backend.concurrently(slow, quick)
        return a + b

    def step():
        got, again = cuda_backend.concurrently(lambda: cp.cos(x) * 2, nested)
        return got + again

    first, replay = cuda_backend.capture(step)
    assert replay is not None
    # the nested call ran twice (the real run, then the recording): its slow branch on the outer branch's stream,
    # its quick one on a stream of its own
    assert streams[0] == outer[0] and streams[2] == outer[1] and streams[1] not in outer and streams[3] not in outer
    want = _expected(cp.asnumpy(big), cp.asnumpy(x)) + np.cos(cp.asnumpy(x).astype(np.float64)) * 2
    np.testing.assert_allclose(cp.asnumpy(first), want, rtol=1e-4)
    big *= -1.0
    want = _expected(cp.asnumpy(big), cp.asnumpy(x)) + np.cos(cp.asnumpy(x).astype(np.float64)) * 2
    np.testing.assert_allclose(cp.asnumpy(replay()), want, rtol=1e-4)


def test_release_scratch_frees_the_pools_unused_blocks(cuda_backend):
    import cupy as cp

    pool = cp.get_default_memory_pool()
    kept = cp.ones(1 << 20, dtype=cp.float32)
    scratch = cp.empty(1 << 26, dtype=cp.float32)  # 256 MiB
    del scratch
    held = pool.total_bytes()
    assert held - pool.used_bytes() >= 1 << 28  # cached, not in use
    cuda_backend.release_scratch()
    assert held - pool.total_bytes() >= 1 << 28 and float(kept.sum()) == 1 << 20


def test_threads_never_share_branch_streams(cuda_backend):
    """Sessions on worker threads (the server's slots) each take branch streams of their own: a stream one thread's
    branch ran on never runs another thread's, even when one thread's call ends while the other's is inside."""
    import threading

    import cupy as cp

    used: list[set[int]] = [set(), set()]
    inside = threading.Barrier(2, timeout=60)
    errors: list[BaseException] = []

    def run(k: int) -> None:
        def note() -> int:
            used[k].add(cp.cuda.get_current_stream().ptr)
            return k

        def note_together() -> int:  # both threads inside concurrently at once
            note()
            inside.wait()
            return k

        try:
            with cp.cuda.Stream(non_blocking=True):
                for rounds in range(4):
                    # thread 1 enters its second call while thread 0 may still be inside its first, and so on
                    branches = (lambda: k, note_together, note) if rounds % 2 == 0 else (lambda: k, note, note, note)
                    assert cuda_backend.concurrently(*branches) == (k,) * len(branches)
                    if rounds % 2 == 1:
                        inside.wait()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)
            inside.abort()

    threads = [threading.Thread(target=run, args=(k,)) for k in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    assert used[0] and used[1] and not used[0] & used[1]
