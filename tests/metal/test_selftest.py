"""The kernel self-test: a wrong kernel is disabled with a warning and the exact MLX-op path runs instead.

No Metal device is available here, so each custom kernel is stood in for by a candidate implementation: a
deliberately wrong one, one that raises, and a correct one (the MLX-op path itself).
"""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
import structlog.testing
from click.testing import CliRunner
from ds4_backend_metal import hc_ops, kernels, ops, recurrent_ops
from ds4_backend_metal.quant import RawBlocks


@pytest.fixture(autouse=True)
def _kernels_disabled_afterwards():
    yield
    kernels.disable_all()


def _wrong_sinkhorn(logits, iters, eps):
    return kernels.KERNELS["sinkhorn"].reference(logits, max(iters - 5, 1), eps)  # too few passes


def _delta_without_decay(q, k, v, g, beta, state):
    return recurrent_ops.delta_rule_steps(q, k, v, mx.zeros_like(g), beta, state)  # forgets to decay the memory


def _delta_stale_state(q, k, v, g, beta, state):
    o, _ = recurrent_ops.delta_rule_steps(q, k, v, g, beta, state)
    return o, state  # right output, but the state is never written back


def _attention_ignoring_the_sink(q, kv, idx, sink, scale):
    return ops.gathered_attention(q, kv, idx, None, scale)


def _attention_wrapping_minus_one(q, kv, idx, sink, scale):
    return ops.gathered_attention(q, kv, mx.where(idx < 0, kv.shape[0] - 1, idx), sink, scale)  # -1 as the last row


def _raising(*args):
    raise RuntimeError("Metal compiler error: expected ';'")


def _call_counting(fn, calls: list):
    def wrapped(*args):
        calls.append(1)
        return fn(*args)
    return wrapped


def test_without_metal_every_kernel_is_skipped_and_disabled():
    assert not kernels.metal_available()
    results = kernels.verify_and_enable()
    assert {r.name for r in results} == set(kernels.KERNELS) == {
        "iq2_xxs_gemv", "q2_k_gemv", "sinkhorn", "gated_delta_rule", "gated_delta_rule_kda", "sparse_attention_gather",
        "sparse_attention_gather_nosink"}
    assert all(r.status == "skipped" for r in results)
    assert all(kernels.active(name) is None for name in kernels.KERNELS)


def test_wrong_kernels_are_disabled_with_a_warning():
    wrong_gemv = lambda x, b, i: kernels.KERNELS["q2_k_gemv"].reference(x, b, i) * 1.001  # noqa: E731
    with structlog.testing.capture_logs() as logged:
        results = kernels.verify_and_enable({"sinkhorn": _wrong_sinkhorn, "q2_k_gemv": wrong_gemv,
                                             "iq2_xxs_gemv": _raising, "gated_delta_rule": _delta_without_decay,
                                             "gated_delta_rule_kda": _delta_stale_state,
                                             "sparse_attention_gather": _attention_ignoring_the_sink,
                                             "sparse_attention_gather_nosink": _attention_wrapping_minus_one})
    status = {r.name: r for r in results}
    assert {name: r.status for name, r in status.items()} == {n: "failed" for n in kernels.KERNELS}
    assert "RuntimeError" in status["iq2_xxs_gemv"].detail
    assert "exceeds" in status["sinkhorn"].detail
    assert status["gated_delta_rule"].detail.startswith("output 0: max error")
    assert status["gated_delta_rule_kda"].detail.startswith("output 1: max error")  # the state is checked too
    assert all(kernels.active(name) is None for name in kernels.KERNELS)
    warnings = [e for e in logged if e["log_level"] == "warning" and "disabled" in e["event"]]
    assert sorted(e["kernel"] for e in warnings) == sorted(kernels.KERNELS)


