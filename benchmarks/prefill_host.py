"""Whether a prefill waits on the host: the host's time to issue each layer of a DeepSeek V4 prefill, against the
prefill's wall time.

A chunked prefill is issued by Python, kernel by kernel (about 160 launches and cuBLAS calls a Flash layer at 2048
tokens), and runs on the GPU behind it. When the host takes longer to issue a layer than the GPU takes to run it, the
prefill runs at the host's pace, and a slower host (another machine, a busy one) slows it with no change on the GPU.
Loads FILE on the CUDA backend and warms two prefills of a random prompt; then, in each round, times a prefill on an
idle GPU (its wall time), and another issued while a spin kernel holds the GPU for ``--spin-ms``: with the GPU held,
the host runs ahead, so the stamps taken around each layer's method (``Block.layer`` of the DeepSeek V4 plugin) are
the host's own times. A layer that ends after the spin's length would mean the host waited for the GPU inside the
prefill (a synchronization), which a prefill should not do.

With ``--sample N``, twenty more spin-held prefills run while a thread samples the main thread's stack every ~50 µs
inside the layers, and the N lines of the project's code, and the N functions of any code, that the most samples
stand in are printed: where the host's time to issue a prefill goes. (A profiler that traces calls does not see
CuPy's compiled calls and weighs Python's own calls far above them.)

``--after N`` feeds N tokens first (not stamped), so that the prefill timed is a later chunk of a long prompt, whose
CSA layers take the sparse path.

Usage: python benchmarks/prefill_host.py FILE [--prompt-tokens 2048] [--after 0] [--rounds 3] [--spin-ms 400]
[--sample N]
(needs a GPU with the CUDA backend and the DeepSeek V4 plugin.)
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ds4_core.engine import Engine

#: A kernel that keeps one thread busy for ``n`` clock cycles, holding the stream behind it.
_SPIN = r'''extern "C" __global__ void spin(long long n) {
    const long long t = clock64();
    while (clock64() - t < n) {}
}'''


def spinner() -> Callable[[float], None]:
    """A function that holds the current stream's GPU for the milliseconds it is given (one thread spinning), so
    that the host's calls after it are timed without waiting for the device."""
    import cupy

    spin = cupy.RawKernel(_SPIN, "spin")
    runtime = cupy.cuda.runtime
    clock_hz = 1e3 * runtime.deviceGetAttribute(runtime.cudaDevAttrClockRate, cupy.cuda.Device().id)  # given in kHz
    return lambda ms: spin((1,), (1,), (np.int64(ms * 1e-3 * clock_hz),))


