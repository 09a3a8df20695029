"""The host's part of a greedy decode token: the walls of ``Session.feed`` and ``Session.sample``, and the device
argmax alone.

A decode token is ``sample`` (it waits for the step on the GPU, then the argmax of the logits brings back an id),
then ``feed`` of that id (the step's buffers written, its graph launched); the GPU idles while the host runs the part
of ``feed`` before the launch. Loads FILE on the CUDA backend, feeds a random prompt, decodes a few tokens (the step
is recorded), then times TOKENS more (medians) and the argmax alone on an idle GPU.

Usage: python benchmarks/decode_host.py FILE [--prompt-tokens 2048] [--tokens 100]
(needs a GPU with the CUDA backend and the file's model plugin.)
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from ds4_core.engine import Engine
from ds4_core.sampling import SamplingParams


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=100)
    args = parser.parse_args()
    import cupy

    engine = Engine.load(args.file, backend="cuda", ctx=args.prompt_tokens + args.tokens + 64)
    session = engine.new_session()
    session.feed(np.random.default_rng(0).integers(0, 1000, args.prompt_tokens), logits="last")
    greedy = engine.sampler(SamplingParams(temperature=0))
    for _ in range(8):  # records the step's graph
        session.feed([session.sample(greedy)], logits="none")
    sample, feed = [], []
    for _ in range(args.tokens):
        t0 = time.perf_counter()
        token = session.sample(greedy)
        t1 = time.perf_counter()
        session.feed([token], logits="none")
        sample.append(t1 - t0)
        feed.append(time.perf_counter() - t1)
    print(f"per token: sample {np.median(sample) * 1e6:.1f} us (waits for the step), "
          f"feed {np.median(feed) * 1e6:.1f} us")
    row, alone = engine.backend.asarray(session.last_logits), []
    for _ in range(50):
        cupy.cuda.Device().synchronize()
        t0 = time.perf_counter()
        engine.backend.sample(row, greedy)
        alone.append(time.perf_counter() - t0)
    print(f"argmax alone on an idle GPU: {np.median(alone) * 1e6:.1f} us")


if __name__ == "__main__":
    main()