def test_a_correct_kernel_is_enabled_and_used_by_the_op(rng):
    calls: list = []
    sink = kernels.KERNELS["sinkhorn"]
    results = kernels.verify_and_enable({"sinkhorn": _call_counting(sink.reference, calls)})
    assert {r.name: r.status for r in results}["sinkhorn"] == "passed"
    assert kernels.active("sinkhorn") is not None
    calls.clear()
    logits = mx.array(rng.standard_normal((3, 4, 4)).astype(np.float32))
    comb = hc_ops.sinkhorn(logits, 20, 1e-6)
    S = mx.array(rng.standard_normal((3, 4, 8)).astype(np.float32))
    from ds4_core.backend import Weight

    w = lambda a: Weight("w", "F32", a.shape, mx.array(a))  # noqa: E731
    fn, scale, base = w(rng.standard_normal((24, 32)).astype(np.float32)), w(np.ones(3, np.float32)), \
        w(np.zeros(24, np.float32))
    hc_ops.hc_pre(S, fn, scale, base, 20, 1e-6, 1e-6)
    assert calls == [1]  # the op went through the enabled kernel
    np.testing.assert_array_equal(np.array(sink.reference(logits, 20, 1e-6)), np.array(comb))


def test_after_a_failed_check_the_op_runs_the_exact_fallback(rng):
    from ds4_core.quants import random_blocks

    kernels.verify_and_enable({"iq2_xxs_gemv": lambda x, b, i: mx.zeros((i.shape[0], i.shape[1], 1, b.shape[1]))})
    assert kernels.active("iq2_xxs_gemv") is None
    blocks = mx.array(random_blocks("IQ2_XXS", 3 * 8, rng).reshape(3, 8, 66))
    x = mx.array(rng.standard_normal((2, 1, 1, 256)).astype(np.float32))
    idx = mx.array(np.array([[0, 2], [1, 1]], np.int32))
    got = ops._experts_matmul(x, RawBlocks(blocks, "IQ2_XXS"), idx)
    want = kernels.KERNELS["iq2_xxs_gemv"].reference(x, blocks, idx)
    assert float(mx.abs(want).max()) > 0
    np.testing.assert_array_equal(np.array(got), np.array(want))


def test_after_a_failed_delta_check_decode_runs_the_exact_fallback(rng):
    kernels.verify_and_enable({"gated_delta_rule": _delta_without_decay})
    assert kernels.active("gated_delta_rule") is None
    args = kernels.KERNELS["gated_delta_rule"].sample(rng)
    q, k, v, g, beta, state = args
    got = recurrent_ops.gated_delta_rule(q, k, v, g[..., 0], beta, state)  # the op takes a [T, H] decay
    for got_part, want_part in zip(got, recurrent_ops.delta_rule_steps(*args), strict=True):
        np.testing.assert_array_equal(np.array(got_part), np.array(want_part))


@pytest.mark.parametrize("per_channel", [False, True], ids=["per-head", "per-channel"])
def test_a_correct_delta_kernel_serves_decode(rng, per_channel):
    calls: list = []
    name = "gated_delta_rule_kda" if per_channel else "gated_delta_rule"
    results = kernels.verify_and_enable({name: _call_counting(kernels.KERNELS[name].reference, calls)})
    assert {r.name: r.status for r in results}[name] == "passed"
    other = "gated_delta_rule" if per_channel else "gated_delta_rule_kda"
    assert kernels.active(other) is None  # each decay shape is verified and enabled on its own
    calls.clear()
    T, H, dk, dv = 1, 2, 8, 4
    q, k = (mx.array(rng.standard_normal((T, H, dk)).astype(np.float32)) for _ in range(2))
    v = mx.array(rng.standard_normal((T, H, dv)).astype(np.float32))
    g = mx.array(-rng.random((T, H, dk) if per_channel else (T, H)).astype(np.float32))
    beta, state = mx.array(rng.random((T, H)).astype(np.float32)), mx.zeros((H, dk, dv))
    o, _ = recurrent_ops.gated_delta_rule(q, k, v, g, beta, state)
    assert calls == [1] and o.shape == (T, H, dv)


