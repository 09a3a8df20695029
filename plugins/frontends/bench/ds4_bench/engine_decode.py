"""End-to-end speed of a model file through ``Engine``: prefill, then greedy decode with and without graph replay.

Unlike the synthetic benchmark this runs the whole model graph, glue included, exactly as ``ds4 run`` does: one
``Session.feed`` per decoded token and a greedy ``Session.sample`` (on the device where the backend samples: the
token id comes back, not the row). Tokens are random ids of the model's
vocabulary (speed does not depend on their values, except through routing).
"""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

import numpy as np

from ds4_core.sampling import SamplingParams


def _decode(session: Any, first: int, tokens: int) -> float:
    """Seconds for ``tokens`` greedy steps after feeding ``first`` (untimed: it may record the graph)."""
    greedy = session.engine.sampler(SamplingParams(temperature=0))
    session.feed([first], logits="none")
    start = time.perf_counter()
    for _ in range(tokens):
        session.feed([session.sample(greedy)], logits="none")
    return time.perf_counter() - start


def _memory(engine: Any) -> dict[str, int]:
    """The backend's memory figures (``Backend.memory_info``) after a collection, so dead arrays do not count."""
    gc.collect()
    return engine.backend.memory_info()


def measure(path: Path, backend: str = "cuda", prompt_tokens: int = 512, decode_tokens: int = 64,
            seed: int = 0, prefill_runs: int = 5) -> dict[str, Any]:
    """Prefill t/s of ``prompt_tokens`` (the median of ``prefill_runs`` timed prefills, each in a new session) and
    decode t/s over ``decode_tokens`` steps, graphs on and off. The memory figures are the process's allocators', so
    the weights' are true in a process of its own, as ``ds4 bench -m`` runs."""
    from ds4_core.engine import Engine

    ctx = prompt_tokens + decode_tokens + 2
    engine = Engine.load(path, backend=backend, ctx=ctx)
    try:
        loaded = _memory(engine)  # in a new process, the weights and the model's constants
        ids = np.random.default_rng(seed).integers(0, engine.tokenizer.vocab_size, prompt_tokens + 1)
        warm = engine.new_session()  # compile and load the kernels of both paths (a whole prefill chunk) first
        warm.feed(ids[:min(warm.prefill_chunk, prompt_tokens)], logits="last")
        warm.feed(ids[:1])
        runs = []
        for _ in range(prefill_runs):  # one run moves by several percent; the median of a few does not
            session = engine.new_session()
            start = time.perf_counter()
            session.feed(ids[:prompt_tokens], logits="last")
            runs.append(time.perf_counter() - start)
        prefill = float(np.median(runs))
        snap = session.snapshot()
        graphs = getattr(engine.model, "decode_graphs", None)
        result = {"model": path.name, "backend": engine.backend.name, "prompt_tokens": prompt_tokens,
                  "decode_tokens": decode_tokens, "prefill_tokens_per_s": prompt_tokens / prefill,
                  "prefill_seconds": runs,
                  "file_tensor_bytes": sum(t.nbytes for t in engine.gguf.tensors.values()),
                  "memory_after_load": loaded, "memory_after_prefill": _memory(engine),
                  "context": ctx, "state_bytes": engine.model.state_nbytes(ctx), "numerics": engine.backend.numerics(),
                  "state_bytes_per_1k_tokens": engine.model.state_nbytes(ctx + 1024) - engine.model.state_nbytes(ctx)}
        if graphs is not None:
            result["graph_decode_tokens_per_s"] = decode_tokens / _decode(session, int(ids[-1]), decode_tokens)
            result["graph_replayed"] = graphs.replays(session.state)
            result["memory_after_graph_decode"] = _memory(engine)
            session.restore(snap)
            engine.model.decode_graphs = None
        result["eager_decode_tokens_per_s"] = decode_tokens / _decode(session, int(ids[-1]), decode_tokens)
        engine.model.decode_graphs = graphs
        return result
    finally:
        engine.close()


def print_numerics(numerics: dict[str, str]) -> None:
    """One line naming the arithmetic a backend chose where it differs from the reference (nothing if it does not)."""
    if numerics:
        print("  arithmetic: " + "; ".join(f"{step} {setting}" for step, setting in numerics.items()))


def print_measurement(r: dict[str, Any]) -> None:
    runs = r["prefill_seconds"]
    print(f"{r['model']} on {r['backend']}: prefill {r['prompt_tokens']} tokens at {r['prefill_tokens_per_s']:.1f} t/s "
          f"(median of {len(runs)}: {min(runs) * 1e3:.2f}-{max(runs) * 1e3:.2f} ms a prefill)")
    print_numerics(r.get("numerics", {}))
    weights = r["memory_after_load"].get("used")
    if weights is not None:
        host = r["memory_after_load"].get("host", 0)
        where = f"on the device {weights / 1e9:.3f} GB" + (f" and in host memory {host / 1e9:.3f} GB" if host else "")
        print(f"  weights {where} for {r['file_tensor_bytes'] / 1e9:.3f} GB of tensors in the file "
              f"({(weights + host) / r['file_tensor_bytes']:.3f}x)")
    line = f"  decode {r['decode_tokens']} tokens after them: eager {r['eager_decode_tokens_per_s']:.1f} t/s"
    if "graph_decode_tokens_per_s" in r:
        line += (f", graph replay {r['graph_decode_tokens_per_s']:.1f} t/s "
                 f"({r['graph_decode_tokens_per_s'] / r['eager_decode_tokens_per_s']:.2f}x; "
                 f"replayed: {r['graph_replayed']})")
    else:
        line += " (this model's decode step is not recorded as a graph)"
    print(line)
    print(f"  decoding state: {r['state_bytes'] / 2**20:.2f} MiB for the {r['context']}-token context, "
          f"+{r['state_bytes_per_1k_tokens'] / 2**20:.2f} MiB per 1K tokens")
    memory_line = _memory_line(r["memory_after_prefill"], r.get("memory_after_graph_decode"))
    if memory_line:
        print(memory_line)


def _memory_line(prefill: dict[str, int], decode: dict[str, int] | None) -> str:
    """What the device holds after the prefill (and the graph decode), as far as the backend knows: all allocators
    and the context (CUDA), or the backend's own arrays and their peak (MLX); empty where it knows nothing."""
    def gb(n: int) -> str:
        return f"{n / 1e9:.3f} GB"

    if "free" in prefill and "total" in prefill:
        line = f"  device memory in use (all allocators and the context): {gb(prefill['total'] - prefill['free'])} "
        return line + "after the prefill" + (f", {gb(decode['total'] - decode['free'])} after the graph decode"
                                            if decode else "")
    if "used" in prefill:
        peak = f" (peak so far {gb(prefill['peak'])})" if "peak" in prefill else ""
        return f"  memory the backend holds: {gb(prefill['used'])} after the prefill{peak}"
    return ""
