"""The n-gram hash constants of spec §4.4: per-layer odd multipliers and consecutive prime table sizes.

Computed here (by the converter) with exact integer arithmetic; the graph reads them from the metadata.
"""

from __future__ import annotations

import math

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_LAYER_STRIDE = 10007


def splitmix64(value: int) -> int:
    """One step of the splitmix64 generator (all arithmetic mod 2^64)."""
    value = (value + _GOLDEN) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


def layer_multipliers(vocab_size: int, ngram_size: int, ple_index: int, seed: int) -> list[int]:
    """The ``ngram_size`` odd multipliers of PLE layer ``ple_index``; each times any token id stays below 2^63."""
    half = max(1, ((2**63 - 1) // max(vocab_size, 1)) // 2)
    base = seed + _LAYER_STRIDE * ple_index
    return [2 * (splitmix64((base + _GOLDEN * (j + 1)) & _MASK64) % half) + 1 for j in range(ngram_size)]


def _is_prime(value: int) -> bool:
    if value < 2 or value % 2 == 0:
        return value == 2
    return all(value % d for d in range(3, math.isqrt(value) + 1, 2))


def table_sizes(base: int, heads: int, ple_index: int) -> list[int]:
    """Table size of each head of PLE layer ``ple_index``: consecutive primes ≥ ``base``, continuing after the
    ``ple_index · heads`` primes the earlier layers took."""
    primes, candidate = [], base
    while len(primes) < (ple_index + 1) * heads:
        if _is_prime(candidate):
            primes.append(candidate)
        candidate += 1
    return primes[ple_index * heads:]
