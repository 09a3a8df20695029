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

With ``--profile N``, one more spin-held prefill runs under cProfile and the N functions with the most time of
their own are printed: where the host's time to issue a prefill goes.

Usage: python benchmarks/prefill_host.py FILE [--prompt-tokens 2048] [--rounds 3] [--spin-ms 400] [--profile N]
(needs a GPU with the CUDA backend and the DeepSeek V4 plugin.)
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from pathlib import Path

import numpy as np

from ds4_core.engine import Engine

#: A kernel that keeps one thread busy for ``n`` clock cycles, holding the stream behind it.
_SPIN = r'''extern "C" __global__ void spin(long long n) {
    const long long t = clock64();
    while (clock64() - t < n) {}
}'''


def _stamped(cls: type, name: str, stamps: list[tuple[float, float]]) -> None:
    """Wraps ``cls.name`` so that each call appends its (start, end) ``perf_counter`` times to ``stamps``."""
    method = getattr(cls, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        out = method(*args, **kwargs)
        stamps.append((start, time.perf_counter()))
        return out

    setattr(cls, name, timed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--spin-ms", type=float, default=400.0, help="how long the spin kernel holds the GPU")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="also profile one spin-held prefill: its N functions with most time")
    args = parser.parse_args()
    import cupy
    from ds4_model_deepseek4.model import Block

    engine = Engine.load(args.file, backend="cuda", ctx=args.prompt_tokens + 64)
    prompt = np.random.default_rng(0).integers(0, engine.tokenizer.vocab_size, args.prompt_tokens)
    spin = cupy.RawKernel(_SPIN, "spin")
    runtime = cupy.cuda.runtime
    clock_hz = 1e3 * runtime.deviceGetAttribute(runtime.cudaDevAttrClockRate, cupy.cuda.Device().id)  # given in kHz
    for _ in range(2):  # compiles and warms every kernel
        engine.new_session().feed(prompt, logits="last")
    stamps: list[tuple[float, float]] = []
    _stamped(Block, "layer", stamps)
    walls, hosts = [], []
    for _ in range(args.rounds):
        session = engine.new_session()
        cupy.cuda.Device().synchronize()
        start = time.perf_counter()
        session.feed(prompt, logits="last")
        walls.append(time.perf_counter() - start)
        stamps.clear()
        session = engine.new_session()
        cupy.cuda.Device().synchronize()
        start = time.perf_counter()
        spin((1,), (1,), (np.int64(args.spin_ms * 1e-3 * clock_hz),))
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
    if args.profile:
        profile = cProfile.Profile()
        session = engine.new_session()
        cupy.cuda.Device().synchronize()
        spin((1,), (1,), (np.int64(args.spin_ms * 1e-3 * clock_hz),))
        profile.runcall(session.feed, prompt, logits="last")
        stats = pstats.Stats(profile)
        print(f"one spin-held prefill under cProfile: the {args.profile} functions with most own time, then most "
              "time with their callees")
        stats.sort_stats("tottime").print_stats(args.profile)
        stats.sort_stats("cumulative").print_stats(args.profile)
    print(f"host issues the layers in {per_layer.sum():.1f} ms ({per_layer.mean():.2f} a layer); the prefill's wall "
          f"time on an idle GPU {wall:.1f} ms ({wall / len(per_layer):.2f} a layer, the embedding and head included)")


if __name__ == "__main__":
    main()
