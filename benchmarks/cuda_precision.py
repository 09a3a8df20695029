"""How far the CUDA backend's fast paths move the shipped tiny models from the numpy reference.

For each trained tiny model (held-out text from this interpreter's standard library, as the tiny-model tests) and
each CUDA configuration — float32 (``DS4_CUDA_INT8=0 DS4_CUDA_PREFILL=32``), int8 decode activations (a default),
16-bit tensor-core prefill (the other default) — it reports the held-out loss (prefill path) next to numpy's, the
largest logit difference over one held-out window relative to the largest logit, and how many of 48 greedy
decode steps (graph-replayed one-token steps where the model records them) pick numpy's token.

Usage: python benchmarks/cuda_precision.py   (needs a GPU with the CUDA backend and the three model plugins)
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path

import numpy as np

from ds4_core.engine import Engine
from ds4_core.testing.heldout import held_out_sources, mean_loss

#: (model plugin package, file, tokens per held-out window, windows start with BOS/[gMASK])
MODELS = (("ds4_model_deepseek4", "tiny-deepseek4.gguf", 512, True), ("ds4_model_glm5", "tiny-glm53.gguf", 256, True),
          ("ds4_model_qwen38", "tiny-qwen38.gguf", 256, False))
CONFIGS = {"float32": {"DS4_CUDA_INT8": "0", "DS4_CUDA_PREFILL": "32"},
           "int8 decode": {"DS4_CUDA_INT8": "1", "DS4_CUDA_PREFILL": "32"},
           "16-bit prefill": {"DS4_CUDA_INT8": "0", "DS4_CUDA_PREFILL": "16"}}
GREEDY_STEPS = 48


def _greedy(engine: Engine, prompt: list[int]) -> list[int]:
    session = engine.new_session()
    logits = session.feed(prompt)[-1]
    out = []
    for _ in range(GREEDY_STEPS):
        out.append(int(np.argmax(logits)))
        logits = session.feed(out[-1:])[-1]
    return out


def _measure(path: Path, tokens: int, bos: bool, texts: list[str]) -> None:
    reference = Engine.load(path, backend="numpy")
    prompt = reference.tokenizer.encode(texts[0][:4000])[:tokens - 1]
    prompt = [reference.tokenizer.bos_id, *prompt] if bos else prompt
    want_loss = mean_loss(reference, texts, tokens=tokens, bos=bos)
    want_logits = reference.new_session().feed(prompt)
    want_greedy = _greedy(reference, prompt[:64])
    reference.close()
    print(f"{path.name}: numpy held-out loss {want_loss:.4f}")
    for name, env in CONFIGS.items():
        os.environ.update(env)
        engine = Engine.load(path, backend="cuda")
        try:
            loss = mean_loss(engine, texts, tokens=tokens, bos=bos)
            logits = engine.new_session().feed(prompt)
            same = sum(a == b for a, b in zip(_greedy(engine, prompt[:64]), want_greedy, strict=True))
        finally:
            engine.close()
        drift = np.abs(logits - want_logits).max() / np.abs(want_logits).max()
        print(f"  {name:15s} loss {loss:.4f} ({loss - want_loss:+.4f})  max logit error {drift:.2e}  "
              f"greedy tokens equal {same}/{GREEDY_STEPS}")


def main() -> None:
    sources = held_out_sources()
    if sources is None:
        raise SystemExit("this interpreter ships no standard library sources")
    for package, name, tokens, bos in MODELS:
        _measure(Path(str(resources.files(package).joinpath("data", name))), tokens, bos, list(sources.values()))


if __name__ == "__main__":
    main()
