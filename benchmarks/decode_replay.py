"""The GPU's time for a decode step alone: the recorded step of a GGUF replayed back to back, no host in the loop.

``ds4 bench -m FILE`` times whole tokens as ``ds4 run`` decodes them: the host's sampling and feeding sit between
the steps, and on the H200 machine they added 0.06-0.28 ms a token, varying from run to run: more than most kernel
changes move a step. Here the host queues REPLAYS steps (each writes the token and the position, then launches the
graph) without waiting, and CUDA events time them on the device: at 1-5 ms a step, the host's ~30 µs of launching
stays ahead. Prints ms a step for ROUNDS rounds; with two files (4 and 12 layers) the difference gives a layer's time.

Usage: python benchmarks/decode_replay.py FILE [FILE ...] [--prompt-tokens 2048] [--replays 100] [--rounds 3]
(needs a GPU with the CUDA backend and the file's model plugin.)
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def step_ms(path: Path, prompt_tokens: int, replays: int, rounds: int) -> list[float]:
    """ms a decode step after ``prompt_tokens`` tokens of ``path``, one figure per round of ``replays`` steps."""
    import cupy

    from ds4_core.engine import Engine

    engine = Engine.load(path, backend="cuda", ctx=prompt_tokens + replays * rounds + 8)
    try:
        graphs = engine.model.decode_graphs
        if graphs is None:
            raise SystemExit(f"{path.name}: this model's decode step is not recorded as a graph")
        session = engine.new_session()
        ids = np.random.default_rng(0).integers(0, engine.tokenizer.vocab_size, prompt_tokens + 1)
        session.feed(ids[:prompt_tokens], logits="none")
        for t in ids[-3:]:  # records the step, then warms the replay
            session.feed([int(t)], logits="none")
        token, position = int(ids[-1]), session.state.n_tokens
        # a model whose step takes another form later on (DeepSeek V4 past index_topk complete rows) records it
        # here, not in a timed round: its forms change once at most as the position grows
        graphs(token, position + replays * rounds - 1, session.state)
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        times = []
        for _ in range(rounds):
            start.record()
            for _ in range(replays):
                graphs(token, position, session.state)
                position += 1
            end.record()
            end.synchronize()
            times.append(cupy.cuda.get_elapsed_time(start, end) / replays)
        return times
    finally:
        engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", type=Path, nargs="+")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--replays", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    for path in args.files:
        times = step_ms(path, args.prompt_tokens, args.replays, args.rounds)
        print(f"{path.name}: " + ", ".join(f"{t:.4f}" for t in times) + f" ms a step (median {np.median(times):.4f})",
              flush=True)


if __name__ == "__main__":
    main()
