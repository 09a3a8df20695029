"""The sampler chain: logits in, one token id out (spec: deepseek_v4.md §15).

A chain is a sequence of stages, each ``stage(candidates, params) -> candidates``
that returns a new, smaller :class:`Candidates` and never mutates its input. The
built-in stages run in the spec's order: top-k, temperature softmax, min-p,
top-p; the :class:`Sampler` then draws one survivor in proportion to its
unnormalised probability with a seeded xorshift64* generator. Temperature ≤ 0
short-circuits the chain to greedy argmax (ties go to the lowest id).

Plugins add stages as :class:`~ds4_core.descriptors.SamplerSpec` descriptors;
:func:`resolve_stages` turns any list of them into a chain.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import attrs
import numpy as np

from .descriptors import SamplerSpec, resolve
from .errors import Ds4Error

#: ds4 never keeps more than this many candidates in the top-k stage.
TOP_K_CAP = 1024

_U64 = (1 << 64) - 1


class SamplingError(Ds4Error):
    """Sampling parameters are out of range, or the logits leave nothing to sample."""


# --- parameters -------------------------------------------------------------------------------------------------


def _real(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise SamplingError(f"{name} must be a number, got {value!r}")
    return float(value)


def _temperature(value: Any) -> float:
    t = _real("temperature", value)
    if not math.isfinite(t):
        raise SamplingError(f"temperature must be a finite number (0 or less means greedy), got {t}")
    return t


def _top_k(value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise SamplingError(f"top_k must be an integer ≥ 0 (0 turns it off), got {value!r}")
    return int(value)


def _top_p(value: Any) -> float:
    p = _real("top_p", value)
    # Spec §15: anything outside (0, 1], NaN included, means "off".
    return p if 0.0 < p <= 1.0 else 1.0


def _min_p(value: Any) -> float:
    m = _real("min_p", value)
    if math.isnan(m) or m > 1.0:
        raise SamplingError(f"min_p must be at most 1 (1 keeps only the most likely tokens, 0 turns it off), got {m}")
    return max(m, 0.0)


def _seed(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not 0 <= value <= _U64:
        raise SamplingError(f"seed must be an integer in [0, 2**64) or None for a random seed, got {value!r}")
    return int(value)


@attrs.frozen
class SamplingParams:
    """How to pick the next token. Defaults are the spec's (and ds4's thinking-mode) values.

    Normalisation follows the spec: ``top_p`` outside (0, 1] (or NaN) becomes 1, ``min_p`` < 0
    becomes 0, ``temperature`` ≤ 0 means greedy. Values with no sensible meaning raise
    :class:`SamplingError`: a non-finite temperature, a negative ``top_k``, ``min_p`` > 1 or NaN
    (it would drop every token), a seed outside [0, 2**64). ``top_k`` above 1024 is capped by the stage.
    """

    temperature: float = attrs.field(default=1.0, converter=_temperature)
    top_k: int = attrs.field(default=0, converter=_top_k)
    top_p: float = attrs.field(default=1.0, converter=_top_p)
    min_p: float = attrs.field(default=0.05, converter=_min_p)
    seed: int | None = attrs.field(default=None, converter=_seed)

    @property
    def greedy(self) -> bool:
        """True when the sampler takes the argmax and ignores every other parameter."""
        return self.temperature <= 0.0


# --- candidates -------------------------------------------------------------------------------------------------


def _as_float(values: Any) -> np.ndarray:
    array = np.asarray(values)
    return array if array.dtype in (np.float32, np.float64) else array.astype(np.float64)


@attrs.frozen(eq=False)
class Candidates:
    """The state passed between stages: ``ids`` int64 [n], ``logits`` float [n], ``probs`` float64 [n] or None.

    ``probs`` are unnormalised probabilities, set by the temperature stage; the draw uses them as weights.
    """

    ids: np.ndarray = attrs.field(converter=lambda v: np.asarray(v, dtype=np.int64))
    logits: np.ndarray = attrs.field(converter=_as_float)
    probs: np.ndarray | None = attrs.field(default=None)

    def __attrs_post_init__(self) -> None:
        if self.ids.ndim != 1 or self.logits.shape != self.ids.shape:
            raise SamplingError(f"candidate ids {self.ids.shape} and logits {self.logits.shape} must be equal 1-D")
        if self.probs is not None and np.shape(self.probs) != self.ids.shape:
            raise SamplingError(f"candidate probs {np.shape(self.probs)} must match ids {self.ids.shape}")

    @classmethod
    def from_logits(cls, logits: np.ndarray) -> Candidates:
        """Every token of a float ``[vocab]`` logit row, with NaN read as -inf (the input is not modified)."""
        row = np.asarray(logits)
        if row.ndim != 1 or row.size == 0 or not np.issubdtype(row.dtype, np.floating):
            raise SamplingError(f"logits must be a non-empty 1-D float array [vocab], got {row.dtype} {row.shape}")
        return cls(np.arange(row.size, dtype=np.int64), _without_nan(row))

    def take(self, index: np.ndarray) -> Candidates:
        """The candidates at positions ``index`` (int [m]), in that order."""
        probs = None if self.probs is None else self.probs[index]
        return Candidates(self.ids[index], self.logits[index], probs)

    def __len__(self) -> int:
        return int(self.ids.size)


Stage = Callable[[Candidates, SamplingParams], Candidates]


def _without_nan(logits: np.ndarray) -> np.ndarray:
    return np.where(np.isnan(logits), -np.inf, logits) if np.isnan(logits).any() else logits


def _best(c: Candidates) -> int:
    """Position of the highest logit; among equal logits, the lowest token id."""
    logits = _without_nan(c.logits)
    top = logits.max()
    if top == -np.inf:
        raise SamplingError("every logit is -inf or NaN, so no token can be chosen; check the model output")
    tied = np.flatnonzero(logits == top)
    return int(tied[np.argmin(c.ids[tied])])


def _require_probs(c: Candidates, stage: str) -> np.ndarray:
    if c.probs is None:
        raise SamplingError(f"the {stage} stage needs probabilities: put the temperature stage before it")
    return c.probs


# --- stages -----------------------------------------------------------------------------------------------------


def top_k(c: Candidates, p: SamplingParams) -> Candidates:
    """Keep the ``min(top_k, 1024)`` highest logits (ties: lowest id), sorted by descending logit. 0 = off."""
    k = min(p.top_k, TOP_K_CAP)
    if k == 0 or k >= len(c):
        return c
    logits = _without_nan(c.logits)
    kth = logits[np.argpartition(logits, -k)[-k:]].min()
    above = np.flatnonzero(logits > kth)
    tied = np.flatnonzero(logits == kth)
    tied = tied[np.argsort(c.ids[tied], kind="stable")][: k - above.size]
    keep = np.concatenate([above, tied])
    return c.take(keep[np.lexsort((c.ids[keep], -logits[keep]))])


def temperature(c: Candidates, p: SamplingParams) -> Candidates:
    """Drop non-finite logits and set ``probs = exp((l - l_max) / T)`` (float64, the best token gets 1).

    +inf logits, if any, are the limit case: only they survive, with equal weight. T ≤ 0 keeps the
    single greedy token.
    """
    if p.temperature <= 0.0:
        best = np.array([_best(c)])
        return Candidates(c.ids[best], c.logits[best], np.ones(1))
    logits = _without_nan(c.logits)
    finite = np.isfinite(logits)
    if not finite.all():
        infinite = np.flatnonzero(logits == np.inf)
        if infinite.size:
            return Candidates(c.ids[infinite], c.logits[infinite], np.ones(infinite.size))
        keep = np.flatnonzero(finite)
        if keep.size == 0:
            raise SamplingError("every logit is -inf or NaN, so no token can be sampled; check the model output")
        c, logits = c.take(keep), logits[keep]
    shifted = logits.astype(np.float64) - float(logits.max())
    return Candidates(c.ids, c.logits, np.exp(shifted / p.temperature))


def min_p(c: Candidates, p: SamplingParams) -> Candidates:
    """Drop candidates with ``probs < min_p * max(probs)``. 0 = off."""
    probs = _require_probs(c, "min_p")
    if p.min_p == 0.0 or len(c) == 0:
        return c
    return c.take(np.flatnonzero(probs >= p.min_p * probs.max()))


def top_p(c: Candidates, p: SamplingParams) -> Candidates:
    """Keep the most probable candidates (ties: lowest id) until their share of the mass reaches ``top_p``.

    The candidate that crosses the threshold is kept; the result is sorted by descending probability. 1 = off.
    Candidates are ranked by logit, then probability: logits that differ can round to equal probabilities
    (``exp(1e-20) == exp(0)``), and the ranking must agree with greedy argmax.
    """
    probs = _require_probs(c, "top_p")
    if p.top_p >= 1.0 or len(c) == 0:
        return c
    order = np.lexsort((c.ids, -probs, -np.asarray(c.logits, dtype=np.float64)))
    mass = np.cumsum(probs[order])
    n_keep = int(np.searchsorted(mass, p.top_p * mass[-1], side="left")) + 1
    return c.take(order[: min(n_keep, order.size)])


#: The built-in stages in spec order; the gaps let plugins slot stages in between.
SAMPLER_SPECS: tuple[SamplerSpec, ...] = (
    SamplerSpec("top_k", 100, "ds4_core.sampling:top_k", "keep the top_k highest logits (at most 1024)"),
    SamplerSpec("temperature", 200, "ds4_core.sampling:temperature", "softmax weights exp((l - l_max) / T)"),
    SamplerSpec("min_p", 300, "ds4_core.sampling:min_p", "drop tokens below min_p times the top probability"),
    SamplerSpec("top_p", 400, "ds4_core.sampling:top_p", "keep the smallest top set holding top_p of the mass"),
)


def resolve_stages(specs: Iterable[SamplerSpec]) -> tuple[Stage, ...]:
    """Import each spec's ``impl`` and return the stages in ascending ``order`` (then name, for ties)."""
    return tuple(resolve(spec.impl) for spec in sorted(specs, key=lambda s: (s.order, s.name)))


