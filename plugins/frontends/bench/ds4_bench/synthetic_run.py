"""``ds4 bench --synthetic``: a :class:`~.synthetic_plan.SyntheticModel` built in GPU memory and timed against the
ceilings measured in the same run.

Decode: the weight plan (plus, per context, its state reads) as one step of the backend's own launches, timed
eagerly and as one CUDA graph; fraction = bytes read ÷ step time ÷ copy bandwidth. Prefill: every distinct dense
matmul (``ds4_backend_cuda.prefill.prefill_linear``) and routed-expert shape (``prefill_moe``) at each token count;
fraction = FLOP/s ÷ the bf16 matmul rate.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import synthetic_device as device
from .engine_decode import print_numerics
from .synthetic_plan import Matrix, Plan, RoutedExperts, SyntheticModel, fitting_layers, prefill_plan, read_bytes

#: SwiGLU clamp of the prefill experts (DeepSeek V4 and GLM 5.3 Flash use 10; a clamp costs what none costs).
_SWIGLU_LIMIT = 10.0


def _sums(item: RoutedExperts) -> bool:
    """Whether a decode step hands the routed gate/up's output to one launch of the down projections and their sum,
    as ``ds4_backend_cuda.moe_ops.moe_experts`` does."""
    from ds4_backend_cuda.gemv import WARPS_PER_BLOCK, gate_up_writes_activation, use_int8

    return (use_int8(None, item.down) and item.k <= WARPS_PER_BLOCK and item.down_cols == item.inter
            and gate_up_writes_activation(item.gate_up, item.inter))


def build_step(plan: Plan, seed: int = 0) -> device.Step:
    """The launches of ``plan`` over preallocated device buffers (the backend's own GEMV and routed-expert kernels).

    Each matrix reads its own random activation; a state read is a float32 GEMV over a buffer of its size. Routed
    gate/up reads one random token; down reads the SwiGLU output (quantized by the gate/up, and summed in its
    launch, where a decode step does so), or, when its rows are padded, a separate activation of the padded width
    whose padding is zero (copying the SwiGLU output into it is glue, which the step leaves out like the rest of the
    elementwise work).
    """
    import cupy as cp

    rng = np.random.default_rng(seed)
    b = device.StepBuilder(rng)
    for item in plan:
        if isinstance(item, Matrix):
            b.gemv(item.qtype, item.rows, item.cols, item.groups)
        elif isinstance(item, RoutedExperts):
            idx = cp.asarray(rng.choice(item.experts, item.k, replace=False).astype(np.int32))
            x = cp.asarray(rng.standard_normal((1, item.hidden), dtype=np.float32))
            h, act = b.gate_up(item.gate_up, item.experts, item.inter, item.hidden, idx, x, _sums(item))
            if item.down_cols > item.inter:
                h = cp.zeros((item.k, item.down_cols), dtype=cp.float32)
                h[:, :item.inter] = cp.asarray(rng.standard_normal((item.k, item.inter), dtype=np.float32))
            b.down(item.down, item.experts, item.hidden, item.down_cols, idx, h, act)
        else:
            b.gemv("F32", item.rows, item.width)
    return b.step()


def _eager_and_graph(step: device.Step, stream: Any, repeats: int) -> tuple[float, float, bool]:
    """(eager s, graph replay s, replay output == eager output) of ``step`` on ``stream`` (the current stream).

    Outputs are poisoned with NaN before the graph is captured, so equality proves the replay wrote them.
    """
    import cupy as cp

    eager = device.time_on_stream(step.run, repeats)
    eager_out = [cp.asnumpy(o) for o in step.outputs]
    for o in step.outputs:
        o.fill(np.nan)
    stream.begin_capture()
    step.run()
    graph = stream.end_capture()
    graph.upload(stream)
    replay = device.time_on_stream(lambda: graph.launch(stream), repeats)
    same = all(np.array_equal(a, cp.asnumpy(o)) for a, o in zip(eager_out, step.outputs, strict=True))
    return eager, replay, same


def decode_results(model: SyntheticModel, recipe: str, layers: int, contexts: Sequence[int], repeats: int,
                   bandwidth: float) -> dict[str, Any]:
    """Eager and CUDA-graph timings of ``layers`` layers (+ head) of ``model`` at context 0 (weights only) and at
    each of ``contexts`` (weights + that context's state reads), with their roofline fractions.

    ``projected_tokens_per_s`` scales the graph time to the full model by bytes read (the layers of a hybrid model
    differ, so a per-layer time would mislead). Buffers are filled and timed on one stream.
    """
    import cupy as cp

    full_weights = read_bytes(model.plan(recipe, model.layers))
    steps = []
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        weights = build_step(model.plan(recipe, layers))
        for context in (0, *(c for c in contexts if c > 0)):
            step = weights + build_step(model.state(layers, context) if context else [], seed=context)
            eager, replay, same = _eager_and_graph(step, stream, repeats)
            nbytes = step.nbytes
            full_bytes = full_weights + (read_bytes(model.state(model.layers, context)) if context else 0)
            steps.append({"context": context, "launches": len(step.launches), "bytes_per_step": nbytes,
                          "weight_bytes": weights.nbytes, "state_bytes": nbytes - weights.nbytes,
                          "full_model_bytes_per_step": full_bytes, "eager_s": eager, "graph_s": replay,
                          "graph_matches_eager": same, "eager_fraction": nbytes / eager / bandwidth,
                          "graph_fraction": nbytes / replay / bandwidth,
                          "projected_tokens_per_s": nbytes / (replay * full_bytes)})
            del step
    free, total = cp.cuda.runtime.memGetInfo()
    return {"model": model.title, "recipe": recipe, "recipe_formats": model.recipes[recipe], "layers": layers,
            "full_layers": model.layers, "state_note": model.state_note, "steps": steps,
            "peak_pool_bytes": cp.get_default_memory_pool().total_bytes(), "device_used_bytes": total - free}


def _prefill_entry(name: str, qtype: str, shape: list[int], tokens: int, calls: int, flops: int, seconds: float,
                   peak: tuple[int, int], matmul_rate: float) -> dict[str, Any]:
    return {"name": name, "qtype": qtype, "shape": shape, "tokens": tokens, "calls_per_model": calls,
            "flops": flops, "seconds": seconds, "flop_per_s": flops / seconds,
            "fraction_of_bf16": flops / seconds / matmul_rate, "peak_bytes": peak[0], "scratch_bytes": peak[1]}


def prefill_results(model: SyntheticModel, recipe: str, tokens: Sequence[int], repeats: int,
                    matmul_rate: float) -> dict[str, Any]:
    """Prefill matmuls of the whole ``model`` on the tensor-core path (``ds4_backend_cuda.prefill``) at each token
    count, against the bf16 matmul rate.

    ``matmuls``: each distinct dense shape (``prefill_linear``) and routed-expert shape (``prefill_moe``, random
    top-k routing, so tokens spread evenly over the experts), with its peak pool bytes. Down rows padded past
    ``inter`` (Qwen3.8 Q2) need gate/up of the padded width in ``prefill_moe``: those rows cost time but their
    FLOPs are not counted. ``projection``: each timing × its calls per model -> prefill tokens/s; attention,
    norms, glue and the head are excluded, so it is an upper bound.
    """
    import cupy as cp
    from ds4_backend_cuda.prefill import prefill_linear, prefill_moe

    from ds4_core.backend import Weight

    dense, routed = prefill_plan(model.plan(recipe, model.layers))
    matmuls, projection = [], []
    for t in tokens:
        entries = []
        for m in dense:
            raw = device.device_blocks(m.qtype, m.rows, m.cols)
            x = cp.random.standard_normal((t, m.cols), dtype=cp.float32)
            fn = functools.partial(prefill_linear, x, raw, m.qtype, m.cols)
            peak = device.peak_pool(fn)
            entries.append(_prefill_entry(", ".join(m.names), m.qtype, [m.rows, m.cols], t, m.calls, m.flops(t),
                                          device.time_on_stream(fn, repeats), peak, matmul_rate))
            del raw, x, fn
        for r in routed:
            e = r.experts
            E, D, inter = e.experts, e.hidden, e.down_cols
            gate, up = (Weight(w, e.gate_up, (E, inter, D), device.device_blocks(e.gate_up, E * inter, D))
                        for w in ("gate", "up"))
            down = Weight("down", e.down, (E, D, inter), device.device_blocks(e.down, E * D, inter))
            x = cp.random.standard_normal((t, D), dtype=cp.float32)
            idx = cp.argsort(cp.random.random((t, E)), axis=1)[:, :e.k].astype(cp.int32)
            weights = cp.random.uniform(0.1, 1.0, (t, e.k), dtype=cp.float32)
            fn = functools.partial(prefill_moe, x, gate, up, down, idx, weights, _SWIGLU_LIMIT)
            peak = device.peak_pool(fn)
            padded = f", gate/up padded to {inter}" if inter > e.inter else ""
            entries.append(_prefill_entry(f"routed experts ({e.k} of {E}{padded})",
                                          f"{e.gate_up}/{e.gate_up}/{e.down}", [E, e.inter, D], t, r.calls,
                                          r.flops(t), device.time_on_stream(fn, repeats), peak, matmul_rate))
            del gate, up, down, x, idx, weights, fn
        total = sum(e["seconds"] * e["calls_per_model"] for e in entries)
        flops = sum(e["flops"] * e["calls_per_model"] for e in entries)
        projection.append({"tokens": t, "layers": model.layers, "seconds": total, "tokens_per_s": t / total,
                           "fraction_of_matmul_roof": flops / total / matmul_rate,
                           "peak_bytes": max(e["peak_bytes"] for e in entries)})
        matmuls.extend(entries)
    return {"recipe": recipe, "matmuls": matmuls, "projection": projection}


def run_model(model: SyntheticModel, recipe: str = "q2", layers: int | None = None, repeats: int = 20,
              contexts: Sequence[int] = (2048, 32768), prefill_tokens: Sequence[int] = (2048, 16384)) -> dict[str, Any]:
    """Every measurement of ``ds4 bench --synthetic`` for ``model``, as a JSON-able dict.

    ``layers``: decoder layers to build for decode (default: all whose weights fit in free device memory; capped
    at the model's). Prefill always covers the whole model (one layer's shapes at a time).
    """
    import cupy as cp

    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    t0 = time.perf_counter()
    bandwidth = device.copy_bandwidth()
    rate, how = device.bf16_matmul_rate()
    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()
    if layers is None:
        layers = fitting_layers(model, recipe, cp.cuda.runtime.memGetInfo()[0])
    layers = min(layers, model.layers)
    from ds4_backend_cuda.numerics import numerics

    results = {"device": props["name"].decode(), "hbm_copy_bytes_per_s": bandwidth, "matmul_flop_per_s": rate,
               "matmul_how": how, "numerics": numerics(),
               "decode": decode_results(model, recipe, layers, contexts, repeats, bandwidth)}
    pool.free_all_blocks()
    results["prefill"] = prefill_results(model, recipe, prefill_tokens, max(3, repeats // 4), rate)
    results["seconds"] = time.perf_counter() - t0
    return results


def print_report(r: dict[str, Any]) -> None:
    """The results of :func:`run_model` as plain text on stdout."""
    d, gb = r["decode"], 1e9
    print(f"device: {r['device']}")
    print_numerics(r["numerics"])
    print(f"HBM copy bandwidth (read+write): {r['hbm_copy_bytes_per_s'] / gb:.0f} GB/s; "
          f"matmul roof: {r['matmul_flop_per_s'] / 1e12:.0f} TFLOP/s ({r['matmul_how']})")
    print(f"{d['model']} decode step (batch 1), recipe {d['recipe']} ({d['recipe_formats']}), {d['layers']} of "
          f"{d['full_layers']} layers built, peak pool {d['peak_pool_bytes'] / gb:.1f} GB, device memory in use "
          f"{d['device_used_bytes'] / gb:.1f} GB")
    print(f"  context 0 = weights only; context N adds the state reads of N cached tokens: {d['state_note']}. "
          "Not included: the elementwise glue, softmax and state writes.")
    for s in d["steps"]:
        print(f"  context {s['context']:6d}: {s['launches']} launches, {s['bytes_per_step'] / gb:.3f} GB read "
              f"({s['weight_bytes'] / gb:.3f} weights + {s['state_bytes'] / gb:.3f} state), full model "
              f"{s['full_model_bytes_per_step'] / gb:.2f} GB/step")
        for mode in ("eager", "graph"):
            sec = s[f"{mode}_s"]
            line = (f"    {mode:5s} {sec * 1e3:8.3f} ms {s['bytes_per_step'] / sec / gb:6.0f} GB/s "
                    f"{100 * s[f'{mode}_fraction']:5.1f}% of copy bandwidth")
            if mode == "graph":
                line += (f"; replay == eager: {s['graph_matches_eager']}; projected "
                         f"{s['projected_tokens_per_s']:.1f} t/s for {d['full_layers']} layers")
            print(line)
    pf = r["prefill"]
    print(f"prefill matmuls of all {d['full_layers']} layers, recipe {pf['recipe']} (16-bit dequantized tiles + "
          "cuBLAS tensor cores, fp32 accumulate; peak = CuPy pool after one call):")
    for p in pf["matmuls"]:
        shape = "x".join(str(v) for v in p["shape"])
        print(f"  T={p['tokens']:5d} {p['name'][:40]:40s} {p['qtype']:17s} {shape:>14s} x{p['calls_per_model']:<5d}"
              f"{p['seconds'] * 1e3:9.3f} ms {p['flop_per_s'] / 1e12:7.1f} TFLOP/s {100 * p['fraction_of_bf16']:5.1f}%"
              f"  peak {p['peak_bytes'] / gb:5.2f} GB (+{p['scratch_bytes'] / gb:.2f})")
    for p in pf["projection"]:
        print(f"  T={p['tokens']:5d}: {p['layers']} layers' matmuls {p['seconds'] * 1e3:.1f} ms -> projected prefill "
              f"{p['tokens_per_s']:.0f} t/s, {100 * p['fraction_of_matmul_roof']:.1f}% of the matmul roof, peak "
              f"{p['peak_bytes'] / gb:.2f} GB (attention, norms, glue and output head excluded)")
    if "engine" in r:
        from .flash_engine import print_engine

        print_engine(r["engine"])
    print(f"total {r['seconds']:.1f} s")

