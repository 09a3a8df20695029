"""A token's routed experts read from pinned host memory, on DeepSeek V4 Flash shapes: in place by the expert kernels,
or copied into device scratch first by ``gather_experts`` (``host_experts.gathered``), against the bus's own copy.

One layer's routed experts (IQ2_XXS gate and up, Q2_K down: 256 experts, 1.8 GB) are random valid blocks in pinned
host memory, as ``DS4_CUDA_HOST_EXPERTS`` keeps them. Each figure is the mean over a new set of 6 experts a launch,
with the bytes those experts hold (42.5 MB a token):

* the bus: ``cudaMemcpyAsync`` of the layer whole, and of a token's 18 expert slices (their ids known on the host,
  which a decode step's are not: the bus's rate for those sizes);
* ``gather_experts`` alone, and followed by the experts' kernels on the scratch (what a decode step now runs);
* the experts' kernels reading host memory in place (what a decode step ran before), and on device-resident experts.

Usage: python benchmarks/host_reads.py [--tokens N]   (needs a GPU with the CUDA backend; 2 GB of pinned memory)
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import cupy as cp
import numpy as np
from ds4_backend_cuda import gemv, host_experts
from ds4_bench.synthetic_device import device_blocks

from ds4_core.backend import Weight

E, F, D, K = 256, 2048, 4096, 6  # Flash's experts, expert width, hidden size, experts a token
rng = np.random.default_rng(0)


def timed_ms(run: Callable[[int], None], n: int) -> float:
    """Mean ms of ``run(i)`` for i < n, after one warm-up run, on the current stream."""
    run(0)
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for i in range(n):
        run(i)
    end.record()
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / n


def pinned(w: Weight) -> Weight:
    return Weight(w.name, w.qtype, w.shape, host_experts.host_array(cp, cp.cuda.Device().id, cp.asnumpy(w.data),
                                                                    w.data.shape[0]))


def moe(gate: Weight, up: Weight, down: Weight, idx: cp.ndarray, x: cp.ndarray, out: cp.ndarray) -> None:
    """A token's routed experts as a decode step runs them (gate/up handing its output to the summed down)."""
    h = cp.empty((K, F), cp.float32)
    act = cp.empty(gemv.act_bytes(K * F), cp.uint8)
    kernel, grid, block, args = gemv.moe_gate_up_launch(gate, up, idx, x, K, 0.0, h, act_out=act)
    kernel(grid, block, args)
    weights = cp.full((1, K), 1 / K, cp.float32)
    kernel, grid, block, args = gemv.moe_down_sum_launch(down, idx, K, h, weights, out, act_in=act)
    kernel(grid, block, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=20, help="expert sets timed a figure (default 20)")
    n = parser.parse_args().tokens
    device = [Weight("gate", "IQ2_XXS", (E, F, D), device_blocks("IQ2_XXS", E * F, D)),
              Weight("up", "IQ2_XXS", (E, F, D), device_blocks("IQ2_XXS", E * F, D)),
              Weight("down", "Q2_K", (E, D, F), device_blocks("Q2_K", E * D, F))]
    host = [pinned(w) for w in device]
    sets = [rng.choice(E, K, replace=False).astype(np.int32) for _ in range(n)]
    ids = [cp.asarray(s) for s in sets]
    token = sum(w.data.nbytes // E for w in host) * K
    layer = sum(w.data.nbytes for w in host)
    x, out = cp.asarray(rng.standard_normal((1, D)).astype(np.float32)), cp.empty((1, D), cp.float32)

    def report(name: str, ms: float, nbytes: int = token) -> None:
        print(f"{name:44s} {ms * 1e3:8.1f} us {nbytes / ms / 1e6:6.1f} GB/s", flush=True)

    whole = [cp.empty(w.data.shape, cp.uint8) for w in host]
    stream = cp.cuda.get_current_stream().ptr

    def copy_layer(_: int) -> None:
        for w, c in zip(host, whole, strict=True):
            cp.cuda.runtime.memcpyAsync(c.data.ptr, w.data.data.ptr, w.data.nbytes, cp.cuda.runtime.memcpyDefault,
                                        stream)

    report("bus: the layer's experts whole", timed_ms(copy_layer, 3), layer)
    slices = [cp.empty((K, w.data.nbytes // E), cp.uint8) for w in host]

    def copy_slices(i: int) -> None:
        for w, c in zip(host, slices, strict=True):
            size = w.data.nbytes // E
            for j, e in enumerate(sets[i]):
                cp.cuda.runtime.memcpyAsync(c.data.ptr + j * size, w.data.data.ptr + int(e) * size, size,
                                            cp.cuda.runtime.memcpyDefault, stream)

    report("bus: a token's 18 expert slices", timed_ms(copy_slices, n))
    report("gather_experts alone", timed_ms(lambda i: host_experts.gathered(tuple(host), ids[i]), n))

    def gathered_moe(i: int) -> None:
        copies, slots = host_experts.gathered(tuple(host), ids[i])
        moe(*copies, slots, x, out)

    report("gather_experts, then the experts' kernels", timed_ms(gathered_moe, n))
    report("the experts' kernels reading host memory", timed_ms(lambda i: moe(*host, ids[i], x, out), n))
    report("the experts' kernels, experts on the device", timed_ms(lambda i: moe(*device, ids[i], x, out), n))
    copies, slots = host_experts.gathered(tuple(host), ids[0])
    moe(*copies, slots, x, out)
    gathered_out = out.copy()
    moe(*device, ids[0], x, out)
    print("gathered experts give the device-held experts' sums bit for bit:", bool((gathered_out == out).all()))


if __name__ == "__main__":
    main()
