"""``ds4 bench --synthetic deepseek4-flash``, whole model: the DeepSeek V4 plugin's own graph (every kernel and glue
launch of its chunked prefill and of its recorded decode step) over a full-shape synthetic Flash, built without a
file, timed against the ceilings measured in the same run.

The weight-kernel measurement (:mod:`.synthetic_run`) times what a step must stream; this one times what the engine
does, so the two bracket the glue's cost. Tensors are :func:`.flash_gguf.tensor_plan`'s with the bytes
:func:`.flash_gguf.tensor_bytes` gives the file writer, so the model built here is the one ``--write-gguf`` writes.
Fractions share the weight-kernel table's numerators: the bytes a decode token must read (selected experts only,
plus the state of its context) and the weight matmuls' FLOPs of a prefill (attention's own left out).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
from ds4_model_deepseek4.config import DeepSeekV4Config

from ds4_core.backend import Backend, Ops, Weight, WeightLoader
from ds4_core.errors import ModelConfigError
from ds4_core.quants import dequantize

from .flash_gguf import PlannedTensor, ProgressBar, flash_config, tensor_bytes, tensor_plan
from .synthetic_deepseek4 import MODEL, decode_plan
from .synthetic_plan import prefill_plan, read_bytes

_INTEGER_DTYPES = {"I32": np.int32, "I16": np.int16, "I8": np.int8, "I64": np.int64}


class PlanWeights(WeightLoader):
    """A :class:`ds4_core.backend.WeightLoader` over a synthetic Flash's tensor plan instead of a file: each tensor a
    model asks for is made on the host from its pattern and uploaded to ``backend``; names, shapes and types are
    checked against the plan as a file's would be."""

    def __init__(self, cfg: DeepSeekV4Config, recipe: str, backend: Backend, seed: int = 0,
                 progress: Callable[[int], None] | None = None):
        super().__init__(None, backend, progress)
        self.cfg, self.seed = cfg, seed
        self.tensors = {t.name: t for t in tensor_plan(cfg, recipe)}

    def has(self, name: str) -> bool:
        return name in self.tensors

    def names(self) -> Iterable[str]:
        return self.tensors.keys()

    def _planned(self, name: str, shape: tuple[int, ...] | None, types: Iterable[str] | None) -> PlannedTensor:
        t = self.tensors.get(name)
        if t is None:
            raise ModelConfigError(f"the synthetic Flash has no tensor {name!r}")
        if shape is not None and tuple(shape) != t.shape:
            raise ModelConfigError(f"tensor {name}: shape {t.shape} in the synthetic Flash, {tuple(shape)} asked")
        if types is not None and t.qtype.name not in set(types):
            raise ModelConfigError(f"tensor {name}: {t.qtype.name} in the synthetic Flash, one of {sorted(types)} "
                                   "asked")
        return t

    def get(self, name: str, shape: tuple[int, ...] | None = None, types: Iterable[str] | None = None) -> Weight:
        t = self._planned(name, shape, types)
        weight = self.backend.upload(name, t.qtype.name, t.shape, tensor_bytes(t, self.cfg, self.seed))
        self._progress(t.nbytes)
        return weight

    def array(self, name: str, dtype: Any = np.float32, shape: tuple[int, ...] | None = None) -> np.ndarray:
        t = self._planned(name, shape, None)
        raw = tensor_bytes(t, self.cfg, self.seed)
        integer = _INTEGER_DTYPES.get(t.qtype.name)
        values = raw.view(integer).reshape(t.shape) if integer else dequantize(raw, t.qtype, t.shape)
        self._progress(t.nbytes)
        return values.astype(dtype)


