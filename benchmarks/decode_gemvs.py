"""The decode step's weight-streaming kernels alone, on DeepSeek V4 Flash shapes, with cold weights.

A matrix read again and again stays partly in the 50 MB L2 and times faster than inside a step, so each kernel here
reads a different copy or expert set on every launch: the routed IQ2_XXS gate/up and Q2_K down over 256 experts (a new
set of 6 each launch, as in a step), and `attn_q_b` and `attn_output_b` (Q8_0) and a CSA layer's F16 projections over
four copies; last, the q4 and mxfp4 recipes' routed experts on float32 and on int8 activations. Weights are random
valid blocks tiled on the device as `ds4 bench` makes them (the kernels do not care that they repeat). Each kernel
runs in a CUDA graph; the copy bandwidth that ``ds4 bench`` measures (a 4 GiB device-to-device copy), measured first,
is the roof each GB/s figure is compared with.

Usage: python benchmarks/decode_gemvs.py   (needs a GPU with the CUDA backend; a few GB of device memory)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import cupy as cp
import numpy as np
from ds4_backend_cuda import gemv, ops
from ds4_bench.synthetic_device import copy_bandwidth, device_blocks

from ds4_core.backend import Weight

E, F, D, PAIRS, SETS = 256, 2048, 4096, 6, 24  # Flash's experts, expert width, hidden size, experts a token
rng = np.random.default_rng(0)


def graph_us(launches: Sequence[Callable[[], None]], reps: int = 3) -> float:
    """Mean µs of one of ``launches``, replayed in a CUDA graph of ``reps`` rounds of all of them."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        for launch in launches:  # compiles and warms
            launch()
        stream.begin_capture()
        for _ in range(reps):
            for launch in launches:
                launch()
        graph = stream.end_capture()
        graph.launch(stream)
        start, end = cp.cuda.Event(), cp.cuda.Event()
        start.record(stream)
        for _ in range(10):
            graph.launch(stream)
        end.record(stream)
        end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / (10 * reps * len(launches)) * 1e3


def call(kernel: Callable, grid: tuple, block: tuple, args: tuple) -> Callable[[], None]:
    return lambda: kernel(grid, block, args)


def report(name: str, us: float, nbytes: int, roof: float) -> None:
    gbs = nbytes / us / 1e3
    print(f"{name:28s} {us:7.2f} us {gbs:7.0f} GB/s {gbs / roof:6.0%} of copy", flush=True)


