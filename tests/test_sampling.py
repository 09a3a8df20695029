"""The sampler chain against spec deepseek_v4.md §15, with an independent plain-Python reference."""

from __future__ import annotations

import math

import attrs
import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from ds4_core import sampling
from ds4_core.descriptors import SamplerSpec, resolve
from ds4_core.errors import Ds4Error
from ds4_core.sampling import (
    SAMPLER_SPECS,
    TOP_K_CAP,
    Candidates,
    Rng,
    Sampler,
    SamplingError,
    SamplingParams,
    greedy,
    resolve_stages,
)

PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# Logit rows with plenty of exact ties (coarse grid), some -inf and NaN, always one finite value.
_values = st.one_of(
    st.integers(-8, 8).map(lambda v: v / 2.0),
    st.floats(-30.0, 30.0, width=32),
    st.just(-math.inf),
    st.just(math.nan),
)
logit_rows = arrays(np.float32, st.integers(1, 40), elements=_values).filter(lambda a: np.isfinite(a).any())
params = st.builds(
    SamplingParams,
    temperature=st.floats(0.05, 3.0),
    top_k=st.integers(0, 50),
    top_p=st.floats(0.0, 1.0),
    min_p=st.floats(0.0, 1.0),
    seed=st.integers(0, 2**64 - 1),
)


def argmax_lowest_id(logits: np.ndarray) -> int:
    values = [-math.inf if math.isnan(v) else float(v) for v in logits]
    return values.index(max(values))


def reference_survivors(logits: np.ndarray, p: SamplingParams, slack: float = 0.0) -> dict[int, float]:
    """Spec §15 step by step in plain Python: {token id: normalised probability}.

    ``slack`` moves the min_p and top_p thresholds by a relative amount: positive gives a superset, negative
    a subset, either safe against last-bit rounding differences right at a threshold.
    """
    values = [(-math.inf if math.isnan(v) else float(v), i) for i, v in enumerate(logits)]
    ranked = sorted(values, key=lambda vi: (-vi[0], vi[1]))
    if p.top_k > 0:
        ranked = ranked[: min(p.top_k, TOP_K_CAP)]
    finite = [(v, i) for v, i in ranked if math.isfinite(v)]
    top = max(v for v, _ in finite)
    weights = {i: math.exp((v - top) / p.temperature) for v, i in finite}
    biggest = max(weights.values())
    weights = {i: w for i, w in weights.items() if w >= p.min_p * biggest * (1.0 - slack)}
    if p.top_p < 1.0:
        total = sum(weights.values())
        kept: dict[int, float] = {}
        for _, i in finite:  # descending logits, ties to the lowest id: two logits a denormal apart may share a weight
            if i not in weights:
                continue
            kept[i] = weights[i]
            if sum(kept.values()) >= p.top_p * total * (1.0 + slack):
                break
        weights = kept
    total = sum(weights.values())
    return {i: w / total for i, w in weights.items()}


# --- greedy -----------------------------------------------------------------------------------------------------


@PROPERTY
@given(logit_rows)
def test_greedy_is_argmax_with_lowest_id_on_ties(logits):
    assert greedy(logits) == argmax_lowest_id(logits)
    assert Sampler(SamplingParams(temperature=0.0)).sample(logits) == argmax_lowest_id(logits)


@PROPERTY
@given(logit_rows, params, st.floats(-5.0, 0.0))
def test_temperature_zero_or_below_ignores_every_other_parameter(logits, p, t):
    sampler = Sampler(attrs.evolve(p, temperature=t))
    assert [sampler.sample(logits) for _ in range(3)] == [argmax_lowest_id(logits)] * 3


@PROPERTY
@given(logit_rows, params)
def test_top_k_one_is_greedy(logits, p):
    sampler = Sampler(SamplingParams(temperature=p.temperature, top_k=1, top_p=p.top_p, min_p=p.min_p, seed=p.seed))
    assert sampler.sample(logits) == argmax_lowest_id(logits)


