"""A synthetic DeepSeek V4 Flash in GPU memory: decode-step weight streaming and prefill matmuls, timed against
the device's own ceilings (a device-to-device copy for HBM bandwidth, a bf16 cuBLAS matmul for tensor cores).

Weights are random *valid* GGUF blocks (scales finite, codes uniform), made on the host for a template of
blocks and tiled across device buffers, so no file and no host-sized memory are needed.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import numpy as np

from ds4_core.quants import block_geometry, random_blocks

#: DeepSeek V4 Flash dimensions (spec §1.1).
FLASH: dict[str, int] = {"hidden": 4096, "layers": 43, "vocab": 129280, "q_lora": 1024, "heads": 64,
                         "head_dim": 512, "o_groups": 8, "o_lora": 1024, "experts": 256, "k": 6, "inter": 2048,
                         "hc": 4, "index_heads": 64, "index_dim": 128}
#: Routed-expert formats (gate, up, down) of each recipe; attention, shared expert and head are Q8_0.
RECIPES: dict[str, tuple[str, str, str]] = {"q2": ("IQ2_XXS", "IQ2_XXS", "Q2_K"), "q4": ("Q4_K", "Q4_K", "Q4_K"),
                                           "mxfp4": ("MXFP4", "MXFP4", "MXFP4")}
_TEMPLATE_BLOCKS = 1 << 16


def device_blocks(qtype: str, rows: int, ncols: int) -> Any:
    """A CuPy ``uint8 [rows, row bytes]`` of valid random ``qtype`` blocks (a host template tiled by doubling)."""
    import cupy as cp

    qk, size = block_geometry(qtype)
    n = rows * ncols // qk
    out = cp.empty((n, size), dtype=cp.uint8)
    m = min(n, _TEMPLATE_BLOCKS)
    out[:m] = cp.asarray(_template(qtype)[:m])
    while m < n:
        step = min(m, n - m)
        out[m:m + step] = out[:step]
        m += step
    return out.reshape(rows, -1)


@functools.cache
def _template(qtype: str) -> np.ndarray:
    return random_blocks(qtype, _TEMPLATE_BLOCKS, np.random.default_rng(list(qtype.encode())))


@attrs.define
class Launch:
    """One kernel launch of a step, with the weight bytes it must read."""

    kernel: Any
    grid: tuple[int, ...]
    block: tuple[int, ...]
    args: tuple
    nbytes: int


@attrs.define
class Step:
    """A decode step as a fixed list of launches over preallocated buffers (capturable as a CUDA graph)."""

    launches: list[Launch]
    outputs: list[Any]

    @property
    def nbytes(self) -> int:
        return sum(launch.nbytes for launch in self.launches)

    def run(self) -> None:
        for launch in self.launches:
            launch.kernel(launch.grid, launch.block, launch.args)


class _Builder:
    def __init__(self, rng: np.random.Generator):
        import cupy as cp

        self.cp, self.rng = cp, rng
        self.launches: list[Launch] = []
        self.outputs: list[Any] = []

    def gemv(self, qtype: str, rows: int, ncols: int, groups: int = 1) -> None:
        """One launch of the backend's GEMV; ``groups > 1``: a block-diagonal projection (one x per group)."""
        from ds4_backend_cuda.ops import gemv_launch

        cp = self.cp
        w = device_blocks(qtype, groups * rows, ncols)
        x = cp.asarray(self.rng.standard_normal(groups * ncols, dtype=np.float32))
        y = cp.empty(groups * rows, dtype=cp.float32)
        self.outputs.append(y)
        kernel, grid, block, args = gemv_launch(w, qtype, ncols, x, 1, y, groups * ncols,
                                                rows if groups > 1 else None)
        self.launches.append(Launch(kernel, grid, block, args, w.nbytes))

    def _experts(self, qtype: str, experts: int, rows: int, ncols: int) -> Any:
        from ds4_core.backend import Weight

        return Weight("w", qtype, (experts, rows, ncols), device_blocks(qtype, experts * rows, ncols))

    def gate_up(self, qtype: str, experts: int, rows: int, ncols: int, idx: Any, x: Any) -> Any:
        """The fused routed gate/up/SwiGLU launch for the pairs ``idx`` against one token ``x [1, ncols]``."""
        from ds4_backend_cuda.ops import moe_gate_up_launch

        gate, up = (self._experts(qtype, experts, rows, ncols) for _ in range(2))
        pairs = idx.shape[0]
        h = self.cp.empty((pairs, rows), dtype=self.cp.float32)
        self.outputs.append(h)
        kernel, grid, block, args = moe_gate_up_launch(gate, up, idx, x, pairs, 0.0, h)
        self.launches.append(Launch(kernel, grid, block, args, 2 * pairs * rows * gate.data.shape[1]))
        return h

    def experts(self, qtype: str, experts: int, rows: int, ncols: int, idx: Any, x: Any) -> Any:
        """One routed-expert GEMV launch: pair ``p`` reads expert ``idx[p]`` against ``x[p]`` (or the one row)."""
        from ds4_backend_cuda.ops import moe_gemv_launch

        w = self._experts(qtype, experts, rows, ncols)
        pairs = idx.shape[0]
        y = self.cp.empty((pairs, rows), dtype=self.cp.float32)
        self.outputs.append(y)
        kernel, grid, block, args = moe_gemv_launch(w, idx, x, pairs if x.shape[0] == 1 else 1, y)
        self.launches.append(Launch(kernel, grid, block, args, pairs * rows * w.data.shape[1]))
        return y


