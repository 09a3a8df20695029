"""Whether prefetching a decode GEMV's weights into L2 would pay: Flash's Q8_0 attention GEMVs cold, with their
weights already in L2, and after three ways of pulling them there (`prefetch.global.L2` every 128 bytes,
`cp.async.bulk.prefetch.L2` of 32 KB spans, plain loads through L2); then the case a step would have: two or four
latency-bound single-block kernels (as between `attn_q_b` and `attn_output_a`) and the GEMV, with the prefetch on
a second stream beside the small kernels, or without it.

Each round reads another of six copies of the matrix, so the weights are cold unless prefetched. Times are means
in CUDA graphs; the roof is the copy bandwidth that ``ds4 bench`` measures.

Usage: python benchmarks/l2_prefetch.py   (needs a GPU with the CUDA backend, sm_90 for the bulk prefetch)
"""

from __future__ import annotations

from collections.abc import Callable

import cupy as cp
import numpy as np
from decode_gemvs import call, graph_us
from ds4_backend_cuda import gemv
from ds4_bench.synthetic_device import copy_bandwidth, device_blocks

PREFETCH = r'''
extern "C" __global__ void prefetch_lines(const char* p, long long n) {
    const long long stride = (long long)gridDim.x * blockDim.x * 128;
    for (long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * 128; i < n; i += stride)
        asm volatile("prefetch.global.L2::evict_last [%0];" :: "l"(p + i));
}
extern "C" __global__ void prefetch_bulk(const char* p, long long n) {
    const long long span = 32768, stride = (long long)gridDim.x * blockDim.x * span;
    for (long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * span; i < n; i += stride)
        asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;" :: "l"(p + i), "r"((unsigned)min(span, n - i))
                     : "memory");
}
extern "C" __global__ void load_through_l2(const uint4* p, long long n, unsigned* sink) {
    unsigned acc = 0;
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const uint4 v = __ldcg(p + i);
        acc ^= v.x ^ v.w;
    }
    if (acc == 0x12345678u) *sink = acc;  // keeps the loads
}
// A latency-bound single-block kernel: y = x / rms(x).
extern "C" __global__ void small_norm(const float* x, float* y, int n) {
    __shared__ float part[32];
    float s = 0.f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) s += x[i] * x[i];
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = s;
    __syncthreads();
    if (threadIdx.x < 32) {
        s = threadIdx.x < blockDim.x / 32 ? part[threadIdx.x] : 0.f;
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    }
    __syncthreads();
    if (threadIdx.x == 0) part[0] = s;
    __syncthreads();
    for (int i = threadIdx.x; i < n; i += blockDim.x) y[i] = x[i] * rsqrtf(part[0] / n + 1e-6f);
}
'''
SHAPES = (("attn_q_b", 32768, 1024), ("attn_output_b", 4096, 8192))
COPIES = 6
rng = np.random.default_rng(0)


def prefetchers(module: cp.RawModule) -> dict[str, Callable[[object], Callable[[], None]]]:
    """Name -> a launch that pulls a weight matrix into L2."""
    sink = cp.zeros(1, cp.uint32)
    lines, bulk, loads = (module.get_function(n) for n in ("prefetch_lines", "prefetch_bulk", "load_through_l2"))
    return {"prefetch.global.L2": lambda m: call(lines, (264,), (256,), (m, np.int64(m.nbytes))),
            "cp.async.bulk.prefetch": lambda m: call(bulk, (max(1, -(-m.nbytes // (32768 * 128))),), (128,),
                                                     (m, np.int64(m.nbytes))),
            "loads through L2": lambda m: call(loads, (264,), (512,), (m, np.int64(m.nbytes // 16), sink))}


def beside(side: cp.cuda.Stream, small: list[Callable[[], None]], prefetch: Callable[[], None] | None,
           gemv: Callable[[], None]) -> Callable[[], None]:
    """The small kernels, then the GEMV; with ``prefetch`` on ``side`` from the round's start to the GEMV."""
    def run() -> None:
        here = cp.cuda.get_current_stream()
        if prefetch is not None:
            side.wait_event(here.record())
            with side:
                prefetch()
        for launch in small:
            launch()
        if prefetch is not None:
            here.wait_event(side.record())
        gemv()
    return run


def main() -> None:
    roof = copy_bandwidth() / 1e9
    print(f"copy bandwidth (read + write, as ds4 bench measures it) {roof:.0f} GB/s")
    module = cp.RawModule(code=PREFETCH, options=("-std=c++17",))
    pulls = prefetchers(module)
    small_norm = module.get_function("small_norm")
    xa, xb = cp.ones(4096, cp.float32), cp.ones(4096, cp.float32)
    side = cp.cuda.Stream(non_blocking=True)
    for name, rows, cols in SHAPES:
        copies = [device_blocks("Q8_0", rows, cols) for _ in range(COPIES)]
        nbytes = copies[0].nbytes
        xv = cp.asarray(rng.standard_normal(cols).astype(np.float32))
        yv = cp.empty((1, rows), cp.float32)
        gemvs = [call(*gemv.gemv_launch(m, "Q8_0", cols, xv, 1, yv, int8=True)) for m in copies]
        cold, warm = graph_us(gemvs), graph_us([gemvs[0]] * COPIES)
        print(f"{name} ({nbytes / 1e6:.1f} MB): cold {cold:.2f} us ({nbytes / cold / 1e3 / roof:.0%} of the copy "
              f"roof), weights in L2 {warm:.2f} us")
        for pull, make in pulls.items():
            alone = graph_us([make(m) for m in copies])
            both = 2 * graph_us([f for m, g in zip(copies, gemvs, strict=True) for f in (make(m), g)])
            print(f"  {pull:24s} alone {alone:6.2f} us ({nbytes / alone / 1e3 / roof:4.0%} of the roof); "
                  f"the GEMV after it {both - alone:6.2f} us")
        for n_small in (2, 4):
            small = [call(small_norm, (1,), (256,), ((xa, xb) if i % 2 == 0 else (xb, xa)) + (np.int32(4096),))
                     for i in range(n_small)]
            plain = graph_us([beside(side, small, None, g) for g in gemvs])
            line = f"  {n_small} small kernels + the GEMV: {plain:.2f} us"
            for pull, make in pulls.items():
                rounds = [beside(side, small, make(m), g) for m, g in zip(copies, gemvs, strict=True)]
                line += f"; {pull} beside them {graph_us(rounds):.2f} us"
            print(line, flush=True)
        del copies


if __name__ == "__main__":
    main()