@PROPERTY
@given(logit_rows, st.floats(0.05, 3.0), st.integers(0, 999))
@example(np.array([0.0, 1.5e-30], np.float32), 1.0, 0)  # two logits whose probabilities are equal
def test_min_p_one_keeps_only_the_most_probable_tokens(logits, t, seed):
    """Only tokens whose probability, exp((l - l_max) / T) in float64 as the temperature stage has it, equals the
    top one's: the top logit, or one so close to it that the two probabilities are the same number."""
    sampler = Sampler(SamplingParams(temperature=t, min_p=1.0, seed=seed))
    top = float(np.nanmax(logits))
    assert all(np.exp((np.float64(logits[sampler.sample(logits)]) - top) / t) == 1.0 for _ in range(5))


@PROPERTY
@given(logit_rows, st.floats(0.05, 3.0), st.floats(0.0, 0.05), st.integers(0, 999))
@example(np.array([0.0, 1e-20], np.float32), 1.0, 0.0, 0)  # distinct logits, equal probabilities after exp
def test_tiny_top_p_keeps_only_the_top_token(logits, t, min_p, seed):
    sampler = Sampler(SamplingParams(temperature=t, top_p=1e-9, min_p=min_p, seed=seed))
    assert [sampler.sample(logits) for _ in range(3)] == [argmax_lowest_id(logits)] * 3


# --- the chain ----------------------------------------------------------------------------------------------------


@PROPERTY
@given(logit_rows, params)
def test_sampled_id_is_in_the_independently_computed_survivor_set(logits, p):
    sampler = Sampler(p)
    survivors = reference_survivors(logits, p, slack=1e-9)
    assert {sampler.sample(logits) for _ in range(5)} <= survivors.keys()


@PROPERTY
@given(logit_rows, params)
@example(np.array([-1e-45, 0.0], np.float32), SamplingParams(temperature=1.0, top_k=0, top_p=0.5, min_p=0.0, seed=0))
def test_chain_survivors_match_the_reference(logits, p):
    got = set(Sampler(p).candidates(logits).ids.tolist())
    surely, maybe = reference_survivors(logits, p, slack=-1e-9), reference_survivors(logits, p, slack=1e-9)
    assert surely.keys() <= got <= maybe.keys()


def test_empirical_frequencies_match_the_filtered_renormalised_distribution():
    logits = np.array([2.0, 1.5, 1.4, 0.3, -0.5, -3.0, 1.0, np.nan, -np.inf, 0.9], dtype=np.float32)
    p = SamplingParams(temperature=0.7, top_k=8, top_p=0.9, min_p=0.05, seed=1234)
    expected = reference_survivors(logits, p)
    # The filters must bite, or this would not test them: top_k, min_p and top_p each remove something.
    assert 2 <= len(expected) < 6
    sampler = Sampler(p)
    n = 25_000
    counts = np.bincount([sampler.sample(logits) for _ in range(n)], minlength=logits.size)
    assert set(np.flatnonzero(counts).tolist()) == expected.keys()
    chi2 = sum((counts[i] - n * q) ** 2 / (n * q) for i, q in expected.items())
    df = len(expected) - 1
    # Mean df, variance 2·df: df + 10·sqrt(2·df) is far beyond the 1e-6 tail for these df, and a
    # wrong temperature or a missing renormalisation gives thousands here.
    assert chi2 < df + 10 * math.sqrt(2 * df)
    for i, q in expected.items():
        assert abs(counts[i] / n - q) < 5 * math.sqrt(q * (1 - q) / n)