def _stamped(cls: type, name: str, stamps: list[tuple[float, float]]) -> None:
    """Wraps ``cls.name`` so that each call appends its (start, end) ``perf_counter`` times to ``stamps``."""
    method = getattr(cls, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = method(*args, **kwargs)
        stamps.append((start, time.perf_counter()))
        return out

    setattr(cls, name, timed)


def _sampled(run: Callable[[], None], active: list[bool], interval: float = 2e-5) -> tuple[Counter, Counter]:
    """Runs ``run`` while a thread samples the calling thread's stack whenever ``active[0]``: counts by the innermost
    line of the project's code (a ``ds4_`` package) and by the innermost function of any code."""
    main, done = threading.get_ident(), threading.Event()
    lines: Counter = Counter()
    functions: Counter = Counter()

    def sample() -> None:
        while not done.is_set():
            frame = sys._current_frames().get(main)
            if active[0] and frame is not None:
                code = frame.f_code
                functions[f"{Path(code.co_filename).name}:{code.co_name}"] += 1
                while frame is not None and "ds4_" not in frame.f_code.co_filename:
                    frame = frame.f_back
                if frame is not None:
                    code = frame.f_code
                    lines[f"{Path(code.co_filename).name}:{frame.f_lineno} {code.co_name}"] += 1
            time.sleep(interval)

    switch = sys.getswitchinterval()
    sys.setswitchinterval(interval)  # the main thread lets the sampler in this often
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        run()
    finally:
        done.set()
        thread.join()
        sys.setswitchinterval(switch)
    return lines, functions


def _flagged(cls: type, name: str, active: list[bool], armed: list[bool]) -> None:
    """Wraps ``cls.name`` so that ``active[0]`` is true while it runs if ``armed[0]``."""
    method = getattr(cls, name)

    def flagged(*args, **kwargs):
        active[0] = armed[0]
        try:
            return method(*args, **kwargs)
        finally:
            active[0] = False

    setattr(cls, name, flagged)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--after", type=int, default=0, metavar="N",
                        help="feed N tokens first, unstamped, so that the prefill timed is a later chunk's")
    parser.add_argument("--spin-ms", type=float, default=400.0, help="how long the spin kernel holds the GPU")
    parser.add_argument("--sample", type=int, default=0, metavar="N",
                        help="also sample twenty spin-held prefills: the N lines and functions the host spends most in")
    args = parser.parse_args()
    import cupy
    from ds4_model_deepseek4.model import Block

    engine = Engine.load(args.file, backend="cuda", ctx=args.after + args.prompt_tokens + 64)
    tokens = np.random.default_rng(0).integers(0, engine.tokenizer.vocab_size, args.after + args.prompt_tokens)
    before, prompt = tokens[:args.after], tokens[args.after:]

    def new_session() -> Any:
        session = engine.new_session()
        if args.after:
            session.feed(before, logits="none")
        return session

    hold = spinner()
    for _ in range(2):  # compiles and warms every kernel
        new_session().feed(prompt, logits="last")
    stamps: list[tuple[float, float]] = []
    _stamped(Block, "layer", stamps)
    walls, hosts = [], []
    for _ in range(args.rounds):
        session = new_session()
        cupy.cuda.Device().synchronize()
        start = time.perf_counter()
        session.feed(prompt, logits="last")
        walls.append(time.perf_counter() - start)
        session = new_session()
        cupy.cuda.Device().synchronize()
        stamps.clear()
        start = time.perf_counter()
        hold(args.spin_ms)
        session.feed(prompt, logits="last")
        if not stamps:
            raise SystemExit(f"{args.file}: no DeepSeek V4 layer ran; this script times that plugin's layers")
        issued = stamps[-1][1] - start
        if issued * 1e3 >= args.spin_ms:
            print(f"the layers were issued {issued * 1e3:.1f} ms after the spin began, past its {args.spin_ms:.0f} "
                  "ms: something inside the prefill waited for the GPU (raise --spin-ms if the host is that slow)")
        hosts.append([end - begin for begin, end in stamps])
    per_layer = np.median(np.array(hosts), axis=0) * 1e3
    wall = np.median(walls) * 1e3
    print(f"{args.file.name}: prefill of {args.prompt_tokens} tokens, {len(per_layer)} layers, medians of "
          f"{args.rounds} rounds")
    print("host ms a layer: " + " ".join(f"{ms:.2f}" for ms in per_layer))
    if args.sample:
        active, armed = [False], [False]
        _flagged(Block, "layer", active, armed)

        def prefills() -> None:
            for _ in range(20):
                armed[0] = False  # the tokens fed first are not sampled
                session = new_session()
                cupy.cuda.Device().synchronize()
                armed[0] = True
                hold(args.spin_ms)
                session.feed(prompt, logits="last")

        lines, functions = _sampled(prefills, active)
        total = sum(lines.values()) or 1
        print(f"{total} samples inside the layers of twenty spin-held prefills; the project's lines they stand in:")
        for where, n in lines.most_common(args.sample):
            print(f"  {100 * n / total:5.1f}%  {where}")
        print("the innermost functions:")
        for where, n in functions.most_common(args.sample):
            print(f"  {100 * n / total:5.1f}%  {where}")
    print(f"host issues the layers in {per_layer.sum():.1f} ms ({per_layer.mean():.2f} a layer); the prefill's wall "
          f"time on an idle GPU {wall:.1f} ms ({wall / len(per_layer):.2f} a layer, the embedding and head included)")


if __name__ == "__main__":
    main()
