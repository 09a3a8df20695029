"""Sampling where the logits are: a decode step brings back a token id, or a short list, not a 129K-float row.

Greedy is one kernel (``argmax_blocks``) and 8 bytes back. The built-in chain (top-k, temperature, min-p, top-p, then
the draw) runs the host's own stage functions and :func:`~ds4_core.sampling.draw` with the sampler's own RNG, but on
the few candidates kernel ``chain_candidates`` keeps, not on the row. So the id is the host's, and the draw takes
exactly the one ``rng.uniform()`` it takes on the host.

Why that is exact. Order the row by (logit descending, id ascending), NaN as -inf. The candidates are a prefix P of
that order (each bound keeps every logit equal to one it keeps) holding every token that reaches the top-p stage on
the whole row: with top-k on, the k first tokens are in P; with min-p on, every token with
``exp((l - lmax) / T) >= min_p`` is (the kernel's bound has slack for rounding); the top-p stage's input is inside
both. Stage by stage on P, given in the order the whole row has at that point (sorted when top-k is on, else by id):
top-k keeps the first ``min(k, |P|)`` tokens, a prefix still holding the top-p input; temperature sees the same
largest logit (P's first token), drops the same non-finite tokens and gives every kept token the same probability;
min-p compares those probabilities with the same maximum (1, the first token's); so top-p gets the very tokens, in the
very order, with the very probabilities it gets on the row: same total mass, same cut, same draw. Rows whose logits
are all -inf or NaN come back as one such token, on which the host chain raises its own error.

When neither top-k nor min-p bounds the set (only top-p, or no stage on), or more than :data:`CANDIDATE_CAP`
tokens pass the bounds, or the sampler runs stages of its own, nothing is done here and the host samples the row.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from ds4_core.sampling import SAMPLER_SPECS, TOP_K_CAP, Candidates, Sampler, draw, greedy, resolve_stages

from .modules import sample_module

#: Most candidates a chain kernel hands back (32 KiB); more than that and the host samples the row.
CANDIDATE_CAP = 4096
#: Threads of the one block the chain's kernel runs.
THREADS = 1024
#: Blocks and threads of the argmax: about four logits a thread, at most ARGMAX_BLOCKS blocks.
ARGMAX_BLOCKS, ARGMAX_THREADS = 256, 256
#: ``order_key(-inf)`` in kernels/sample.cu: the argmax's key when no logit is a number above -inf.
NEG_INF_KEY = 0x007FFFFF


@functools.cache
def _builtin_stages() -> tuple[Any, ...]:
    return resolve_stages(SAMPLER_SPECS)


def sample_row(row: Any, sampler: Sampler) -> int | None:
    """The token id ``sampler`` picks from the float32 CuPy row ``row [vocab]``, advancing ``sampler.rng`` as the
    host would; None when the host must sample (see the module docstring)."""
    if type(sampler) is not Sampler or row.size == 0:  # a subclass may sample its own way
        return None
    import cupy

    row = cupy.ascontiguousarray(row, dtype=cupy.float32).reshape(-1)
    if sampler.params.greedy:  # the host's greedy ignores the stages, so any sampler's greedy is an argmax
        return _argmax(row)
    if sampler.stages != _builtin_stages():
        return None
    candidates = _chain_candidates(row, sampler)
    if candidates is None:
        return None
    for stage in sampler.stages:
        candidates = stage(candidates, sampler.params)
    return draw(candidates, sampler.rng)


def _argmax(row: Any) -> int:
    import cupy

    best = cupy.zeros(1, cupy.uint64)
    blocks = min(ARGMAX_BLOCKS, -(-row.size // (4 * ARGMAX_THREADS)))
    sample_module().get_function("argmax_blocks")((blocks,), (ARGMAX_THREADS,), (row, np.int32(row.size), best))
    word = int(best.get()[0])
    if word >> 32 == NEG_INF_KEY:  # every logit is -inf or NaN: the host's greedy raises its own error for such a row
        greedy(np.full(1, -np.inf, np.float32))
    return 0xFFFFFFFF - (word & 0xFFFFFFFF)


def _chain_candidates(row: Any, sampler: Sampler) -> Candidates | None:
    """The candidates of ``row`` for the built-in chain, in the order the whole row has after the top-k stage;
    None when no bound applies or too many tokens pass."""
    import cupy

    params, n = sampler.params, int(row.size)
    k = min(params.top_k, TOP_K_CAP)
    k = k if k < n else 0  # top-k keeping the whole row is off
    if k == 0 and params.min_p == 0.0:
        return None
    t_log_min_p = params.temperature * math.log(params.min_p) if params.min_p > 0.0 else 0.0
    out = cupy.empty(1 + 2 * CANDIDATE_CAP, cupy.int32)
    sample_module().get_function("chain_candidates")(
        (1,), (THREADS,), (row, np.int32(n), np.int32(k), np.int32(params.min_p > 0.0), np.float64(t_log_min_p),
                           np.float64(params.temperature), np.int32(CANDIDATE_CAP), out))
    count = int(out[:1].get()[0])
    if count > CANDIDATE_CAP:
        return None
    pairs = out[1:1 + 2 * count].get().reshape(count, 2)
    ids, logits = pairs[:, 0].astype(np.int64), np.ascontiguousarray(pairs[:, 1]).view(np.float32)
    # top-k on: the row reaches top-p sorted (top-k sorts it); off: in id order, which the draw then follows
    order = np.lexsort((ids, -logits)) if k else np.argsort(ids)
    return Candidates(ids[order], logits[order])
