"""What one dependency between two steps of a decode step costs on this GPU, four ways.

A decode step is a chain of a dozen dependent launches a layer, each waiting for the whole of the one before. Here
every step is a grid in which each block reads the value another block wrote in the previous step (so each step
depends on the whole previous one), with a block a multiprocessor and with four, timed as:

* kernels: one launch a step, replayed in a CUDA graph, plain and with programmatic dependent launch (the launches
  of the decode step, ``launch.py``);
* one persistent kernel whose steps meet at a barrier of the whole grid (an arrival count every block adds to and
  waits on);
* one persistent kernel in which a block waits only for the block whose value it reads (a flag a block and step).

The cost of a step is the time of 2N steps less that of N, over N: launch and graph overheads cancel. The values are
checked (each step adds one), so a dependency that was not waited for fails the run.

Usage: PYTHONPATH=plugins/backends/cuda python benchmarks/dependency_latency.py   (needs a GPU; CuPy alone)
"""

from __future__ import annotations

from collections.abc import Callable

import cupy as cp
import numpy as np
from ds4_backend_cuda.launch import Kernel, programmatic
from ds4_backend_cuda.modules import source

CODE = source("pdl.cuh") + r"""
__device__ __forceinline__ unsigned load_acquire(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void store_release(unsigned* p, unsigned v) {
    asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}

// Step s of a block: the next block's value of step s plus one (values [steps + 1][blocks]).
__device__ __forceinline__ void advance(float* values, int s) {
    const int n = gridDim.x;
    values[(s + 1) * n + blockIdx.x] = __ldcg(values + s * n + (blockIdx.x + 1) % n) + 1.f;
}

extern "C" __global__ void one_step(float* values, int s) {
    grid_wait();
    if (threadIdx.x == 0) advance(values, s);
}

extern "C" __global__ void barrier_steps(float* values, unsigned* arrived, int steps) {
    for (int s = 0; s < steps; ++s) {
        if (threadIdx.x == 0) {
            advance(values, s);
            __threadfence();
            atomicAdd(arrived, 1u);
            while (load_acquire(arrived) < (unsigned)(s + 1) * gridDim.x) {
            }
        }
        __syncthreads();
    }
}

extern "C" __global__ void flag_steps(float* values, unsigned* done, int steps) {
    const unsigned* from = done + (blockIdx.x + 1) % gridDim.x;
    for (int s = 0; s < steps; ++s) {
        if (threadIdx.x == 0) {
            while (load_acquire(from) < (unsigned)s) {
            }
            advance(values, s);
            store_release(done + blockIdx.x, s + 1);
        }
        __syncthreads();
    }
}
"""
THREADS, REPLAYS, STEPS = 256, 20, 64


def kernels() -> dict[str, cp.RawKernel]:
    module = cp.RawModule(code=CODE, options=("--std=c++17",))
    return {name: module.get_function(name) for name in ("one_step", "barrier_steps", "flag_steps")}


def timed_ms(run: Callable[[cp.cuda.Stream], None], stream: cp.cuda.Stream) -> float:
    """Median ms of ``run`` on ``stream`` over :data:`REPLAYS` calls, after one untimed."""
    run(stream)
    times = []
    for _ in range(REPLAYS):
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        run(stream)
        end.record(stream)
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end))
    return float(np.median(times))


def chain(step: Callable, blocks: int, steps: int, values: cp.ndarray, stream: cp.cuda.Stream) -> float:
    """ms of a graph of ``steps`` launches of ``one_step``, replayed, its values checked."""
    with stream:
        stream.begin_capture()
        for s in range(steps):
            step((blocks,), (THREADS,), (values, np.int32(s)))
        graph = stream.end_capture()
    return _checked_ms(graph.launch, values, steps, stream)


def persistent(kernel: cp.RawKernel, blocks: int, steps: int, values: cp.ndarray, counter: cp.ndarray,
               stream: cp.cuda.Stream) -> float:
    def run(s: cp.cuda.Stream) -> None:
        with s:
            counter.fill(0)
            kernel((blocks,), (THREADS,), (values, counter, np.int32(steps)))

    return _checked_ms(run, values, steps, stream)


def _checked_ms(run: Callable[[cp.cuda.Stream], None], values: cp.ndarray, steps: int,
                stream: cp.cuda.Stream) -> float:
    """:func:`timed_ms` of ``run``, after one run from cleared values whose result is checked: earlier runs leave the
    right values behind, which a step that did not wait could read."""
    with stream:
        values[1:] = 0
    run(stream)
    stream.synchronize()
    last = cp.asnumpy(values[steps])
    if not np.all(last == steps):
        raise AssertionError(f"after {steps} steps the values are {np.unique(last)[:4]}: a dependency was not kept")
    return timed_ms(run, stream)


def main() -> None:
    sms = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)["multiProcessorCount"]
    fns = kernels()
    stream = cp.cuda.Stream(non_blocking=True)
    print(f"{THREADS} threads a block; µs a step, from {2 * STEPS} steps against {STEPS}; PDL "
          f"{'available' if programmatic() else 'not available (its row repeats the plain one)'}")
    ways = {"kernels in a graph": fns["one_step"], "kernels in a graph, PDL": Kernel(fns["one_step"])}
    for blocks in (sms, 4 * sms):  # a block a multiprocessor, and four (all resident: the barriers need it)
        values = cp.zeros((2 * STEPS + 1, blocks), cp.float32)
        counter = cp.zeros(blocks, cp.uint32)
        rows = {name: [chain(step, blocks, k, values, stream) for k in (STEPS, 2 * STEPS)]
                for name, step in ways.items()}
        for name in ("barrier_steps", "flag_steps"):
            rows[f"one kernel, {name}"] = [persistent(fns[name], blocks, k, values, counter, stream)
                                           for k in (STEPS, 2 * STEPS)]
        for name, (short, long) in rows.items():
            print(f"{blocks:4d} blocks  {name:34s} {(long - short) / STEPS * 1e3:6.2f} µs a step", flush=True)


if __name__ == "__main__":
    main()