def test_top_p_keeps_the_token_that_crosses_the_threshold():
    c = Candidates([0, 1, 2, 3], [0.0, 0.0, 0.0, 0.0], np.array([0.25, 0.5, 0.125, 0.125]))

    def kept(top_p):
        return sampling.top_p(c, SamplingParams(top_p=top_p)).ids.tolist()

    assert kept(0.5) == [1]
    assert kept(0.5001) == [1, 0]
    assert kept(0.75) == [1, 0]
    assert kept(0.76) == [1, 0, 2]
    assert kept(1.0) == [0, 1, 2, 3]


def test_top_k_is_capped_at_1024_and_breaks_ties_by_lowest_id():
    logits = np.zeros(3000, dtype=np.float32)
    logits[2500] = 1.0
    c = sampling.top_k(Candidates.from_logits(logits), SamplingParams(top_k=5000))
    assert c.ids.tolist() == [2500, *range(TOP_K_CAP - 1)]


def test_min_p_drops_tokens_below_the_fraction_of_the_top_probability():
    c = Candidates([7, 8, 9], [0.0, 0.0, 0.0], np.array([1.0, 0.1, 0.09]))
    assert sampling.min_p(c, SamplingParams(min_p=0.1)).ids.tolist() == [7, 8]


def test_temperature_stage_gives_the_spec_weights():
    c = sampling.temperature(Candidates.from_logits(np.array([1.0, 3.0, -np.inf, 2.0])), SamplingParams(temperature=2))
    assert c.ids.tolist() == [0, 1, 3]
    np.testing.assert_allclose(c.probs, [math.exp(-1.0), 1.0, math.exp(-0.5)], rtol=1e-12)


def test_positive_infinite_logits_take_all_the_mass():
    logits = np.array([5.0, np.inf, 0.0, np.inf], dtype=np.float32)
    sampler = Sampler(SamplingParams(seed=3, min_p=0.0))
    assert {sampler.sample(logits) for _ in range(50)} == {1, 3}


# --- bad logits ---------------------------------------------------------------------------------------------------


def test_nan_logits_are_never_chosen():
    logits = np.array([np.nan, 0.0, np.nan, 0.5, np.nan], dtype=np.float32)
    sampler = Sampler(SamplingParams(seed=5, min_p=0.0))
    assert {sampler.sample(logits) for _ in range(100)} == {1, 3}
    assert greedy(logits) == 3


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("row", [[-np.inf, -np.inf], [np.nan, -np.inf], [np.nan]])
def test_all_minus_inf_or_nan_logits_raise_a_clear_error(row, temperature):
    with pytest.raises(SamplingError, match="every logit is -inf or NaN"):
        Sampler(SamplingParams(temperature=temperature)).sample(np.array(row, dtype=np.float32))


@pytest.mark.parametrize("row", [np.zeros((2, 3), np.float32), np.zeros(0, np.float32), np.arange(3)])
def test_logits_must_be_a_non_empty_float_row(row):
    with pytest.raises(SamplingError, match="1-D float array"):
        Sampler(SamplingParams()).sample(row)


# --- randomness ---------------------------------------------------------------------------------------------------


def test_same_seed_gives_the_same_sequence():
    logits = np.linspace(-1.0, 1.0, 50, dtype=np.float32)
    a, b = Sampler(SamplingParams(seed=42)), Sampler(SamplingParams(seed=42))
    assert [a.sample(logits) for _ in range(100)] == [b.sample(logits) for _ in range(100)]


def test_different_seeds_differ_on_a_flat_distribution():
    flat = np.zeros(1000, dtype=np.float32)
    sequences = {tuple(Sampler(SamplingParams(seed=s)).sample(flat) for _ in range(20)) for s in (0, 1, 2, 2**64 - 1)}
    assert len(sequences) == 4
    unseeded = {tuple(Sampler(SamplingParams()).sample(flat) for _ in range(20)) for _ in range(2)}
    assert len(unseeded) == 2


