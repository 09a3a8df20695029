"""Kernel by kernel: where a decode step (or a prefill) of a GGUF spends its GPU time, and how much the host adds.

Loads FILE on the CUDA backend, feeds a random prompt of PROMPT tokens, decodes a few tokens (recording the step as
a CUDA graph), then traces STEPS more with the PyTorch profiler (CUPTI sees CuPy's kernels too). Prints kernels per
step, GPU busy time per step, and the kernels grouped by name (time per step, launches per step, mean time), largest
first; then the wall time of a whole ``Session.feed`` + host argmax per token, untraced. What exceeds the GPU's busy
time is the host's share (the Python feed, the logits copy, the argmax) plus the gaps between kernels.

With ``--prefill`` it traces the prompt's prefill instead (in a second session, after a first one compiled and
warmed every kernel): the same table per prefill, then the untraced wall time of that prefill. With ``--timeline``
it also lists the last traced decode step's kernels in order: start, duration and the gap since the previous
kernel ended (what a launch edge costs; negative where kernels overlap, as with programmatic dependent launch, whose
kernels' durations then include their wait: set DS4_CUDA_PDL=0 for each kernel's own time).

Usage: python benchmarks/profile_step.py FILE [--prompt-tokens 2048] [--steps 5] [--top 30] [--prefill] [--timeline]
(needs a GPU with the CUDA backend, the file's model plugin, and torch for the trace.)
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

import numpy as np


def _trace(feeds) -> list[tuple[str, float, float]]:
    """(kernel name, µs, start µs) of every GPU kernel and copy that running the callables ``feeds`` launched, in
    order of their start."""
    import cupy
    import torch
    from torch.profiler import ProfilerActivity, profile

    cupy.cuda.Device().synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for feed in feeds:
            feed()
        cupy.cuda.Device().synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return [(e.name, e.time_range.end - e.time_range.start, e.time_range.start)
            for e in sorted(events, key=lambda e: e.time_range.start)]


def _per_token_ms(fn, n: int) -> float:
    import cupy

    cupy.cuda.Device().synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    cupy.cuda.Device().synchronize()
    return (time.perf_counter() - start) / n * 1e3


def _table(kernels: list[tuple[str, float, float]], steps: int, top: int, title: str) -> float:
    """Print the kernels grouped by name, largest first; return the GPU busy µs per step."""
    by_name: dict[str, list[float]] = defaultdict(list)
    for name, us, _ in kernels:
        by_name[name].append(us)
    busy = sum(us for _, us, _ in kernels) / steps
    print(f"{title}; {len(kernels) / steps:.0f} kernels per step, GPU busy {busy / 1e3:.3f} ms per step")
    print(f"{'us/step':>9} {'per step':>8} {'mean us':>8}  kernel")
    for name, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"{sum(times) / steps:9.1f} {len(times) / steps:8.1f} {np.mean(times):8.2f}  {name[:100]}")
    return busy


def _timeline(kernels: list[tuple[str, float, float]]) -> None:
    """Print ``kernels`` (one step's) in order: start since the first, duration, gap since the latest end so far."""
    t0, end = kernels[0][2], kernels[0][2]
    print(f"{'start us':>9} {'us':>7} {'gap us':>7}  kernel")
    for name, us, start in kernels:
        print(f"{start - t0:9.1f} {us:7.2f} {start - end:7.2f}  {name[:90]}")
        end = max(end, start + us)


def _report_prefill(engine, prompt: np.ndarray, top: int) -> None:
    """Trace one prefill of ``prompt`` in a fresh session, then time another untraced."""
    kernels = _trace([lambda: engine.new_session().feed(prompt, logits="last")])
    busy = _table(kernels, 1, top, f"prefill of {prompt.size} tokens")
    wall = _per_token_ms(lambda: engine.new_session().feed(prompt, logits="last"), 2)
    print(f"Session.feed of the prompt: {wall:.1f} ms (untraced); beyond the GPU's busy time: "
          f"{wall - busy / 1e3:.1f} ms (host work and gaps between kernels)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5, help="decode steps traced")
    parser.add_argument("--top", type=int, default=30, help="kernel names listed")
    parser.add_argument("--prefill", action="store_true", help="trace the prompt's prefill, not decode steps")
    parser.add_argument("--timeline", action="store_true", help="list the last traced decode step's kernels in order")
    args = parser.parse_args()

    from ds4_core.engine import Engine

    engine = Engine.load(args.file, backend="cuda", ctx=args.prompt_tokens + 4 * args.steps + 80)
    try:
        rng = np.random.default_rng(0)
        prompt = rng.integers(0, engine.tokenizer.vocab_size, args.prompt_tokens)
        session = engine.new_session()
        session.feed(prompt, logits="last")
        if args.prefill:
            _report_prefill(engine, prompt, args.top)
            return
        graphs = engine.model.decode_graphs
        for _ in range(3):  # records the step, then warms the replay
            session.feed([int(np.argmax(session.last_logits))])
        replays = graphs is not None and graphs.replays(session.state)
        tokens = rng.integers(0, engine.tokenizer.vocab_size, args.steps).tolist()
        kernels = _trace([lambda t=t: session.feed([t]) for t in tokens])
        busy = _table(kernels, args.steps, args.top,
                      f"{args.file.name}: decode at {args.prompt_tokens} tokens, graph replay: {replays}")
        feed = _per_token_ms(lambda: session.feed([int(np.argmax(session.last_logits))]), 30)
        print(f"Session.feed + argmax: {feed:.3f} ms per token (untraced); beyond the GPU's busy time: "
              f"{feed - busy / 1e3:.3f} ms (host work and gaps between kernels)")
        if args.timeline:
            _timeline(kernels[-(len(kernels) // args.steps):])
    finally:
        engine.close()


if __name__ == "__main__":
    main()
