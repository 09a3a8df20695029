"""Sampling on the device gives the host sampler's token ids, draw after draw, from the same seed.

The oracle is :class:`ds4_core.sampling.Sampler` on a host copy of the row (itself checked in tests/test_sampling.py):
the device answer must be the same id and must leave the RNG where the host leaves it. Rows are large (the 129280
of DeepSeek V4) and small, with ties, NaN, ±inf and ±0.
"""

from __future__ import annotations

import numpy as np
import pytest

from ds4_core.sampling import SAMPLER_SPECS, Sampler, SamplingError, SamplingParams, resolve_stages

pytestmark = pytest.mark.gpu

SIZES = (129280, 1000, 50)
KINDS = ("normal", "ties", "nan_and_neg_inf", "pos_inf", "signed_zeros")
CHAIN_PARAMS = (
    {"temperature": 0.8, "top_k": 40, "min_p": 0.0},
    {"temperature": 1.0, "top_k": 0, "min_p": 0.05},
    {"temperature": 0.7, "top_k": 50, "min_p": 0.05, "top_p": 0.9},
    {"temperature": 1.3, "top_k": 0, "min_p": 0.1, "top_p": 0.8},
    {"temperature": 2.0, "top_k": 1024, "min_p": 0.0, "top_p": 0.95},
    {"temperature": 0.5, "top_k": 3, "min_p": 0.5, "top_p": 0.5},
    {"temperature": 5.0, "top_k": 1, "min_p": 0.01},
    {"temperature": 1e-3, "top_k": 0, "min_p": 1.0},
    {"temperature": 0.9, "top_k": 4000, "min_p": 0.0},  # capped at 1024 by the stage
)
DRAWS = 6


def _row(n: int, kind: str, seed: int) -> np.ndarray:
    """Logits spread like a model's (scale 4..8, so min-p keeps a handful of a 129K row), with the kind's oddities."""
    rng = np.random.default_rng(seed)
    row = (rng.standard_normal(n) * rng.uniform(4.0, 8.0)).astype(np.float32)
    if kind == "ties":
        row = np.round(row)
    elif kind == "nan_and_neg_inf":
        row[rng.integers(0, n, n // 5 + 1)] = np.nan
        row[rng.integers(0, n, n // 5 + 1)] = -np.inf
        row[int(np.nanargmax(row))] = np.nan  # the best logit becomes NaN: the runner-up leads
    elif kind == "pos_inf":
        row[rng.integers(0, n, 3)] = np.inf
    elif kind == "signed_zeros":
        row -= row.max()
        row[rng.integers(0, n, 4)] = -0.0
        row[rng.integers(0, n, 4)] = 0.0  # the maximum is 0, tied between +0 and -0 at a few ids
    return row.astype(np.float32)


def _host(sampler: Sampler, row: np.ndarray) -> int | str:
    try:
        return sampler.sample(row)
    except SamplingError as exc:
        return f"SamplingError: {exc}"


def _device(backend, sampler: Sampler, row) -> int | str | None:
    try:
        return backend.sample(row, sampler)
    except SamplingError as exc:
        return f"SamplingError: {exc}"


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_is_the_hosts_argmax(cuda_backend, n, kind):
    for seed in range(4):
        row = _row(n, kind, seed)
        params = SamplingParams(temperature=0.0)
        got = _device(cuda_backend, Sampler(params), cuda_backend.asarray(row))
        assert got == _host(Sampler(params), row)


def test_greedy_ignores_custom_stages_like_the_host(cuda_backend):
    row = _row(129280, "ties", 7)
    custom = Sampler(SamplingParams(temperature=0.0), [*resolve_stages(SAMPLER_SPECS), lambda c, p: c])
    assert cuda_backend.sample(cuda_backend.asarray(row), custom) == int(np.argmax(row))


@pytest.mark.parametrize("params", CHAIN_PARAMS, ids=lambda p: "-".join(f"{k}{v}" for k, v in p.items()))
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("kind", KINDS)
def test_chain_draws_the_hosts_ids_with_the_same_rng(cuda_backend, params, n, kind):
    bounded = 0 < min(params["top_k"], 1024) < n or params["min_p"] > 0.0
    for seed in range(3):
        row = _row(n, kind, 100 + seed)
        device_row = cuda_backend.asarray(row)
        host, device = (Sampler(SamplingParams(seed=seed, **params)) for _ in range(2))
        for _ in range(DRAWS):
            want, got = _host(host, row), _device(cuda_backend, device, device_row)
            assert (got is not None) == bounded  # unbounded chains are left to the host
            if got is None:
                got = _host(device, row)
            assert got == want
        assert host.rng.next_u64() == device.rng.next_u64()  # same number of uniforms drawn


@pytest.mark.parametrize("greedy", [True, False])
def test_a_row_of_only_neg_inf_and_nan_raises_the_hosts_error(cuda_backend, greedy):
    row = np.full(129280, -np.inf, np.float32)
    row[::3] = np.nan
    params = SamplingParams(temperature=0.0 if greedy else 1.0, top_k=40)
    with pytest.raises(SamplingError) as host_error:
        Sampler(params).sample(row)
    with pytest.raises(SamplingError) as device_error:
        cuda_backend.sample(cuda_backend.asarray(row), Sampler(params))
    assert str(device_error.value) == str(host_error.value)


def test_custom_stages_are_left_to_the_host(cuda_backend):
    row = _row(129280, "normal", 3)
    sampler = Sampler(SamplingParams(seed=5, top_k=40), [*resolve_stages(SAMPLER_SPECS), lambda c, p: c])
    assert cuda_backend.sample(cuda_backend.asarray(row), sampler) is None
    assert Sampler(SamplingParams(seed=5)).rng.next_u64() == sampler.rng.next_u64()  # no uniform was drawn


def test_too_many_candidates_are_left_to_the_host(cuda_backend):
    # a nearly flat row: min-p keeps every token, far more than the device hands back
    row = (np.random.default_rng(0).standard_normal(129280) * 1e-3).astype(np.float32)
    sampler = Sampler(SamplingParams(seed=5, min_p=0.05))
    assert cuda_backend.sample(cuda_backend.asarray(row), sampler) is None
    assert Sampler(SamplingParams(seed=5)).rng.next_u64() == sampler.rng.next_u64()  # no uniform was drawn


def test_a_cuda_session_samples_on_the_device_what_the_host_would(cuda_backend, tmp_path_factory):
    from ds4_model_deepseek4.tiny import ensure_default_model

    from ds4_core.engine import Engine

    engine = Engine.load(ensure_default_model(tmp_path_factory.mktemp("tiny")), backend="cuda", ctx=64)
    try:
        session = engine.new_session()
        assert session.feed([5, 6, 7, 8], logits="none").shape == (0, engine.model.vocab_size)
        for params in ({"temperature": 0.0}, {"temperature": 0.9, "top_k": 20, "min_p": 0.05, "top_p": 0.9}):
            on_device, on_host = (engine.sampler(SamplingParams(seed=11, **params)) for _ in range(2))
            got = [session.sample(on_device) for _ in range(4)]
            assert got == [on_host.sample(session.last_logits) for _ in range(4)]
    finally:
        engine.close()