def build_decode_step(recipe: str, layers: int, shapes: dict[str, int] = FLASH, seed: int = 0) -> Step:
    """The weight-streaming part of one batch-1 decode step of a DeepSeek V4 with ``shapes``.

    Per layer: the two HC mixes, Q8_0 attention projections (q_a, q_b, kv, the 8 grouped o_a in one launch, o_b),
    the F16 compressor/indexer projections of CSA (even layers ≥ 2) and HCA (odd ≥ 3) layers, the F16 router,
    ``k`` routed experts (ids read on the device; gate/up/SwiGLU fused in one launch, then down) and the Q8_0
    shared expert; then the HC head and the Q8_0 output head. The launches are the backend's own
    (:func:`ds4_backend_cuda.ops.gemv_launch` and friends). Attention over the cache and the elementwise glue are
    not included.
    """
    import cupy as cp

    s = shapes
    D, n, inter, E, k = s["hidden"], s["hc"], s["inter"], s["experts"], s["k"]
    gate_t, up_t, down_t = RECIPES[recipe]
    rng = np.random.default_rng(seed)
    b = _Builder(rng)
    for layer in range(layers):
        b.gemv("F16", (2 + n) * n, n * D)
        b.gemv("Q8_0", s["q_lora"], D)
        b.gemv("Q8_0", s["heads"] * s["head_dim"], s["q_lora"])
        b.gemv("Q8_0", s["head_dim"], D)
        if layer >= 2:
            coff = 2 if layer % 2 == 0 else 1
            b.gemv("F16", coff * s["head_dim"], D)
            b.gemv("F16", coff * s["head_dim"], D)
            if coff == 2:
                b.gemv("F16", s["index_heads"] * s["index_dim"], s["q_lora"])
                b.gemv("F16", s["index_heads"], D)
                b.gemv("F16", 2 * s["index_dim"], D)
                b.gemv("F16", 2 * s["index_dim"], D)
        b.gemv("Q8_0", s["o_lora"], s["heads"] * s["head_dim"] // s["o_groups"], s["o_groups"])
        b.gemv("Q8_0", D, s["o_groups"] * s["o_lora"])
        b.gemv("F16", (2 + n) * n, n * D)
        b.gemv("F16", E, D)
        idx = cp.asarray(rng.choice(E, k, replace=False).astype(np.int32))
        x = cp.asarray(rng.standard_normal((1, D), dtype=np.float32))
        if gate_t == up_t:
            h = b.gate_up(gate_t, E, inter, D, idx, x)
        else:
            b.experts(gate_t, E, inter, D, idx, x)
            h = b.experts(up_t, E, inter, D, idx, x)
        b.experts(down_t, E, D, inter, idx, h)
        b.gemv("Q8_0", inter, D)
        b.gemv("Q8_0", inter, D)
        b.gemv("Q8_0", D, inter)
    b.gemv("F16", n, n * D)
    b.gemv("Q8_0", s["vocab"], D)
    return Step(b.launches, b.outputs)


def _time(fn: Callable[[], None], repeats: int) -> float:
    """Median seconds of ``fn`` on the current stream, by CUDA events, after two warm-up calls."""
    import cupy as cp

    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) / 1e3)
    return float(np.median(times))