# --- random numbers and the draw --------------------------------------------------------------------------------


def _splitmix64(x: int) -> int:
    # Spreads nearby seeds (0, 1, 2...) over the whole state space and maps none of them to the stuck state 0
    # except one 64-bit value, handled by the caller.
    x = (x + 0x9E3779B97F4A7C15) & _U64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _U64
    return x ^ (x >> 31)


class Rng:
    """xorshift64* generator: ``next_u64()`` full 64-bit outputs, ``uniform()`` floats in [0, 1) with 24 bits.

    ``seed`` is an integer in [0, 2**64), mixed with splitmix64 into the state; None draws it from os.urandom.
    """

    _MULTIPLIER = 0x2545F4914F6CDD1D

    def __init__(self, seed: int | None = None) -> None:
        seed = _seed(seed)
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little")
        self._state = _splitmix64(seed) or 0x9E3779B97F4A7C15

    def next_u64(self) -> int:
        """The next 64-bit output."""
        x = self._state
        x ^= x >> 12
        x ^= (x << 25) & _U64
        x ^= x >> 27
        self._state = x
        return (x * self._MULTIPLIER) & _U64

    def uniform(self) -> float:
        """A float in [0, 1): the top 24 bits of the next output over 2**24."""
        return (self.next_u64() >> 40) / float(1 << 24)


