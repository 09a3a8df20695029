"""``ds4 bench`` without a GPU: its help and option errors, and the GLM 5.3 Flash / Qwen3.8 weight plans, whose
sizes are checked against the published ds4 GGUF files."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from ds4_core.cli import cli
from ds4_core.quants import tensor_nbytes

MODELS = ("deepseek4-flash", "glm53-flash", "qwen38-flash")


def test_help_lists_the_three_models():
    result = CliRunner().invoke(cli, ["bench", "--help"])
    assert result.exit_code == 0, result.output
    for name in MODELS:
        assert name in result.output
    assert "DS4_CUDA_INT8=0" in result.output and "DS4_CUDA_PREFILL=32" in result.output


def test_unknown_model_is_a_clear_usage_error():
    result = CliRunner().invoke(cli, ["bench", "--synthetic", "llama3-70b"])
    assert result.exit_code == 2
    assert "Invalid value for '--synthetic'" in result.output and "glm53-flash" in result.output


def test_recipe_the_model_lacks_is_a_clear_usage_error():
    result = CliRunner().invoke(cli, ["bench", "--synthetic", "qwen38-flash", "--recipe", "mxfp4"])
    assert result.exit_code == 2
    assert "qwen38-flash has the recipes q2, q4, not mxfp4" in result.output


def test_whole_model_timing_asked_of_another_model_is_a_clear_usage_error():
    result = CliRunner().invoke(cli, ["bench", "--synthetic", "glm53-flash", "--engine"])
    assert result.exit_code == 2
    assert "the whole-model timing is built for deepseek4-flash only, not glm53-flash" in result.output


def test_cli_recipes_match_the_models():
    from ds4_bench import plugin, synthetic_deepseek4, synthetic_glm53, synthetic_qwen38

    assert set(plugin.MODELS["deepseek4-flash"]) == set(synthetic_deepseek4.MODEL.recipes)
    assert set(plugin.MODELS["glm53-flash"]) == set(synthetic_glm53.MODEL.recipes) == set(synthetic_glm53.RECIPES)
    assert set(plugin.MODELS["qwen38-flash"]) == set(synthetic_qwen38.MODEL.recipes) == set(synthetic_qwen38.RECIPES)


@pytest.mark.parametrize("model", ["glm53-flash", "qwen38-flash"])
def test_without_a_gpu_the_new_models_say_why_in_one_line(model):
    from ds4_backend_cuda.probe import probe

    if probe()[0]:
        pytest.skip("a usable GPU is present: ds4 bench would run")
    proc = subprocess.run([sys.executable, "-m", "ds4_core.cli", "bench", "--synthetic", model, "--layers", "1"],
                          capture_output=True, text=True, env=dict(os.environ), timeout=120)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: ds4 bench measures the CUDA backend")


def _names(plan) -> list[str]:
    return [item.name for item in plan]


def test_glm53_plan_follows_the_layer_schedule():
    from ds4_bench.synthetic_glm53 import MODEL

    names = _names(MODEL.plan("q2", 45))
    assert sum(n.endswith(".attn_q_a") for n in names) == 11  # DSA at 3, 7, ..., 43
    assert sum(n.endswith(".kda_q") for n in names) == 34
    assert sum(n.endswith(".ffn_gate") for n in names) == 3  # dense layers 0-2
    assert sum(n.endswith(".ffn_exps") for n in names) == 42
    assert "blk.3.indexer.pool_gate" in names and "blk.4.kda_beta" in names
    assert names[-1] == "output"


def test_qwen38_plan_follows_the_layer_schedule():
    from ds4_bench.synthetic_qwen38 import MODEL

    plan = MODEL.plan("q2", 48)
    names = _names(plan)
    assert sum(n.endswith(".attn_q") for n in names) == 12  # gated attention at 3, 7, ..., 47
    assert sum(n.endswith(".attn_qkv") for n in names) == 36
    assert [n for n in names if "ple_" in n] == ["blk.1.ple_key", "blk.1.ple_value"]
    assert names[-3:] == ["output_hc_down", "output_hc_up", "output"]
    experts = [item for item in plan if item.name.endswith("ffn_exps")]
    assert len(experts) == 48 and {e.down_cols for e in experts} == {768}  # Q2_K rows padded from 640
    assert {e.down_cols for e in MODEL.plan("q4", 48) if e.name.endswith("ffn_exps")} == {640}  # MXFP4


# Published ds4 sizes: GLM-5.3-Flash Q2 "90 GiB", Q4 "178 GiB" (file); Qwen3.8 Q2 "41.73 GiB of main/MTP weights",
# Q4K "69.74 GiB for resident weights". The plans hold every layer but not the token embedding or the MTP block,
# added here as one more attention + MoE layer.
@pytest.mark.parametrize(("module", "recipe", "published_gib", "mtp_after"), [
    ("synthetic_glm53", "q2", 90.0, 44), ("synthetic_glm53", "q4", 178.0, 44),
    ("synthetic_qwen38", "q2", 41.73, 48), ("synthetic_qwen38", "q4", 69.74, 48)])
def test_resident_weights_match_the_published_files(module, recipe, published_gib, mtp_after):
    import importlib

    from ds4_bench.synthetic_plan import resident_bytes

    mod = importlib.import_module(f"ds4_bench.{module}")
    model, shapes = mod.MODEL, mod.GLM53_FLASH if module.endswith("glm53") else mod.QWEN38_FLASH
    mtp = resident_bytes(model.plan(recipe, mtp_after)) - resident_bytes(model.plan(recipe, mtp_after - 1))
    embed = tensor_nbytes("Q8_0", (shapes["vocab"], shapes["hidden"]))
    total = (resident_bytes(model.plan(recipe, model.layers)) + mtp + embed) / 2**30
    assert 0.95 * published_gib < total < 1.01 * published_gib


def test_fewer_layers_fit_when_memory_is_short():
    from ds4_bench.synthetic_glm53 import MODEL
    from ds4_bench.synthetic_plan import MEMORY_MARGIN, fitting_layers, resident_bytes

    assert fitting_layers(MODEL, "q2", 139 * 2**30) == 45
    n = fitting_layers(MODEL, "q4", 139 * 2**30)
    assert 1 <= n < 45
    assert resident_bytes(MODEL.plan("q4", n)) <= 139 * 2**30 - MEMORY_MARGIN < resident_bytes(MODEL.plan("q4", n + 1))


def test_bench_model_file_end_to_end_on_numpy():
    from importlib import resources

    model = Path(str(resources.files("ds4_model_deepseek4").joinpath("data", "tiny-deepseek4.gguf")))
    result = CliRunner().invoke(cli, ["bench", "-m", str(model), "--backend", "numpy", "--prompt-tokens", "16",
                                      "--decode-tokens", "4", "--repeats", "3", "--json"])
    assert result.exit_code == 0, result.output
    r = json.loads(result.stdout[result.stdout.index("{"):])
    assert r["backend"] == "numpy" and r["prompt_tokens"] == 16 and r["decode_tokens"] == 4
    runs = r["prefill_seconds"]
    assert len(runs) == 3 and r["prefill_tokens_per_s"] == pytest.approx(16 / sorted(runs)[1])
    assert r["eager_decode_tokens_per_s"] > 0
    assert "graph_decode_tokens_per_s" not in r  # numpy records no graphs
    assert r["memory_after_load"] == r["memory_after_prefill"] == {}  # numpy counts no device memory
    assert r["context"] == 22 and r["state_bytes"] > 0 and r["state_bytes_per_1k_tokens"] > 0


def test_bench_model_file_reports_the_memory_the_metal_backend_holds():
    """MLX counts its arrays (on Linux, on its CPU device): the weights after the load against the file's tensors,
    and what the backend holds after the prefill with its peak."""
    from importlib import resources

    pytest.importorskip("mlx.core")
    model = Path(str(resources.files("ds4_model_deepseek4").joinpath("data", "tiny-deepseek4.gguf")))
    # a process of its own: MLX counts every array of the process, and the other tests' would count too
    result = subprocess.run([sys.executable, "-m", "ds4_core.cli", "bench", "-m", str(model), "--backend", "metal",
                             "--prompt-tokens", "16", "--decode-tokens", "2", "--repeats", "1"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    weights = re.search(r"weights on the device ([\d.]+) GB for ([\d.]+) GB of tensors in the file \(([\d.]+)x\)",
                        result.stdout)
    assert weights, result.stdout
    ratio = float(weights[3])
    assert 1.0 <= ratio < 1.25  # raw blocks and a few float32 constants, no dequantized copies
    held = re.search(r"memory the backend holds: ([\d.]+) GB after the prefill \(peak so far ([\d.]+) GB\)",
                     result.stdout)
    assert held and float(held[2]) >= float(held[1]) >= float(weights[1]), result.stdout


def test_measurement_report_gives_the_whole_device_where_the_backend_knows_it(capsys):
    from ds4_bench.engine_decode import print_measurement

    gb = 10**9
    r = {"model": "m.gguf", "backend": "cuda", "prompt_tokens": 8, "prefill_tokens_per_s": 100.0,
         "prefill_seconds": [0.08], "file_tensor_bytes": 4 * gb, "decode_tokens": 4,
         "eager_decode_tokens_per_s": 10.0, "graph_decode_tokens_per_s": 50.0, "graph_replayed": True,
         "state_bytes": 2**20, "context": 14, "state_bytes_per_1k_tokens": 2**20, "numerics": {},
         "memory_after_load": {"used": 4 * gb + 4 * 10**6, "reserved": 5 * gb, "free": 70 * gb, "total": 80 * gb},
         "memory_after_prefill": {"used": 4 * gb, "reserved": 6 * gb, "free": 73 * gb, "total": 80 * gb},
         "memory_after_graph_decode": {"used": 4 * gb, "reserved": 6 * gb, "free": 72.5 * gb, "total": 80 * gb}}
    print_measurement(r)
    out = capsys.readouterr().out.splitlines()
    assert "  weights on the device 4.004 GB for 4.000 GB of tensors in the file (1.001x)" in out
    assert out[-1] == ("  device memory in use (all allocators and the context): 7.000 GB after the prefill, "
                       "7.500 GB after the graph decode")


def test_measurement_report_counts_weights_kept_in_host_memory(capsys):
    """Where a backend keeps weights in host memory (CUDA's routed experts on a device too small), the weights line
    names both places and the ratio counts both against the file."""
    from ds4_bench.engine_decode import print_measurement

    gb = 10**9
    r = {"model": "m.gguf", "backend": "cuda", "prompt_tokens": 8, "prefill_tokens_per_s": 100.0,
         "prefill_seconds": [0.08], "file_tensor_bytes": 9 * gb, "decode_tokens": 4,
         "eager_decode_tokens_per_s": 10.0, "state_bytes": 2**20, "context": 14, "state_bytes_per_1k_tokens": 2**20,
         "memory_after_load": {"used": 7 * gb, "host": 2 * gb + 9 * 10**6, "free": 1 * gb, "total": 8 * gb},
         "memory_after_prefill": {"used": 7 * gb, "free": 0, "total": 8 * gb}}
    print_measurement(r)
    out = capsys.readouterr().out.splitlines()
    assert ("  weights on the device 7.000 GB and in host memory 2.009 GB for 9.000 GB of tensors in the file "
            "(1.001x)") in out


def test_bench_model_file_must_exist(tmp_path):
    result = CliRunner().invoke(cli, ["bench", "-m", str(tmp_path / "missing.gguf")])
    assert result.exit_code != 0 and "does not exist" in result.output


def test_bench_refuses_no_repeats():
    result = CliRunner().invoke(cli, ["bench", "--repeats", "0"])
    assert result.exit_code == 2 and "--repeats" in result.output


def test_measurement_report_names_the_arithmetic(capsys):
    """A backend's arithmetic choices head the report (the CUDA backend's int8 decode and 16-bit prefill); the
    reference arithmetic adds no line."""
    from ds4_bench.engine_decode import print_measurement

    from ds4_core.backends.numpy import NumpyBackend

    r = {"model": "m.gguf", "backend": "cuda", "prompt_tokens": 8, "prefill_tokens_per_s": 100.0,
         "prefill_seconds": [0.09, 0.08, 0.07],
         "memory_after_load": {}, "decode_tokens": 4, "eager_decode_tokens_per_s": 10.0, "state_bytes": 2**20,
         "context": 14, "state_bytes_per_1k_tokens": 2**20, "memory_after_prefill": {},
         "numerics": {"decode activations": "int8 (DS4_CUDA_INT8=0: float32)", "prefill matmuls": "fp16"}}
    print_measurement(r)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "m.gguf on cuda: prefill 8 tokens at 100.0 t/s (median of 3: 70.00-90.00 ms a prefill)"
    assert lines[1] == "  arithmetic: decode activations int8 (DS4_CUDA_INT8=0: float32); prefill matmuls fp16"
    assert NumpyBackend().numerics() == {}
    print_measurement({**r, "numerics": NumpyBackend().numerics()})
    assert "arithmetic" not in capsys.readouterr().out
