"""The GLM 5.3 Flash and Qwen3.8 decode steps of ``ds4 bench`` at toy shapes: CUDA-graph replay gives the eager
results, and the bytes counted are those of the matrices built (sizes from gguf-py's block table)."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

GLM_TOY = {"hidden": 256, "layers": 4, "vocab": 1000, "dense_layers": 1, "dense_inter": 512, "q_lora": 64,
           "kv_lora": 64, "heads": 4, "head_dim": 64, "index_heads": 4, "index_dim": 32, "linear_heads": 4,
           "linear_dim": 32, "experts": 8, "k": 3, "inter": 256, "hc": 4}
# inter 192: Q2_K down rows are padded to 256 columns, as the real 640 are to 768.
QWEN_TOY = {"hidden": 256, "layers": 4, "vocab": 1000, "heads": 2, "kv_heads": 1, "head_dim": 64, "key_heads": 2,
            "value_heads": 4, "key_dim": 32, "value_dim": 32, "experts": 8, "k": 3, "inter": 192,
            "shared_inter": 192, "hc": 4, "hc_rank": 32, "index_heads": 2, "index_dim": 32, "ple_layer": 1,
            "ple_dim": 256}
CASES = [("synthetic_glm53", GLM_TOY, "q2"), ("synthetic_glm53", GLM_TOY, "q4"),
         ("synthetic_qwen38", QWEN_TOY, "q2"), ("synthetic_qwen38", QWEN_TOY, "q4")]


def _plan(module: str, shapes: dict, recipe: str):
    import importlib

    return importlib.import_module(f"ds4_bench.{module}").decode_plan(recipe, shapes["layers"], shapes)


def _gguf_bytes(qtype: str, rows: int, cols: int) -> int:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    qk, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    assert cols % qk == 0
    return rows * cols // qk * size


def _expected_read_bytes(plan) -> int:
    from ds4_bench.synthetic_plan import Matrix

    total = 0
    for item in plan:
        if isinstance(item, Matrix):
            total += _gguf_bytes(item.qtype, item.groups * item.rows, item.cols)
        else:
            total += item.k * (2 * _gguf_bytes(item.gate_up, item.inter, item.hidden)
                               + _gguf_bytes(item.down, item.hidden, item.down_cols))
    return total


@pytest.mark.parametrize(("module", "shapes", "recipe"), CASES)
def test_graph_replay_equals_eager_and_counts_bytes(cuda_backend, module, shapes, recipe):
    import cupy as cp
    from ds4_bench.synthetic_plan import RoutedExperts, build_step, resident_bytes

    plan = _plan(module, shapes, recipe)
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
    weights = [a for launch in step.launches for a in launch.args[:2] if isinstance(a, cp.ndarray)]
    assert sum(w.nbytes for w in weights) == resident_bytes(plan)


def test_decode_results_reports_a_matching_graph(cuda_backend):
    from ds4_bench.synthetic_glm53 import decode_plan
    from ds4_bench.synthetic_plan import SyntheticModel, decode_results, read_bytes

    model = SyntheticModel("toy GLM", GLM_TOY["layers"], {"q2": "toy"},
                           lambda recipe, layers: decode_plan(recipe, layers, GLM_TOY))
    d = decode_results(model, "q2", 2, 3, 1e12)
    assert d["graph_matches_eager"] is True
    assert d["bytes_per_step"] == read_bytes(decode_plan("q2", 2, GLM_TOY))
    assert d["full_model_bytes_per_step"] == read_bytes(decode_plan("q2", 4, GLM_TOY)) > d["bytes_per_step"]
    assert d["graph_s"] > 0 and d["peak_pool_bytes"] > 0
