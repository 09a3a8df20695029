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
kernels' durations then include their wait: set DS4_CUDA_PDL=0 for each kernel's own time). With ``--sources`` the
trace also records Python calls, and each of the largest kernels is broken down by the project's lines that
launched it (the host's times are then the tracer's, not the engine's).

Usage: python benchmarks/profile_step.py FILE [--prompt-tokens 2048] [--steps 5] [--top 30] [--prefill] [--timeline]
       [--sources]
(needs a GPU with the CUDA backend, the file's model plugin, and torch for the trace.)
"""

from __future__ import annotations

import argparse
import bisect
import json
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np


def _trace(feeds, sources: bool = False) -> list[tuple[str, float, float, str]]:
    """(kernel name, µs, start µs, launching lines) of every GPU kernel and copy that running the callables
    ``feeds`` launched, in order of their start; the lines (see :func:`_launch_sites`) only with ``sources``."""
    import cupy
    from torch.profiler import ProfilerActivity, profile

    cupy.cuda.Device().synchronize()
    activities = [ProfilerActivity.CUDA, *([ProfilerActivity.CPU] if sources else [])]
    with profile(activities=activities, with_stack=sources) as prof:
        for feed in feeds:
            feed()
        cupy.cuda.Device().synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text())["traceEvents"]
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    sites = _launch_sites(events) if sources else {}
    return [(e["name"], float(e["dur"]), float(e["ts"]), sites.get(e.get("args", {}).get("correlation"), ""))
            for e in sorted(gpu, key=lambda e: e["ts"])]


def _launch_sites(events: list[dict]) -> dict[int, str]:
    """Correlation id -> the innermost two functions of the project's packages (``ds4_*``, past the launch helper)
    under whose Python calls the runtime or driver call with that id ran."""
    calls = sorted(((e["ts"], e["ts"] + e["dur"], e["tid"], e["name"]) for e in events
                    if e.get("cat") == "python_function" and "ds4_" in e["name"] and "launch.py" not in e["name"]),
                   key=lambda c: (c[0], -c[1]))
    starts = [c[0] for c in calls]
    sites = {}
    for e in events:
        if e.get("cat") not in ("cuda_runtime", "cuda_driver") or "correlation" not in e.get("args", {}):
            continue
        ts = e["ts"]
        i = bisect.bisect_right(starts, ts)
        inner = [c for c in calls[max(0, i - 400):i] if c[1] >= ts and c[2] == e["tid"]]  # nested: latest inside
        names = ["/".join(c[3].split("/")[-2:]) for c in inner[-2:]]
        sites[e["args"]["correlation"]] = " < ".join(reversed(names))
    return sites


def _per_token_ms(fn, n: int) -> float:
    import cupy

    cupy.cuda.Device().synchronize()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    cupy.cuda.Device().synchronize()
    return (time.perf_counter() - start) / n * 1e3


def _table(kernels: list[tuple[str, float, float, str]], steps: int, top: int, title: str) -> float:
    """Print the kernels grouped by name, largest first (each by its launching lines where the trace has them);
    return the GPU busy µs per step."""
    by_name: dict[str, list[float]] = defaultdict(list)
    by_site: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for name, us, _, site in kernels:
        by_name[name].append(us)
        by_site[name][site].append(us)
    busy = sum(k[1] for k in kernels) / steps
    print(f"{title}; {len(kernels) / steps:.0f} kernels per step, GPU busy {busy / 1e3:.3f} ms per step")
    print(f"{'us/step':>9} {'per step':>8} {'mean us':>8}  kernel")
    for name, times in sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:top]:
        print(f"{sum(times) / steps:9.1f} {len(times) / steps:8.1f} {np.mean(times):8.2f}  {name[:100]}")
        for site, st in sorted(by_site[name].items(), key=lambda kv: -sum(kv[1])):
            if site:
                print(f"{sum(st) / steps:17.1f} {len(st) / steps:6.1f}x {np.mean(st):8.2f}    {site[:110]}")
    return busy


def _timeline(kernels: list[tuple[str, float, float, str]]) -> None:
    """Print ``kernels`` (one step's) in order: start since the first, duration, gap since the latest end so far."""
    t0, end = kernels[0][2], kernels[0][2]
    print(f"{'start us':>9} {'us':>7} {'gap us':>7}  kernel")
    for name, us, start, _ in kernels:
        print(f"{start - t0:9.1f} {us:7.2f} {start - end:7.2f}  {name[:90]}")
        end = max(end, start + us)


def _report_prefill(engine, prompt: np.ndarray, top: int, sources: bool) -> None:
    """Trace one prefill of ``prompt`` in a fresh session, then time another untraced."""
    kernels = _trace([lambda: engine.new_session().feed(prompt, logits="last")], sources)
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
    parser.add_argument("--sources", action="store_true",
                        help="break each kernel's time down by the project's lines that launched it")
    args = parser.parse_args()

    from ds4_core.engine import Engine

    engine = Engine.load(args.file, backend="cuda", ctx=args.prompt_tokens + 4 * args.steps + 80)
    try:
        rng = np.random.default_rng(0)
        prompt = rng.integers(0, engine.tokenizer.vocab_size, args.prompt_tokens)
        session = engine.new_session()
        session.feed(prompt, logits="last")
        if args.prefill:
            _report_prefill(engine, prompt, args.top, args.sources)
            return
        graphs = engine.model.decode_graphs
        for _ in range(3):  # records the step, then warms the replay
            session.feed([int(np.argmax(session.last_logits))])
        if graphs is not None:  # a step form needed later on (decode_replay.py) is recorded here, untraced
            graphs(0, session.state.n_tokens + args.steps + 30, session.state)
        replays = graphs is not None and graphs.replays(session.state)
        tokens = rng.integers(0, engine.tokenizer.vocab_size, args.steps).tolist()
        kernels = _trace([lambda t=t: session.feed([t]) for t in tokens], args.sources)
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