def build_flash(backend: Backend, ops: Ops, layers: int, recipe: str = "q2", seed: int = 0,
                shapes: dict[str, Any] | None = None, progress: Callable[[int], None] | None = None) -> Any:
    """The DeepSeek V4 model of :func:`.flash_gguf.flash_config` ``(layers, shapes)`` on ``ops``, its weights
    uploaded from :class:`PlanWeights` (no file)."""
    from ds4_model_deepseek4.model import DeepSeekV4Model

    cfg = flash_config(layers, shapes)
    model = DeepSeekV4Model(PlanWeights(cfg, recipe, backend, seed, progress), ops, cfg)
    backend.synchronize()
    return model


def prefill(model: Any, state: Any, ids: np.ndarray, chunk: int) -> Any:
    """Feed ``ids`` into ``state`` in chunks of ``chunk``, as ``Session.feed`` does; the last row's logits."""
    rows = None
    for start in range(0, len(ids), chunk):
        rows = model.forward(ids[start:start + chunk], state, last_row=True)
    return rows


def backend_ops(name: str = "cuda") -> tuple[Backend, Ops]:
    """The installed backend ``name`` and its kernels, bound as ``Engine.load`` binds them."""
    from ds4_core.descriptors import resolve
    from ds4_core.engine import bound_ops
    from ds4_core.plugins import get_plugin_manager

    registry = get_plugin_manager().registry
    backend = resolve(registry.backend(name).factory)()
    return backend, bound_ops(registry, name, backend)


def _device_in_use(backend: Backend) -> int:
    """Bytes of device memory in use by every allocator and the context (``memory_info``'s total less free)."""
    info = backend.memory_info()
    return info["total"] - info["free"]


def _timed(fn: Callable[[], Any], backend: Backend) -> float:
    backend.synchronize()
    start = time.perf_counter()
    fn()
    backend.synchronize()
    return time.perf_counter() - start


def _replays(model: Any, token: int, position: int, state: Any, repeats: int) -> float:
    """Seconds of GPU time per replayed decode step at ``position``, by CUDA events around ``repeats`` replays that
    the host queues back to back (each writes the token and position, then launches the graph). The step writes the
    same row at the same position each time, so the context stays as it was."""
    import cupy

    model.decode_graphs(token, position, state)  # warm: replays once recorded
    start, end = cupy.cuda.Event(), cupy.cuda.Event()
    start.record()
    for _ in range(repeats):
        model.decode_graphs(token, position, state)
    end.record()
    end.synchronize()
    return cupy.cuda.get_elapsed_time(start, end) / 1e3 / repeats


