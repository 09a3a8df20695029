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
from ds4_backend_metal import deepseek4_ops, kernels, ops
from ds4_backend_metal.quant import RawBlocks


@pytest.fixture(autouse=True)
def _kernels_disabled_afterwards():
    yield
    kernels.disable_all()


def _wrong_sinkhorn(logits, iters, eps):
    return kernels.KERNELS["sinkhorn"].reference(logits, max(iters - 5, 1), eps)  # too few passes


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
    assert {r.name for r in results} == set(kernels.KERNELS) == {"iq2_xxs_gemv", "q2_k_gemv", "sinkhorn"}
    assert all(r.status == "skipped" for r in results)
    assert all(kernels.active(name) is None for name in kernels.KERNELS)


def test_wrong_kernels_are_disabled_with_a_warning():
    wrong_gemv = lambda x, b, i: kernels.KERNELS["q2_k_gemv"].reference(x, b, i) * 1.001  # noqa: E731
    with structlog.testing.capture_logs() as logged:
        results = kernels.verify_and_enable({"sinkhorn": _wrong_sinkhorn, "q2_k_gemv": wrong_gemv,
                                             "iq2_xxs_gemv": _raising})
    status = {r.name: r for r in results}
    assert {name: r.status for name, r in status.items()} == {n: "failed" for n in kernels.KERNELS}
    assert "RuntimeError" in status["iq2_xxs_gemv"].detail
    assert "exceeds" in status["sinkhorn"].detail
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
    comb = deepseek4_ops.sinkhorn(logits, 20, 1e-6)
    S = mx.array(rng.standard_normal((3, 4, 8)).astype(np.float32))
    from ds4_core.backend import Weight

    w = lambda a: Weight("w", "F32", a.shape, mx.array(a))  # noqa: E731
    fn, scale, base = w(rng.standard_normal((24, 32)).astype(np.float32)), w(np.ones(3, np.float32)), \
        w(np.zeros(24, np.float32))
    deepseek4_ops.hc_pre(S, fn, scale, base, 20, 1e-6, 1e-6)
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


def test_kernel_sources_ship_with_the_package():
    for name in kernels.KERNELS:
        source = kernels._source(name)
        assert "thread_position_in_grid" in source


def test_metal_self_test_command_reports_json():
    from ds4_core.cli import cli

    result = CliRunner().invoke(cli, ["metal-self-test", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    assert [r["kernel"] for r in rows] == list(kernels.KERNELS)
    assert {r["status"] for r in rows} == {"skipped"}


def test_backend_runs_the_self_test_at_start():
    from ds4_backend_metal.backend import MetalBackend

    backend = MetalBackend()
    assert [r.name for r in backend.kernel_checks] == list(kernels.KERNELS)
