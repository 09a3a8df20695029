"""Two latency-bound launches of a decode step alone, on DeepSeek V4 Flash shapes, each in a CUDA graph.

* ``hc_expand_mix_norm`` (``hc_post_pre_norm`` of a sub-layer's two outputs): the streams' expansion and the next
  mix over 64 column slices, then the last block of the token makes the mix row, the split, the collapse and its norm.
  Timed whole, and without its last block (the launches' counts start far from the last count, so no block is last):
  the difference is what the last block adds to a step's critical path.
* ``attend_rows`` + ``attend_merge`` (``sparse_attention``): 64 heads of 512 over a CSA layer's 640 rows (20 row
  tiles merged) and over a sliding window's 128.

Eight copies of each input are launched in turn, so that the launches do not read one another's outputs.

Usage: python benchmarks/decode_glue.py   (needs a GPU with the CUDA backend)
"""

from __future__ import annotations

import cupy as cp
import numpy as np
from decode_gemvs import graph_us
from ds4_backend_cuda import attention_ops, hc_ops, moe_ops
from ds4_bench.synthetic_device import device_blocks

from ds4_core.backend import Weight

D, N_HC, HEADS, HEAD_DIM, ROWS = 4096, 4, 64, 512, 4096  # Flash's hidden size, streams, heads, head width; KV rows
COPIES = 8
rng = np.random.default_rng(0)


def normal(*shape: int):
    return cp.asarray(rng.standard_normal(shape).astype(np.float32))


def f32_weight(name: str, values) -> Weight:
    return Weight(name, "F32", values.shape, values.view(cp.uint8))


def hyper_connection() -> None:
    M = (2 + N_HC) * N_HC
    copies = [(Weight("fn", "F16", (M, N_HC * D), device_blocks("F16", M, N_HC * D).reshape(M, -1)),
               normal(1, N_HC, D), normal(1, D), normal(1, D)) for _ in range(COPIES)]
    post, comb = cp.abs(normal(1, N_HC)), cp.abs(normal(1, N_HC, N_HC)) / 4
    scale, base = f32_weight("scale", normal(3) * 0.1), f32_weight("base", normal(M) * 0.1)
    norm = f32_weight("norm", normal(D))

    def launch(fn, S, y, y2):
        return lambda: hc_ops.hc_post_pre_norm(S, (y, y2), post, comb, fn, scale, base, 20, 1e-6, 1e-6, norm)

    print(f"hc_expand_mix_norm                   {graph_us([launch(*c) for c in copies]):6.2f} us", flush=True)
    for fn, *_ in copies:
        moe_ops.block_counts(fn)[...] = 1 << 20
    print(f"  without its last block             {graph_us([launch(*c) for c in copies]):6.2f} us", flush=True)
    for fn, *_ in copies:
        moe_ops.block_counts(fn)[...] = 0


def attention() -> None:
    kv = normal(ROWS, HEAD_DIM)
    sinks = f32_weight("sinks", normal(HEADS))
    for rows in (640, 128):
        queries = [normal(1, HEADS, HEAD_DIM) for _ in range(COPIES)]
        idx = cp.asarray(rng.choice(ROWS, (1, rows), replace=False).astype(np.int32))
        launches = [lambda q=q, idx=idx: attention_ops.sparse_attention(q, kv, idx, sinks, 0.05) for q in queries]
        print(f"attend_rows + attend_merge, {rows:3d} rows {graph_us(launches):6.2f} us", flush=True)


if __name__ == "__main__":
    hyper_connection()
    attention()
