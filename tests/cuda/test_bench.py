"""The synthetic models of ``ds4 bench`` on the GPU at toy shapes: for each family the decode step (weights and
context state reads) replays as a CUDA graph to the eager results, counts the bytes of the buffers it built (sizes
from gguf-py's block table), and the whole run (decode at two contexts, prefill) reports fractions in (0, 1]."""

from __future__ import annotations

import importlib

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

DEEPSEEK_TOY = {"hidden": 256, "layers": 5, "vocab": 1000, "q_lora": 64, "heads": 4, "head_dim": 64, "o_groups": 2,
                "o_lora": 32, "experts": 8, "k": 3, "inter": 256, "hc": 4, "index_heads": 4, "index_dim": 32,
                "index_topk": 8, "window": 16, "csa_ratio": 4, "hca_ratio": 8}
GLM_TOY = {"hidden": 256, "layers": 5, "vocab": 1000, "dense_layers": 1, "dense_inter": 512, "q_lora": 64,
           "kv_lora": 64, "heads": 4, "head_dim": 64, "index_heads": 4, "index_dim": 32, "index_topk": 16,
           "index_pool": 4, "linear_heads": 4, "linear_dim": 32, "experts": 8, "k": 3, "inter": 256, "hc": 4}
# inter 192: Q2_K down rows are padded to 256 columns, as the real 640 are to 768.
QWEN_TOY = {"hidden": 256, "layers": 5, "vocab": 1000, "heads": 2, "kv_heads": 1, "head_dim": 64, "key_heads": 2,
            "value_heads": 4, "key_dim": 32, "value_dim": 32, "experts": 8, "k": 3, "inter": 192,
            "shared_inter": 192, "hc": 4, "hc_rank": 32, "index_heads": 2, "index_dim": 32, "index_ratio": 4,
            "index_budget": 16, "ple_layer": 1, "ple_dim": 256}
TOYS = {"synthetic_deepseek4": DEEPSEEK_TOY, "synthetic_glm53": GLM_TOY, "synthetic_qwen38": QWEN_TOY}
CASES = [(module, recipe) for module in TOYS for recipe in importlib.import_module(f"ds4_bench.{module}").RECIPES]
#: Contexts past every toy window, pool budget and compression ratio.
CONTEXTS = (40, 203)


def toy_model(module: str):
    from ds4_bench.synthetic_plan import SyntheticModel

    mod, shapes = importlib.import_module(f"ds4_bench.{module}"), TOYS[module]
    return SyntheticModel(f"toy {module}", shapes["layers"], mod.MODEL.recipes,
                          lambda recipe, layers: mod.decode_plan(recipe, layers, shapes),
                          lambda layers, context: mod.state_plan(layers, context, shapes), "toy state")


def _gguf_bytes(qtype: str, rows: int, cols: int) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    qk, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    assert cols % qk == 0
    return rows * cols // qk * size


def _expected_read_bytes(plan) -> int:
    from ds4_bench.synthetic_plan import Matrix, RoutedExperts

    total = 0
    for item in plan:
        if isinstance(item, Matrix):
            total += _gguf_bytes(item.qtype, item.groups * item.rows, item.cols)
        elif isinstance(item, RoutedExperts):
            total += item.k * (2 * _gguf_bytes(item.gate_up, item.inter, item.hidden)
                               + _gguf_bytes(item.down, item.hidden, item.down_cols))
        else:
            total += _gguf_bytes("F32", item.rows, item.width)
    return total


@pytest.mark.parametrize(("module", "recipe"), CASES)
def test_step_replays_as_a_graph_and_counts_its_bytes(cuda_backend, module, recipe):
    import cupy as cp
    from ds4_bench.synthetic_plan import RoutedExperts, StateRead, resident_bytes
    from ds4_bench.synthetic_run import build_step

    model = toy_model(module)
    plan = model.plan(recipe, model.layers) + model.state(model.layers, CONTEXTS[1])
    assert any(isinstance(item, StateRead) for item in plan)
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        step = build_step(plan)
        step.run()
        eager = [cp.asnumpy(o) for o in step.outputs]
        for o in step.outputs:
            o.fill(np.nan)
        stream.begin_capture()
        step.run()
        graph = stream.end_capture()
        graph.launch(stream)
        stream.synchronize()
        for want, got in zip(eager, step.outputs, strict=True):
            np.testing.assert_array_equal(cp.asnumpy(got), want)
    assert all(np.isfinite(o).all() for o in eager)
    assert len(step.launches) == len(plan) + sum(isinstance(item, RoutedExperts) for item in plan)  # gate/up, down
    assert step.nbytes == _expected_read_bytes(plan)
    buffers = [a for launch in step.launches for a in launch.args[:2] if isinstance(a, cp.ndarray)]
    assert sum(b.nbytes for b in buffers) == resident_bytes(plan)