def main() -> None:
    roof = copy_bandwidth() / 1e9
    print(f"copy bandwidth (read + write, as ds4 bench measures it) {roof:.0f} GB/s")
    expert_sets = [cp.asarray(rng.choice(E, PAIRS, replace=False).astype(np.int32)) for _ in range(SETS)]
    x = cp.asarray(rng.standard_normal((1, D)).astype(np.float32))
    h = cp.asarray(rng.standard_normal((PAIRS, F)).astype(np.float32))
    gate, up = (Weight(n, "IQ2_XXS", (E, F, D), device_blocks("IQ2_XXS", E * F, D)) for n in ("gate", "up"))
    down = Weight("down", "Q2_K", (E, D, F), device_blocks("Q2_K", E * D, F))
    h_out, y_out = cp.empty((PAIRS, F), cp.float32), cp.empty((PAIRS, D), cp.float32)
    act = cp.zeros(gemv.act_bytes(D), cp.uint8)  # a handed-over activation (its values do not matter here)
    for name, a in (("routed gate/up IQ2_XXS", None), ("routed gate/up, handed", act)):
        gate_up = [call(*gemv.moe_gate_up_launch(gate, up, s, x, PAIRS, 0.0, h_out, int8=True, act_in=a))
                   for s in expert_sets]
        report(name, graph_us(gate_up), 2 * PAIRS * gate.data.nbytes // E, roof)
    h_act = cp.empty(gemv.act_bytes(PAIRS * F), cp.uint8)
    gate_up = [call(*gemv.moe_gate_up_launch(gate, up, s, x, PAIRS, 0.0, h_out, int8=True, act_in=act, act_out=h_act))
               for s in expert_sets]
    report("routed gate/up, handed both", graph_us(gate_up), 2 * PAIRS * gate.data.nbytes // E, roof)
    downs = [call(*gemv.moe_gemv_launch(down, s, h, 1, y_out, int8=True)) for s in expert_sets]
    report("routed down Q2_K", graph_us(downs), PAIRS * down.data.nbytes // E, roof)
    weights, out = cp.full((1, PAIRS), 1 / PAIRS, cp.float32), cp.empty((1, D), cp.float32)
    for name, a in (("routed down summed", None), ("routed down summed, handed", h_act)):
        downs = [call(*gemv.moe_down_sum_launch(down, s, PAIRS, h, weights, out, act_in=a)) for s in expert_sets]
        report(name, graph_us(downs), PAIRS * down.data.nbytes // E, roof)
    del gate, up, down
    shared = [[Weight(n, "Q8_0", (1, F, D), device_blocks("Q8_0", F, D)) for n in ("gate", "up")] for _ in range(4)]
    h1 = cp.empty((1, F), cp.float32)
    for splits in (1, 2, 4):
        launches = [call(*gemv.moe_gate_up_launch(g, u, None, x, 1, 0.0, h1, int8=True, act_in=act, splits=splits))
                    for g, u in shared]
        report(f"shared gate/up Q8_0, {splits} split", graph_us(launches), 2 * shared[0][0].data.nbytes, roof)
    del shared
    for name, rows, cols in (("attn_q_b Q8_0", 32768, 1024), ("attn_output_b Q8_0", 4096, 8192)):
        copies = [device_blocks("Q8_0", rows, cols) for _ in range(4)]
        xv = cp.asarray(rng.standard_normal(cols).astype(np.float32))
        yv = cp.empty((1, rows), cp.float32)
        launches = [call(*gemv.gemv_launch(m, "Q8_0", cols, xv, 1, yv, int8=True)) for m in copies]
        report(name, graph_us(launches), copies[0].nbytes, roof)
    latents = [device_blocks("Q8_0", 1536, D) for _ in range(8)]  # attn_q_a and attn_kv, 6.6 MB
    yl = cp.empty((1, 1536), cp.float32)
    for name, a in (("latents Q8_0", None), ("latents, handed", act)):
        launches = [call(*gemv.gemv_launch(m, "Q8_0", D, x, 1, yl, int8=True, act_in=a)) for m in latents]
        report(name, graph_us(launches), latents[0].nbytes, roof)
    output_projection(roof)
    f16_projections(x, roof)
    expert_formats(expert_sets, x, roof)


def output_projection(roof: float) -> None:
    """``attn_output_a`` (8 groups of 1024 rows over 4096 columns) then ``attn_output_b``, Q8_0: two launches that
    each quantize their activation; ``attn_output_a`` handing its output over quantized (``act_out``); and also
    reading the attention's output quantized (``act_in``)."""
    groups, rows, cols = 8, 1024, 4096
    pairs = [(device_blocks("Q8_0", groups * rows, cols), device_blocks("Q8_0", D, groups * rows)) for _ in range(2)]
    x = cp.asarray(rng.standard_normal(groups * cols).astype(np.float32))
    low, y = cp.empty((1, groups * rows), cp.float32), cp.empty((1, D), cp.float32)
    act, heads = cp.empty(gemv.act_bytes(groups * rows), cp.uint8), cp.zeros(gemv.act_bytes(groups * cols), cp.uint8)
    nbytes = pairs[0][0].nbytes + pairs[0][1].nbytes
    for name, a_in, handed in (("attn_output_a + _b apart", None, None), ("attn_output_a + _b handed", None, act),
                               ("attn_output_a + _b, both handed", heads, act)):
        launches = [call(*launch) for a, b in pairs for launch in (
            gemv.gemv_launch(a, "Q8_0", cols, x, 1, low, groups * cols, rows, int8=True, act_in=a_in, act_out=handed),
            gemv.gemv_launch(b, "Q8_0", groups * rows, low, 1, y, int8=True, act_in=handed))]
        report(name, 2 * graph_us(launches), nbytes, roof)


def f16_projections(x: cp.ndarray, roof: float) -> None:
    """A CSA layer's float-activation F16 GEMVs: the compressors' and the indexer's projections of the layer's input
    (one launch over five matrices, ``linears``) and the indexer's query projection, over four copies each."""
    rows = (1024, 1024, 256, 256, 64)
    sets = [[device_blocks("F16", r, D) for r in rows] for _ in range(4)]
    y = cp.empty((1, sum(rows)), cp.float32)
    tables = [ops._segment_table(rows, tuple(m.data.ptr for m in mats)) for mats in sets]
    launches = [call(*gemv.gemv_launch(mats[0], "F16", D, x, 1, y, segments=(table, sum(rows))))
                for mats, table in zip(sets, tables, strict=True)]
    report("compressors + indexer F16", graph_us(launches), sum(m.nbytes for m in sets[0]), roof)
    queries = [device_blocks("F16", 8192, 1024) for _ in range(4)]
    xq, yq = cp.asarray(rng.standard_normal((1, 1024)).astype(np.float32)), cp.empty((1, 8192), cp.float32)
    launches = [call(*gemv.gemv_launch(m, "F16", 1024, xq, 1, yq)) for m in queries]
    report("indexer attn_q_b F16", graph_us(launches), queries[0].nbytes, roof)


def expert_formats(expert_sets: list[cp.ndarray], x: cp.ndarray, roof: float) -> None:
    """The routed experts of the q4 and mxfp4 recipes (Q4_K or MXFP4 gate, up and down), each kernel on float32
    activations and on int8 ones (the gate/up handing its output over quantized to the summed down)."""
    weights, out = cp.full((1, PAIRS), 1 / PAIRS, cp.float32), cp.empty((1, D), cp.float32)
    h, y = cp.empty((PAIRS, F), cp.float32), cp.empty((PAIRS, D), cp.float32)
    h_act = cp.empty(gemv.act_bytes(PAIRS * F), cp.uint8)
    for qtype in ("Q4_K", "MXFP4"):
        gate, up = (Weight(n, qtype, (E, F, D), device_blocks(qtype, E * F, D)) for n in ("gate", "up"))
        down = Weight("down", qtype, (E, D, F), device_blocks(qtype, E * D, F))
        for int8 in (False, True):
            kind = "int8" if int8 else "float"
            gate_up = [call(*gemv.moe_gate_up_launch(gate, up, s, x, PAIRS, 0.0, h, int8=int8,
                                                     act_out=h_act if int8 else None)) for s in expert_sets]
            report(f"routed gate/up {qtype} {kind}", graph_us(gate_up), 2 * PAIRS * gate.data.nbytes // E, roof)
            downs = [call(*(gemv.moe_down_sum_launch(down, s, PAIRS, h, weights, out, act_in=h_act) if int8 else
                            gemv.moe_gemv_launch(down, s, h, 1, y, int8=False))) for s in expert_sets]
            report(f"routed down {qtype} {kind}{' summed' if int8 else ''}", graph_us(downs),
                   PAIRS * down.data.nbytes // E, roof)
        del gate, up, down


if __name__ == "__main__":
    main()