def draw(c: Candidates, rng: Rng) -> int:
    """One token id from ``c``, chosen with probability ``probs / sum(probs)`` using one ``rng.uniform()``."""
    probs = _require_probs(c, "draw")
    if len(c) == 0:
        raise SamplingError("the sampler chain removed every candidate; check the custom stages and their order")
    mass = np.cumsum(probs, dtype=np.float64)
    if not (np.isfinite(mass[-1]) and mass[-1] > 0.0 and np.all(probs >= 0.0)):
        raise SamplingError("candidate probabilities must be finite, non-negative and not all zero")
    i = int(np.searchsorted(mass, rng.uniform() * mass[-1], side="right"))
    return int(c.ids[min(i, int(np.flatnonzero(probs > 0.0)[-1]))])


def greedy(logits: np.ndarray) -> int:
    """The id of the largest logit in a float ``[vocab]`` row (ties: the lowest id; NaN counts as -inf)."""
    c = Candidates.from_logits(logits)
    return int(c.ids[_best(c)])


class Sampler:
    """Picks token ids from logit rows with fixed parameters and its own seeded RNG.

    ``stages`` defaults to the built-in chain (:data:`SAMPLER_SPECS`); pass
    ``resolve_stages(specs)`` to run stages registered by plugins.
    """

    def __init__(self, params: SamplingParams, stages: Sequence[Stage] | None = None) -> None:
        self.params = params
        self.stages: tuple[Stage, ...] = resolve_stages(SAMPLER_SPECS) if stages is None else tuple(stages)
        self.rng = Rng(params.seed)

    def candidates(self, logits: np.ndarray) -> Candidates:
        """Run the chain on a float ``[vocab]`` row and return the survivors, without drawing."""
        c = Candidates.from_logits(logits)
        for stage in self.stages:
            c = stage(c, self.params)
        return c

    def sample(self, logits: np.ndarray) -> int:
        """One token id for a float ``[vocab]`` logit row; greedy (lowest id on ties) when temperature ≤ 0."""
        if self.params.greedy:
            return greedy(logits)
        return draw(self.candidates(logits), self.rng)