def test_rng_uniform_is_24_bit_and_covers_the_unit_interval():
    rng = Rng(7)
    u = np.array([rng.uniform() for _ in range(20_000)])
    assert u.min() >= 0.0 and u.max() < 1.0
    assert np.all(u * 2**24 == np.floor(u * 2**24))
    assert abs(u.mean() - 0.5) < 0.01 and abs(u.var() - 1 / 12) < 0.005
    assert np.histogram(u, bins=10, range=(0, 1))[0].min() > 1800


# --- parameters ---------------------------------------------------------------------------------------------------


def test_defaults_follow_the_spec():
    p = SamplingParams()
    assert (p.temperature, p.top_k, p.top_p, p.min_p, p.seed) == (1.0, 0, 1.0, 0.05, None)


@pytest.mark.parametrize("top_p", [0.0, -0.5, 1.5, math.nan, math.inf])
def test_top_p_outside_zero_one_is_normalised_to_one(top_p):
    assert SamplingParams(top_p=top_p).top_p == 1.0


@pytest.mark.parametrize("min_p", [-0.1, -math.inf])
def test_negative_min_p_is_normalised_to_zero(min_p):
    assert SamplingParams(min_p=min_p).min_p == 0.0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": math.nan},
        {"temperature": math.inf},
        {"temperature": "hot"},
        {"top_k": -1},
        {"top_k": 2.5},
        {"top_k": True},
        {"min_p": 1.01},
        {"min_p": math.nan},
        {"seed": -1},
        {"seed": 2**64},
        {"seed": 1.0},
    ],
)
def test_meaningless_parameters_raise_sampling_error(kwargs):
    with pytest.raises(SamplingError) as info:
        SamplingParams(**kwargs)
    assert isinstance(info.value, Ds4Error)
    assert next(iter(kwargs)) in str(info.value)


def test_negative_temperature_means_greedy():
    assert SamplingParams(temperature=-1.0).greedy


# --- stages as plugins ------------------------------------------------------------------------------------------


def test_sampler_specs_resolve_to_the_stages_in_ascending_order():
    builtins = (sampling.top_k, sampling.temperature, sampling.min_p, sampling.top_p)
    ordered = sorted(SAMPLER_SPECS, key=lambda s: s.order)
    assert [s.name for s in ordered] == ["top_k", "temperature", "min_p", "top_p"]
    assert tuple(resolve(s.impl) for s in ordered) == builtins
    assert resolve_stages(reversed(SAMPLER_SPECS)) == builtins
    assert Sampler(SamplingParams()).stages == resolve_stages(SAMPLER_SPECS)


def ban_token_zero(c: Candidates, p: SamplingParams) -> Candidates:
    return c.take(np.flatnonzero(c.ids != 0))


def test_a_plugin_stage_runs_at_its_order():
    specs = (*SAMPLER_SPECS, SamplerSpec("ban0", 50, f"{__name__}:ban_token_zero"))
    sampler = Sampler(SamplingParams(top_k=1, seed=1), resolve_stages(specs))
    assert sampler.sample(np.array([3.0, 2.0, 1.0], dtype=np.float32)) == 1


def test_a_chain_without_temperature_explains_what_is_missing():
    with pytest.raises(SamplingError, match="temperature stage"):
        Sampler(SamplingParams(), [sampling.top_k, sampling.min_p]).sample(np.zeros(4, np.float32))


@PROPERTY
@given(logit_rows, params)
def test_stages_are_pure(logits, p):
    c = Candidates.from_logits(logits)
    for stage in resolve_stages(SAMPLER_SPECS):
        before = (c.ids.copy(), c.logits.copy(), None if c.probs is None else c.probs.copy())
        out = stage(c, p)
        np.testing.assert_array_equal(c.ids, before[0])
        np.testing.assert_array_equal(c.logits, before[1])
        if c.probs is not None:
            np.testing.assert_array_equal(c.probs, before[2])
        c = out
    row = logits.copy()
    Sampler(p).sample(logits)
    np.testing.assert_array_equal(logits, row)