@pytest.mark.parametrize("module", list(TOYS))
def test_run_reports_graph_equal_to_eager_and_fractions_in_range(cuda_backend, module, capsys):
    from ds4_bench.synthetic_plan import prefill_plan, read_bytes
    from ds4_bench.synthetic_run import print_report, run_model

    model = toy_model(module)
    r = run_model(model, "q2", layers=4, repeats=3, contexts=CONTEXTS, prefill_tokens=(64,))
    d = r["decode"]
    assert [s["context"] for s in d["steps"]] == [0, *CONTEXTS]
    for s in d["steps"]:
        assert s["graph_matches_eager"] is True
        assert 0 < s["eager_fraction"] <= 1 and 0 < s["graph_fraction"] <= 1
        state = read_bytes(model.state(4, s["context"])) if s["context"] else 0
        assert s["bytes_per_step"] == read_bytes(model.plan("q2", 4)) + state == s["weight_bytes"] + s["state_bytes"]
        assert s["full_model_bytes_per_step"] > s["bytes_per_step"]
    assert d["steps"][2]["state_bytes"] > d["steps"][1]["state_bytes"] > 0
    dense, routed = prefill_plan(model.plan("q2", model.layers))
    assert len(r["prefill"]["matmuls"]) == len(dense) + len(routed)
    for m in r["prefill"]["matmuls"]:
        assert m["seconds"] > 0 and m["peak_bytes"] > 0 and 0 < m["fraction_of_bf16"] <= 1
    (p,) = r["prefill"]["projection"]
    assert p["tokens"] == 64 and p["tokens_per_s"] > 0 and 0 < p["fraction_of_matmul_roof"] <= 1
    print_report(r)
    out = capsys.readouterr().out
    assert f"context {CONTEXTS[1]:6d}" in out and "replay == eager: True" in out and "projected prefill" in out
    assert set(r["numerics"]) == {"decode activations", "prefill matmuls"}
    assert "  arithmetic: decode activations float32" in out  # the GPU tests pin the float32 paths


def test_bench_times_the_whole_flash_through_its_graph(cuda_backend):
    import json

    from click.testing import CliRunner
    from ds4_bench.flash_gguf import flash_config, tensor_plan

    from ds4_core.cli import cli

    result = CliRunner().invoke(cli, ["bench", "--synthetic", "deepseek4-flash", "--layers", "1", "--context", "300",
                                      "--prefill-tokens", "256", "--repeats", "3", "--json"])
    assert result.exit_code == 0, result.output
    e = json.loads(result.stdout[result.stdout.index("{"):])["engine"]
    assert e["layers"] == 1 and e["weights_plan_bytes"] == sum(t.nbytes for t in tensor_plan(flash_config(1), "q2"))
    assert e["weights_device_bytes"] == pytest.approx(e["weights_plan_bytes"], rel=0.02)
    (d,), (p,) = e["decode"], e["prefill"]
    assert d["context"] == 300 and d["replay_vs_eager"] < 1e-3  # the replayed step computes what the eager one does
    assert 0 < d["graph_s"] < d["eager_s"] and 0 < d["graph_fraction"] <= 1
    assert p["tokens"] == 256 and len(p["runs"]) == 3 and 0 < p["fraction_of_matmul_roof"] <= 1
    assert d["device_used_bytes"] > e["weights_device_bytes"]


def test_bench_model_file_on_cuda_reports_the_weights_and_the_whole_device(cuda_backend):
    """``ds4 bench -m`` through Engine on the GPU: the pool holds the file's raw blocks after the load (a few constants
    more), and the device's own count (every allocator and the context) follows the prefill and the graph decode."""
    import json
    import subprocess
    import sys
    from importlib import resources
    from pathlib import Path

    model = Path(str(resources.files("ds4_model_deepseek4").joinpath("data", "tiny-deepseek4.gguf")))
    # a process of its own: CuPy's pool is the process's, and this one's other tests hold arrays in it
    result = subprocess.run([sys.executable, "-m", "ds4_core.cli", "bench", "-m", str(model), "--prompt-tokens", "64",
                             "--decode-tokens", "8", "--repeats", "2", "--json"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    r = json.loads(result.stdout[result.stdout.index("{"):])
    loaded, prefill, decode = r["memory_after_load"], r["memory_after_prefill"], r["memory_after_graph_decode"]
    assert r["file_tensor_bytes"] <= loaded["used"] < 1.25 * r["file_tensor_bytes"]
    for m in (loaded, prefill, decode):
        assert set(m) == {"used", "reserved", "free", "total"} and m["used"] <= m["reserved"]
        assert 0 < m["free"] < m["total"] - m["reserved"]
    assert r["graph_replayed"] is True and r["graph_decode_tokens_per_s"] > 0
