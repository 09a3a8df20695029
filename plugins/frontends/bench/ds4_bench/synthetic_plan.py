"""A decode step described as a *weight plan* (every matrix one batch-1 token reads, in launch order), built in
GPU memory from random valid GGUF blocks (:mod:`.synthetic`), timed eagerly and as one CUDA graph against the
copy bandwidth measured in the same run.

The GLM 5.3 Flash and Qwen3.8 Flash Next models of ``ds4 bench --synthetic`` are plans. A plan is plain data, so
its byte counts (read per step, resident in memory) are known without a GPU, which also sizes how many layers fit.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import attrs
import numpy as np

from ds4_core.quants import block_geometry, tensor_nbytes

from .synthetic import Step, _Builder, _time, bf16_matmul_rate, copy_bandwidth

#: Device bytes kept free when the number of layers is chosen from free memory (activations, CuPy, cuBLAS).
MEMORY_MARGIN = 4_000_000_000


@attrs.frozen
class Matrix:
    """``y = W x`` in one GEMV launch; ``groups > 1``: block-diagonal (``groups`` blocks, one ``x`` per block).

    ``rows``, ``cols``: one block ``[out, in]`` in numpy order; ``name``: the GGUF tensor it stands for.
    """

    name: str
    qtype: str
    rows: int
    cols: int
    groups: int = 1

    @property
    def read_bytes(self) -> int:
        return tensor_nbytes(self.qtype, (self.groups * self.rows, self.cols))

    @property
    def resident_bytes(self) -> int:
        return self.read_bytes


@attrs.frozen
class RoutedExperts:
    """``k`` of ``experts`` SwiGLU experts with ids on the device: gate/up ``[inter, hidden]`` (one format, one
    fused launch), then down ``[hidden, down_cols]`` (one launch).

    ``down_cols`` is ``inter`` rounded up to whole blocks of the down format: a 640-wide Q2_K down projection is
    stored zero-padded to 768 columns, as in the published Qwen3.8 Q2 file.
    """

    name: str
    gate_up: str
    down: str
    experts: int
    k: int
    hidden: int
    inter: int

    @property
    def down_cols(self) -> int:
        qk = block_geometry(self.down)[0]
        return -(-self.inter // qk) * qk

    @property
    def expert_bytes(self) -> int:
        return (2 * tensor_nbytes(self.gate_up, (self.inter, self.hidden))
                + tensor_nbytes(self.down, (self.hidden, self.down_cols)))

    @property
    def read_bytes(self) -> int:
        return self.k * self.expert_bytes

    @property
    def resident_bytes(self) -> int:
        return self.experts * self.expert_bytes


Plan = list[Matrix | RoutedExperts]


@attrs.frozen
class SyntheticModel:
    """A model ``ds4 bench --synthetic`` can build: ``plan(recipe, layers)`` gives its first ``layers`` decoder
    layers plus the head at full shapes; ``recipes`` maps each recipe name to a one-line description."""

    title: str
    layers: int
    recipes: dict[str, str]
    plan: Callable[[str, int], Plan]


def read_bytes(plan: Plan) -> int:
    """Weight bytes one decode step of ``plan`` reads."""
    return sum(item.read_bytes for item in plan)


def resident_bytes(plan: Plan) -> int:
    """Device bytes the weights of ``plan`` occupy (every routed expert, not only the ``k`` read)."""
    return sum(item.resident_bytes for item in plan)


def fitting_layers(model: SyntheticModel, recipe: str, free_bytes: int) -> int:
    """The most layers (≥ 1, ≤ ``model.layers``) whose weights fit in ``free_bytes`` less :data:`MEMORY_MARGIN`."""
    budget = free_bytes - MEMORY_MARGIN
    return next((n for n in range(model.layers, 0, -1) if resident_bytes(model.plan(recipe, n)) <= budget), 1)


def build_step(plan: Plan, seed: int = 0) -> Step:
    """The launches of ``plan`` over preallocated device buffers (the backend's own GEMV and routed-expert kernels).

    Each matrix reads its own random activation. Routed gate/up reads one random token; down reads the SwiGLU
    output, or, when its rows are padded, a separate activation of the padded width whose padding is zero
    (copying the SwiGLU output into it is glue, which the step leaves out like the rest of the elementwise work).
    """
    import cupy as cp

    rng = np.random.default_rng(seed)
    b = _Builder(rng)
    for item in plan:
        if isinstance(item, Matrix):
            b.gemv(item.qtype, item.rows, item.cols, item.groups)
            continue
        idx = cp.asarray(rng.choice(item.experts, item.k, replace=False).astype(np.int32))
        x = cp.asarray(rng.standard_normal((1, item.hidden), dtype=np.float32))
        h = b.gate_up(item.gate_up, item.experts, item.inter, item.hidden, idx, x)
        if item.down_cols > item.inter:
            h = cp.zeros((item.k, item.down_cols), dtype=cp.float32)
            h[:, :item.inter] = cp.asarray(rng.standard_normal((item.k, item.inter), dtype=np.float32))
        b.experts(item.down, item.experts, item.hidden, item.down_cols, idx, h)
    return Step(b.launches, b.outputs)


def decode_results(model: SyntheticModel, recipe: str, layers: int, repeats: int,
                   bandwidth: float) -> dict[str, Any]:
    """Eager and CUDA-graph timings of ``layers`` layers (+ head) of ``model``, with the roofline fraction.

    Outputs are poisoned with NaN before the graph is captured, so ``graph_matches_eager`` proves the replay wrote
    them. ``projected_tokens_per_s`` scales the graph time to the full model by weight bytes (the layers of a
    hybrid model differ, so a per-layer time would mislead).
    """
    import cupy as cp

    plan = model.plan(recipe, layers)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        step = build_step(plan)
        eager = _time(step.run, repeats)
        eager_out = [cp.asnumpy(o) for o in step.outputs]
        for o in step.outputs:
            o.fill(np.nan)
        stream.begin_capture()
        step.run()
        graph = stream.end_capture()
        graph.upload(stream)
        replay = _time(lambda: graph.launch(stream), repeats)
        same = all(np.array_equal(a, cp.asnumpy(o)) for a, o in zip(eager_out, step.outputs, strict=True))
    free, total = cp.cuda.runtime.memGetInfo()
    nbytes = step.nbytes
    full_bytes = read_bytes(model.plan(recipe, model.layers))
    return {"model": model.title, "recipe": recipe, "recipe_formats": model.recipes[recipe], "layers": layers,
            "full_layers": model.layers, "launches": len(step.launches), "bytes_per_step": nbytes,
            "full_model_bytes_per_step": full_bytes, "eager_s": eager, "graph_s": replay,
            "graph_matches_eager": same, "eager_fraction": nbytes / eager / bandwidth,
            "graph_fraction": nbytes / replay / bandwidth, "projected_tokens_per_s": nbytes / (replay * full_bytes),
            "peak_pool_bytes": cp.get_default_memory_pool().total_bytes(), "device_used_bytes": total - free}


def run_model(model: SyntheticModel, recipe: str = "q2", layers: int | None = None,
              repeats: int = 20) -> dict[str, Any]:
    """Every measurement of ``ds4 bench --synthetic`` for ``model``, as a JSON-able dict.

    ``layers``: decoder layers to build (default: all that fit in free device memory; capped at the model's).
    """
    import cupy as cp

    device = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(device.id)
    t0 = time.perf_counter()
    bandwidth = copy_bandwidth()
    rate, how = bf16_matmul_rate()
    cp.get_default_memory_pool().free_all_blocks()
    if layers is None:
        layers = fitting_layers(model, recipe, cp.cuda.runtime.memGetInfo()[0])
    layers = min(layers, model.layers)
    results = {"device": props["name"].decode(), "hbm_copy_bytes_per_s": bandwidth, "matmul_flop_per_s": rate,
               "matmul_how": how}
    results["decode"] = decode_results(model, recipe, layers, repeats, bandwidth)
    results["seconds"] = time.perf_counter() - t0
    return results


def print_report(r: dict[str, Any]) -> None:
    """The results of :func:`run_model` as a plain-text table on stdout (the layout of the DeepSeek report)."""
    d = r["decode"]
    gb = 1e9
    print(f"device: {r['device']}")
    print(f"HBM copy bandwidth (read+write): {r['hbm_copy_bytes_per_s'] / gb:.0f} GB/s; "
          f"matmul roof: {r['matmul_flop_per_s'] / 1e12:.0f} TFLOP/s ({r['matmul_how']})")
    print(f"{d['model']} decode step, recipe {d['recipe']} ({d['recipe_formats']}), {d['layers']} of "
          f"{d['full_layers']} layers, {d['launches']} launches, {d['bytes_per_step'] / gb:.2f} GB of weights read "
          f"(full model {d['full_model_bytes_per_step'] / gb:.2f} GB), peak pool {d['peak_pool_bytes'] / gb:.1f} GB, "
          f"device memory in use {d['device_used_bytes'] / gb:.1f} GB")
    for mode in ("eager", "graph"):
        sec = d[f"{mode}_s"]
        print(f"  {mode:5s}: {sec * 1e3:8.3f} ms  {d['bytes_per_step'] / sec / gb:7.0f} GB/s  "
              f"{100 * d[f'{mode}_fraction']:5.1f}% of copy bandwidth")
    print(f"  graph replay == eager: {d['graph_matches_eager']}; projected {d['projected_tokens_per_s']:.1f} t/s "
          f"for {d['full_layers']} layers (weight streaming only)")
    print("prefill: this model's matmul shapes are not benchmarked yet (deepseek4-flash reports the prefill kernels)")
    print(f"total {r['seconds']:.1f} s")
