"""What each kind of GPU call costs the host that issues it: a project kernel launched programmatically
(``launch.Kernel``), the same kernel through CuPy's own launch, a cuBLAS 16-bit GEMM and strided-batched GEMM of a
prefill's shapes, a CuPy allocation and a CuPy elementwise operation. Each is called N times while a spin kernel holds
the GPU, so nothing waits for the device; the host's microseconds a call are printed (medians of --rounds).

A prefill is issued call by call from Python (``benchmarks/prefill_host.py`` gives a layer's total), so these costs,
times how many of each a layer makes, are where its host time goes.

Usage: python benchmarks/launch_costs.py [--calls 200] [--rounds 5]   (needs a GPU with the CUDA backend)
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
from prefill_host import spinner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    import cupy as cp
    from ds4_backend_cuda import launch, prefill

    hold = spinner()
    x = cp.ones(1 << 20, dtype=cp.float32)
    amax = cp.zeros(1, dtype=cp.float32)
    plain = prefill._shared("amax_abs")  # a prefill kernel, launched by CuPy
    pdl = launch.Kernel(plain)  # the same through the programmatic launch (its reads need no wait here)
    m, n, k = 1024, 2048, 4096
    w16 = cp.zeros((m, k), dtype=cp.uint16)
    x16 = cp.zeros((n, k), dtype=cp.uint16)
    out = cp.empty((n, m), dtype=cp.float32)
    ab = prefill._unit_scalars(cp.cuda.Device().id)
    calls: dict[str, Callable[[], object]] = {
        "launch.Kernel (programmatic)": lambda: pdl((64,), (256,), (x, np.int64(x.size), amax)),
        "CuPy RawKernel": lambda: plain((64,), (256,), (x, np.int64(x.size), amax)),
        f"cuBLAS gemmEx fp16 {m}x{n}x{k} (prefill._gemm_nt)": lambda: prefill._gemm_nt(
            w16, "f16", x16, out.data.ptr, m, n, k, m, ab),
        "cuBLAS gemmStridedBatchedEx fp16 x4 (prefill.gemm_rows)": lambda: prefill.gemm_rows(
            x16.data.ptr, k, w16.data.ptr, k, out.data.ptr, m, n // 4, m, k, transpose_b=True, batch=4,
            strides=(n // 4 * k, 0, n // 4 * m), fp16=True),
        "cupy.empty (1 MB)": lambda: cp.empty(1 << 18, dtype=cp.float32),
        "cupy elementwise (x * 2)": lambda: x * 2,
    }
    results: dict[str, list[float]] = {name: [] for name in calls}
    for call in calls.values():  # warm: compiles, picks algorithms, fills the pool
        call()
    cp.cuda.Device().synchronize()
    for _ in range(args.rounds):
        for name, call in calls.items():
            cp.cuda.Device().synchronize()
            hold(200.0)
            start = time.perf_counter()
            for _ in range(args.calls):
                call()
            results[name].append((time.perf_counter() - start) / args.calls * 1e6)
            cp.cuda.Device().synchronize()
    print(f"host µs a call, medians of {args.rounds} rounds of {args.calls} calls, the GPU held by a spin kernel:")
    for name, values in results.items():
        print(f"  {np.median(values):7.1f}  {name}")


if __name__ == "__main__":
    main()