def engine_results(recipe: str, layers: int, contexts: Sequence[int], prefill_tokens: Sequence[int], repeats: int,
                   bandwidth: float, matmul_rate: float, seed: int = 0) -> dict[str, Any]:
    """Decode (graph replay and eager) at each of ``contexts`` and prefill at each of ``prefill_tokens``, through
    the model's own graph on ``layers`` layers of a synthetic Flash in device memory, with the roofline fractions
    and the device memory in use after each."""
    import cupy

    t0 = time.perf_counter()
    pool = cupy.get_default_memory_pool()
    pool.free_all_blocks()  # what the weight-kernel measurement left cached
    backend, ops = backend_ops()
    before = pool.used_bytes()
    total = sum(t.nbytes for t in tensor_plan(flash_config(layers), recipe))
    with ProgressBar(True, total, f"a {layers}-layer synthetic Flash in device memory", "building") as bar:
        model = build_flash(backend, ops, layers, recipe, seed, progress=bar.advance)
    weights = pool.used_bytes() - before  # the weights' own bytes (the pool's, without its rounding to pages)
    chunk, rng = backend.prefill_chunk, np.random.default_rng(seed)

    def tokens(n: int) -> np.ndarray:
        return rng.integers(0, model.vocab_size, n).astype(np.int32)

    warm = model.new_state(chunk + 1)  # compile and load every kernel of a prefill chunk and a step first
    prefill(model, warm, tokens(chunk), chunk)
    model.decode_step(backend.asarray(tokens(1)), backend.asarray(np.array([chunk], np.int32)), warm)
    del warm
    dense, routed = prefill_plan(MODEL.plan(recipe, layers))
    prefills = []
    for n in prefill_tokens:
        ids, runs = tokens(n), []
        for _ in range(min(3, repeats)):  # a prefill of 43 layers is seconds long
            runs.append(_timed(functools.partial(prefill, model, model.new_state(n + 1), ids, chunk), backend))
        seconds = float(np.median(runs))
        flops = sum(m.flops(n) * m.calls for m in dense) + sum(r.flops(n) * r.calls for r in routed)
        prefills.append({"tokens": n, "seconds": seconds, "runs": runs, "tokens_per_s": n / seconds,
                         "fraction_of_matmul_roof": flops / seconds / matmul_rate,
                         "device_used_bytes": _device_in_use(backend)})
        pool.free_all_blocks()
    decodes = []
    for context in contexts:
        state = model.new_state(context + 1)
        prefill(model, state, tokens(context), chunk)
        token = int(tokens(1)[0])
        graph = _replays(model, token, context, state, 5 * repeats)
        replayed = backend.to_numpy(model.decode_graphs(token, context, state)[0])
        ids, pos = backend.asarray(np.array([token], np.int32)), backend.asarray(np.array([context], np.int32))
        visible = model.all_visible(context)
        step = functools.partial(model.decode_step, ids, pos, state, visible)  # the replay's form
        eager = _timed(step, backend)
        direct = backend.to_numpy(step()[0])
        nbytes = read_bytes(decode_plan(recipe, layers, context=context)) + read_bytes(MODEL.state(layers, context))
        decodes.append({"context": context, "all_visible": visible, "bytes_per_step": nbytes,
                        "graph_s": graph, "eager_s": eager,
                        "graph_fraction": nbytes / graph / bandwidth, "tokens_per_s": 1 / graph,
                        "replay_vs_eager": float(np.abs(replayed - direct).max() / np.abs(direct).max()),
                        "device_used_bytes": _device_in_use(backend)})
    return {"layers": layers, "full_layers": MODEL.layers, "weights_device_bytes": weights,
            "weights_plan_bytes": total,
            "prefill_chunk": chunk, "prefill": prefills, "decode": decodes, "seconds": time.perf_counter() - t0}


def print_engine(e: dict[str, Any]) -> None:
    """:func:`engine_results` as plain text."""
    gb = 1e9
    print(f"whole model through the DeepSeek V4 plugin's graph (every kernel and glue launch), {e['layers']} of "
          f"{e['full_layers']} layers, weights {e['weights_device_bytes'] / gb:.2f} GB on the device for "
          f"{e['weights_plan_bytes'] / gb:.2f} GB of tensors ({e['seconds']:.1f} s):")
    for d in e["decode"]:
        print(f"  decode at context {d['context']:6d}: graph replay {d['graph_s'] * 1e3:7.3f} ms a step "
              f"({d['tokens_per_s']:.1f} t/s of GPU time), {100 * d['graph_fraction']:.1f}% of copy bandwidth for "
              f"{d['bytes_per_step'] / gb:.3f} GB; eager {d['eager_s'] * 1e3:.1f} ms; replay vs eager logits "
              f"{d['replay_vs_eager']:.1e} of the largest; device memory in use {d['device_used_bytes'] / gb:.1f} GB"
              + ("; every complete CSA row visible, so no index queries or scores" if d["all_visible"] else ""))
    for p in e["prefill"]:
        print(f"  prefill {p['tokens']:6d} tokens in chunks of {e['prefill_chunk']}: {p['seconds'] * 1e3:8.1f} ms "
              f"(median of {len(p['runs'])}: {min(p['runs']) * 1e3:.1f}-{max(p['runs']) * 1e3:.1f} ms), "
              f"{p['tokens_per_s']:.0f} t/s, {100 * p['fraction_of_matmul_roof']:.1f}% "
              f"of the matmul roof by its weight matmuls; device memory in use {p['device_used_bytes'] / gb:.1f} GB")