def copy_bandwidth(nbytes: int = 4 << 30, repeats: int = 10) -> float:
    """HBM bandwidth in bytes/s from a device-to-device copy of ``nbytes`` (bytes read + written ÷ time)."""
    import cupy as cp

    src = cp.empty(nbytes, dtype=cp.uint8)
    dst = cp.empty_like(src)
    seconds = _time(lambda: dst.data.copy_from_device_async(src.data, nbytes), repeats)
    return 2 * nbytes / seconds


def bf16_matmul_rate(n: int = 8192, repeats: int = 10) -> tuple[float, str]:
    """(FLOP/s, how) of an ``n³`` bf16 cuBLAS matmul (through torch when present, else fp16 through CuPy)."""
    try:
        import torch

        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        seconds = _time_torch(lambda: torch.matmul(a, b), repeats)
        return 2 * n**3 / seconds, "bf16 cuBLAS via torch"
    except ImportError:
        import cupy as cp

        a = cp.random.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
        seconds = _time(lambda: cp.matmul(a, a), repeats)
        return 2 * n**3 / seconds, "fp16 cuBLAS via CuPy (no torch)"


def _time_torch(fn: Callable[[], Any], repeats: int) -> float:
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1e3)
    return float(np.median(times))


def decode_results(recipe: str, layers: int, repeats: int, bandwidth: float) -> dict[str, Any]:
    """Eager and CUDA-graph timings of the synthetic decode step, with its roofline fraction."""
    import cupy as cp

    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        step = build_decode_step(recipe, layers)
        eager = _time(step.run, repeats)
        eager_out = [cp.asnumpy(o) for o in step.outputs]
        stream.begin_capture()
        step.run()
        graph = stream.end_capture()
        graph.upload(stream)
        replay = _time(lambda: graph.launch(stream), repeats)
        same = all(np.array_equal(a, cp.asnumpy(o)) for a, o in zip(eager_out, step.outputs, strict=True))
    nbytes = step.nbytes
    full = FLASH["layers"]
    per_layer = (replay / layers) if layers else 0.0
    return {"recipe": recipe, "layers": layers, "launches": len(step.launches), "bytes_per_step": nbytes,
            "eager_s": eager, "graph_s": replay, "graph_matches_eager": same,
            "eager_fraction": nbytes / eager / bandwidth, "graph_fraction": nbytes / replay / bandwidth,
            "tokens_per_s_graph_at_43_layers": 1 / (replay * full / layers) if layers else 0.0,
            "graph_s_per_layer": per_layer, "peak_pool_bytes": cp.get_default_memory_pool().total_bytes()}


