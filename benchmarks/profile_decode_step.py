"""Kernel by kernel: where a graph-replayed decode step of a GGUF spends its GPU time, and how much the host adds.

Loads FILE on the CUDA backend, feeds a random prompt of PROMPT tokens, decodes a few tokens (recording the step as
a CUDA graph), then traces STEPS more with the PyTorch profiler (CUPTI sees CuPy's kernels too). Prints kernels per
step, GPU busy time per step, and the kernels grouped by name (time per step, launches per step, mean time), largest
first; then the wall time of a whole ``Session.feed`` + host argmax per token, untraced. What exceeds the GPU's busy
time is the host's share (the Python feed, the logits copy, the argmax) plus the gaps between kernels.

Usage: python benchmarks/profile_decode_step.py FILE [--prompt-tokens 2048] [--steps 5] [--top 30]
(needs a GPU with the CUDA backend, the file's model plugin, and torch for the trace.)
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

import numpy as np


def _trace(session, tokens: list[int]) -> list[tuple[str, float]]:
    """(kernel name, µs) of every GPU kernel and copy the feeds of ``tokens`` ran, in order."""
    import cupy
    import torch
    from torch.profiler import ProfilerActivity, profile

    cupy.cuda.Device().synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for token in tokens:
            session.feed([token])
        cupy.cuda.Device().synchronize()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return [(e.name, e.time_range.end - e.time_range.start) for e in sorted(events, key=lambda e: e.time_range.start)]


def _per_token_ms(fn, n: int) -> float:
    import cupy

    cupy.cuda.Device().synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    cupy.cuda.Device().synchronize()
    return (time.perf_counter() - start) / n * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=5, help="decode steps traced")
    parser.add_argument("--top", type=int, default=30, help="kernel names listed")
    args = parser.parse_args()

    from ds4_core.engine import Engine

    engine = Engine.load(args.file, backend="cuda", ctx=args.prompt_tokens + 4 * args.steps + 80)
    try:
        rng = np.random.default_rng(0)
        session = engine.new_session()
        session.feed(rng.integers(0, engine.tokenizer.vocab_size, args.prompt_tokens))
        graphs = engine.model.decode_graphs
        for _ in range(3):  # records the step, then warms the replay
            session.feed([int(np.argmax(session.last_logits))])
        replays = graphs is not None and graphs.replays(session.state)
        kernels = _trace(session, rng.integers(0, engine.tokenizer.vocab_size, args.steps).tolist())
        by_name: dict[str, list[float]] = defaultdict(list)
        for name, us in kernels:
            by_name[name].append(us)
        busy = sum(us for _, us in kernels) / args.steps
        print(f"{args.file.name}: decode at {args.prompt_tokens} tokens, graph replay: {replays}; "
              f"{len(kernels) / args.steps:.0f} kernels per step, GPU busy {busy / 1e3:.3f} ms per step")
        print(f"{'us/step':>9} {'per step':>8} {'mean us':>8}  kernel")
        for name, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:args.top]:
            print(f"{sum(times) / args.steps:9.1f} {len(times) / args.steps:8.1f} {np.mean(times):8.2f}  {name[:100]}")
        feed = _per_token_ms(lambda: session.feed([int(np.argmax(session.last_logits))]), 30)
        print(f"Session.feed + argmax: {feed:.3f} ms per token (untraced); beyond the GPU's busy time: "
              f"{feed - busy / 1e3:.3f} ms (host work and gaps between kernels)")
    finally:
        engine.close()


if __name__ == "__main__":
    main()