def _attention_args(rng, with_sinks: bool, T: int = 5):
    """Arguments of ``ops.sparse_attention`` (sinks as a Weight) with some -1 rows, and its MLX-op result."""
    from ds4_core.backend import Weight

    H, d, N, K = 3, 40, 30, 12  # d not a multiple of 32, T not a multiple of anything
    q = mx.array(rng.standard_normal((T, H, d)).astype(np.float32))
    kv = mx.array(rng.standard_normal((N, d)).astype(np.float32))
    idx = rng.integers(0, N, (T, K)).astype(np.int32)
    idx[:, 1::3] = -1
    sinks = Weight("sinks", "F32", (H,), mx.array(rng.standard_normal(H).astype(np.float32) + 2)) if with_sinks \
        else None
    want = ops.gathered_attention(q, kv, mx.array(idx), None if sinks is None else sinks.data, 0.2)
    return (q, kv, mx.array(idx), sinks, 0.2), want


@pytest.mark.parametrize(("name", "wrong"), [
    ("sparse_attention_gather", _attention_ignoring_the_sink),
    ("sparse_attention_gather", _attention_wrapping_minus_one),
    ("sparse_attention_gather_nosink", _attention_wrapping_minus_one),
], ids=["ignores-sink", "reads-minus-one", "nosink-reads-minus-one"])
def test_a_wrong_attention_gather_is_disabled_and_the_op_runs_the_exact_fallback(rng, name, wrong):
    with structlog.testing.capture_logs() as logged:
        results = kernels.verify_and_enable({name: wrong}, [kernels.KERNELS[name]])
    assert [(r.name, r.status) for r in results] == [(name, "failed")]
    assert "exceeds" in results[0].detail
    assert [e["kernel"] for e in logged if e["log_level"] == "warning"] == [name]
    assert kernels.active(name) is None
    args, want = _attention_args(rng, with_sinks=name == "sparse_attention_gather")
    np.testing.assert_array_equal(np.array(ops.sparse_attention(*args)), np.array(want))


@pytest.mark.parametrize("with_sinks", [True, False], ids=["sinks", "no-sinks"])
def test_a_correct_attention_gather_is_enabled_and_used_by_the_op(rng, with_sinks):
    calls: list = []
    name = "sparse_attention_gather" if with_sinks else "sparse_attention_gather_nosink"
    other = "sparse_attention_gather_nosink" if with_sinks else "sparse_attention_gather"
    results = kernels.verify_and_enable({name: _call_counting(kernels.KERNELS[name].reference, calls)})
    assert {r.name: r.status for r in results}[name] == "passed"
    assert kernels.active(name) is not None and kernels.active(other) is None  # each variant is verified on its own
    calls.clear()
    args, want = _attention_args(rng, with_sinks, T=150)  # more than one query block of the MLX-op path
    got = ops.sparse_attention(*args)
    assert calls == [1]  # the whole op went through the enabled kernel, in one call
    np.testing.assert_array_equal(np.array(got), np.array(want))


def test_kernel_sources_ship_with_the_package():
    for kernel in kernels.KERNELS.values():
        source = kernels._source(kernel.source)
        assert "thread_position_in_grid" in source


def test_backends_self_test_reports_each_kernel_as_json():
    from ds4_core.cli import cli

    result = CliRunner().invoke(cli, ["backends", "--self-test", "--json"])
    assert result.exit_code == 0, result.output
    rows = [r for r in json.loads(result.stdout)["self_test"] if r["backend"] == "metal"]
    assert [r["check"] for r in rows] == list(kernels.KERNELS)
    assert {r["status"] for r in rows} == {"skipped"}  # no Metal device on Linux: the MLX-op paths are used


def test_a_failing_kernel_makes_the_self_test_command_fail(monkeypatch):
    from ds4_backend_metal import selftest

    from ds4_core.cli import cli

    monkeypatch.setattr(selftest, "self_test", lambda: [{"check": "bad_kernel", "status": "failed", "detail": "x"}])
    result = CliRunner().invoke(cli, ["backends", "--self-test"])
    assert result.exit_code == 1 and "bad_kernel" in result.output


def test_backend_runs_the_self_test_at_start():
    from ds4_backend_metal.backend import MetalBackend

    backend = MetalBackend()
    assert [r.name for r in backend.kernel_checks] == list(kernels.KERNELS)