def prefill_matmuls(shapes: dict[str, int] = FLASH) -> list[tuple[str, str, int, int, int]]:
    """(name, format, rows, cols, calls per model) of the dense prefill matmuls of a DeepSeek V4 with ``shapes``.

    The same projections as :func:`build_decode_step` (CSA layers: even ≥ 2, HCA: odd ≥ 3), without the output
    head (prefill needs the last token's logits only) and the routed experts (timed through ``prefill_moe``).
    """
    s = shapes
    D, n, L = s["hidden"], s["hc"], s["layers"]
    csa = len(range(2, L, 2))
    hca = len(range(3, L, 2))
    return [("hc mix", "F16", (2 + n) * n, n * D, 2 * L),
            ("q_a", "Q8_0", s["q_lora"], D, L),
            ("q_b", "Q8_0", s["heads"] * s["head_dim"], s["q_lora"], L),
            ("kv", "Q8_0", s["head_dim"], D, L),
            ("compressor (CSA)", "F16", 2 * s["head_dim"], D, 2 * csa),
            ("compressor (HCA)", "F16", s["head_dim"], D, 2 * hca),
            ("indexer q", "F16", s["index_heads"] * s["index_dim"], s["q_lora"], csa),
            ("indexer weights", "F16", s["index_heads"], D, csa),
            ("indexer compressor", "F16", 2 * s["index_dim"], D, 2 * csa),
            ("o_a (one group)", "Q8_0", s["o_lora"], s["heads"] * s["head_dim"] // s["o_groups"], s["o_groups"] * L),
            ("o_b", "Q8_0", D, s["o_groups"] * s["o_lora"], L),
            ("router", "F16", s["experts"], D, L),
            ("shared gate/up", "Q8_0", s["inter"], D, 2 * L),
            ("shared down", "Q8_0", D, s["inter"], L)]


def _peak_pool(fn: Callable[[], Any]) -> tuple[int, int]:
    """(peak pool bytes, growth during ``fn``): what CuPy's pool holds after one call, from a trimmed pool."""
    import cupy as cp

    pool = cp.get_default_memory_pool()
    pool.free_all_blocks()
    before = pool.total_bytes()
    fn()
    cp.cuda.get_current_stream().synchronize()
    return pool.total_bytes(), pool.total_bytes() - before


def _prefill_entry(name: str, qtype: str, shape: list[int], tokens: int, calls: int, flops: float, seconds: float,
                   peak: tuple[int, int], matmul_rate: float) -> dict[str, Any]:
    return {"name": name, "qtype": qtype, "shape": shape, "tokens": tokens, "calls_per_model": calls,
            "seconds": seconds, "flop_per_s": flops / seconds, "fraction_of_bf16": flops / seconds / matmul_rate,
            "peak_bytes": peak[0], "scratch_bytes": peak[1]}


def prefill_results(tokens: Sequence[int], repeats: int, matmul_rate: float, recipe: str = "q2",
                    shapes: dict[str, int] = FLASH) -> dict[str, Any]:
    """Prefill matmuls on the tensor-core path (``ds4_backend_cuda.prefill``) at each token count, vs the bf16 roof.

    ``matmuls``: every distinct dense projection of a layer (``prefill_linear``) and the routed experts of the
    recipe (``prefill_moe``, random top-k routing), each with its peak pool bytes. ``projection``: the whole
    model's matmul time (each timing times its calls per model) -> prefill tokens/s; attention, norms, the
    hyper-connection glue and the output head are excluded, so it is an upper bound.
    """
    import cupy as cp
    from ds4_backend_cuda.prefill import prefill_linear, prefill_moe

    from ds4_core.backend import Weight

    s = shapes
    D, E, k, inter, L = s["hidden"], s["experts"], s["k"], s["inter"], s["layers"]
    formats = RECIPES[recipe]
    matmuls, projection = [], []
    for t in tokens:
        entries, measured = [], {}
        for name, qtype, rows, cols, calls in prefill_matmuls(s):
            key = (qtype, rows, cols)
            if key not in measured:
                raw = device_blocks(qtype, rows, cols)
                x = cp.random.standard_normal((t, cols), dtype=cp.float32)
                fn = functools.partial(prefill_linear, x, raw, qtype, cols)
                measured[key] = (_peak_pool(fn), _time(fn, repeats))
                del raw, x, fn
            peak, seconds = measured[key]
            entries.append(_prefill_entry(name, qtype, [rows, cols], t, calls, 2 * t * rows * cols, seconds, peak,
                                          matmul_rate))
        gate, up, down = (Weight(w, f, shape, device_blocks(f, shape[0] * shape[1], shape[2]))
                          for w, f, shape in zip(("gate", "up", "down"), formats,
                                                 ((E, inter, D), (E, inter, D), (E, D, inter)), strict=True))
        x = cp.random.standard_normal((t, D), dtype=cp.float32)
        idx = cp.argsort(cp.random.random((t, E)), axis=1)[:, :k].astype(cp.int32)
        weights = cp.random.uniform(0.1, 1.0, (t, k), dtype=cp.float32)
        fn = functools.partial(prefill_moe, x, gate, up, down, idx, weights, 10.0)
        peak = _peak_pool(fn)
        entries.append(_prefill_entry("routed experts", "/".join(formats), [E, inter, D], t, L,
                                      2 * t * k * 3 * inter * D, _time(fn, repeats), peak, matmul_rate))
        del gate, up, down, x, idx, weights, fn
        total = sum(e["seconds"] * e["calls_per_model"] for e in entries)
        flops = sum(e["flop_per_s"] * e["seconds"] * e["calls_per_model"] for e in entries)
        projection.append({"tokens": t, "layers": L, "seconds": total, "tokens_per_s": t / total,
                           "fraction_of_matmul_roof": flops / total / matmul_rate,
                           "peak_bytes": max(e["peak_bytes"] for e in entries)})
        matmuls.extend(entries)
    return {"recipe": recipe, "matmuls": matmuls, "projection": projection}


def run_all(recipe: str = "q2", layers: int | None = None, repeats: int = 20,
            prefill_tokens: Sequence[int] = (2048, 16384)) -> dict[str, Any]:
    """Every measurement of ``ds4 bench``, as a JSON-able dict."""
    import cupy as cp

    device = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(device.id)
    t0 = time.perf_counter()
    bandwidth = copy_bandwidth()
    rate, how = bf16_matmul_rate()
    cp.get_default_memory_pool().free_all_blocks()
    if layers is None:
        free, _ = cp.cuda.runtime.memGetInfo()
        per_layer = 2.1e9 if recipe == "q2" else 4.8e9  # full-size routed experts dominate
        layers = max(1, min(FLASH["layers"], int((free - 4e9) // per_layer)))
    results = {"device": props["name"].decode(), "hbm_copy_bytes_per_s": bandwidth, "matmul_flop_per_s": rate,
               "matmul_how": how}
    results["decode"] = decode_results(recipe, layers, repeats, bandwidth)
    cp.get_default_memory_pool().free_all_blocks()
    results["prefill"] = prefill_results(prefill_tokens, max(3, repeats // 4), rate, recipe)
    results["seconds"] = time.perf_counter() - t0
    return results


def print_report(r: dict[str, Any]) -> None:
    """The results as a plain-text table on stdout."""
    d = r["decode"]
    gb = 1e9
    print(f"device: {r['device']}")
    print(f"HBM copy bandwidth (read+write): {r['hbm_copy_bytes_per_s'] / gb:.0f} GB/s; "
          f"matmul roof: {r['matmul_flop_per_s'] / 1e12:.0f} TFLOP/s ({r['matmul_how']})")
    print(f"decode step, recipe {d['recipe']}, {d['layers']} layers, {d['launches']} launches, "
          f"{d['bytes_per_step'] / gb:.2f} GB of weights read, peak pool {d['peak_pool_bytes'] / gb:.1f} GB")
    for mode in ("eager", "graph"):
        sec = d[f"{mode}_s"]
        print(f"  {mode:5s}: {sec * 1e3:8.3f} ms  {d['bytes_per_step'] / sec / gb:7.0f} GB/s  "
              f"{100 * d[f'{mode}_fraction']:5.1f}% of copy bandwidth")
    print(f"  graph replay == eager: {d['graph_matches_eager']}; "
          f"projected {d['tokens_per_s_graph_at_43_layers']:.1f} t/s for 43 layers (weight streaming only)")
    pf = r["prefill"]
    print(f"prefill matmuls, recipe {pf['recipe']} (16-bit dequantized tiles + cuBLAS tensor cores, fp32 accumulate;"
          " peak = CuPy pool after one call):")
    for p in pf["matmuls"]:
        shape = "x".join(str(v) for v in p["shape"])
        print(f"  T={p['tokens']:5d} {p['name']:20s} {p['qtype']:17s} {shape:>14s} x{p['calls_per_model']:<4d}"
              f"{p['seconds'] * 1e3:9.3f} ms {p['flop_per_s'] / 1e12:7.1f} TFLOP/s {100 * p['fraction_of_bf16']:5.1f}%"
              f"  peak {p['peak_bytes'] / gb:5.2f} GB (+{p['scratch_bytes'] / gb:.2f})")
    for p in pf["projection"]:
        print(f"  T={p['tokens']:5d}: {p['layers']} layers' matmuls {p['seconds'] * 1e3:.1f} ms -> projected prefill "
              f"{p['tokens_per_s']:.0f} t/s, {100 * p['fraction_of_matmul_roof']:.1f}% of the matmul roof, peak "
              f"{p['peak_bytes'] / gb:.2f} GB (attention, norms, HC glue and output head excluded)")
    print(f"total {r['seconds']:.1f} s")
