"""The synthetic models of ``ds4 bench`` without a GPU: weight bytes, state bytes per context and prefill FLOPs of
the three plans, each checked against a count written here from the spec's dimensions and gguf-py's block table."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ds4_core.cli import cli


def nbytes(qtype: str, rows: int, cols: int) -> int:
    qk, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    assert cols % qk == 0
    return rows * cols // qk * size


def _models():
    from ds4_bench import synthetic_deepseek4, synthetic_glm53, synthetic_qwen38

    return synthetic_deepseek4.MODEL, synthetic_glm53.MODEL, synthetic_qwen38.MODEL


def test_every_cli_model_has_a_plan_module_with_its_recipes():
    import importlib

    from ds4_bench import plugin

    assert set(plugin.MODELS) == set(plugin.MODEL_MODULES)
    for name, module in plugin.MODEL_MODULES.items():
        mod = importlib.import_module(f"ds4_bench.{module}")
        assert set(plugin.MODELS[name]) == set(mod.MODEL.recipes) == set(mod.RECIPES)


def test_context_option_is_listed_and_checked():
    runner = CliRunner()
    assert "--context" in runner.invoke(cli, ["bench", "--help"]).output
    result = runner.invoke(cli, ["bench", "--context", "0"])
    assert result.exit_code == 2 and "--context" in result.output


def test_deepseek4_weight_bytes_follow_the_spec():
    """Spec deepseek_v4.md §1.1: 43 layers; layers 0-1 raw window only, then CSA (even) and HCA (odd)."""
    from ds4_bench.synthetic_deepseek4 import MODEL
    from ds4_bench.synthetic_plan import read_bytes

    def layer(csa: bool | None, experts: tuple[str, str]) -> int:
        gate_up, down = experts
        total = (2 * nbytes("F16", 24, 16384) + nbytes("Q8_0", 1024, 4096) + nbytes("Q8_0", 32768, 1024)
                 + nbytes("Q8_0", 512, 4096) + nbytes("Q8_0", 8 * 1024, 4096) + nbytes("Q8_0", 4096, 8192)
                 + nbytes("F16", 256, 4096) + 3 * nbytes("Q8_0", 2048, 4096)
                 + 6 * (2 * nbytes(gate_up, 2048, 4096) + nbytes(down, 4096, 2048)))
        if csa is True:
            total += (2 * nbytes("F16", 1024, 4096) + nbytes("F16", 8192, 1024) + nbytes("F16", 64, 4096)
                      + 2 * nbytes("F16", 256, 4096))
        elif csa is False:
            total += 2 * nbytes("F16", 512, 4096)
        return total

    head = nbytes("F16", 4, 16384) + nbytes("Q8_0", 129280, 4096)
    for recipe, experts in {"q2": ("IQ2_XXS", "Q2_K"), "q4": ("Q4_K", "Q4_K"), "mxfp4": ("MXFP4", "MXFP4")}.items():
        want = 2 * layer(None, experts) + 21 * layer(True, experts) + 20 * layer(False, experts) + head
        assert read_bytes(MODEL.plan(recipe, 43)) == want


@pytest.mark.parametrize(("recipe", "layers", "gb"), [("q2", 43, 9.55), ("q2", 8, 2.19), ("q4", 30, 8.09),
                                                      ("mxfp4", 30, 7.94)])
def test_deepseek4_weight_bytes_are_those_reported_before(recipe, layers, gb):
    """The weight GB/step recorded in docs/performance.md by the earlier DeepSeek-only bench."""
    from ds4_bench.synthetic_deepseek4 import MODEL
    from ds4_bench.synthetic_plan import read_bytes

    assert round(read_bytes(MODEL.plan(recipe, layers)) / 1e9, 2) == gb


@pytest.mark.parametrize(("index", "gb"), [(1, 2.56), (2, 1.62)])
def test_glm_and_qwen_weight_bytes_are_those_reported_before(index, gb):
    from ds4_bench.synthetic_plan import read_bytes

    assert round(read_bytes(_models()[index].plan("q2", 8)) / 1e9, 2) == gb


def _deepseek4_state(context: int) -> int:
    """Spec §9.1: raw ring 128×512 per layer; HCA rows ⌊ctx/128⌋×512; CSA indexer rows ⌊ctx/4⌋×128 (scored only
    past 512 complete rows, §5.5) and the top-512 (index_topk) compressed rows ×512; float32."""
    values = 43 * min(context, 128) * 512
    values += 21 * ((context // 4 * 128 if (context + 1) // 4 > 512 else 0) + min(context // 4, 512) * 512)
    values += 20 * (context // 128 * 512)
    return 4 * values


def _glm53_state(context: int, selected: int) -> int:
    """Spec §7: 34 KDA layers of 64×128×128 fp32 state; 11 DSA layers reading ``selected`` latent rows ×512 and
    the pooled indexer keys ⌊ctx/4⌋×128."""
    return 4 * (34 * 64 * 128 * 128 + 11 * (selected * 512 + context // 4 * 128))


def _qwen38_state(context: int, selected: int) -> int:
    """Spec §5: 36 delta-net layers of 48×128×128 fp32 state; 12 attention layers reading K and V (2 kv heads ×
    256 each) of ``selected`` tokens and one block key ×128 per 4 tokens."""
    return 4 * (36 * 48 * 128 * 128 + 12 * (selected * 2 * 2 * 256 + context // 4 * 128))


@pytest.mark.parametrize("context", [1, 100, 2048, 2050, 2051, 2052, 32768])
def test_state_bytes_per_context_follow_the_spec(context):
    from ds4_bench.synthetic_plan import read_bytes

    deepseek, glm, qwen = _models()
    # Pooled / block selection: dense while at most 2048 + 3 tokens are visible, then 2048 + the open tail.
    selected = context if context <= 2051 else 2048 + context % 4
    assert read_bytes(deepseek.state(43, context)) == _deepseek4_state(context)
    assert read_bytes(glm.state(45, context)) == _glm53_state(context, selected)
    assert read_bytes(qwen.state(48, context)) == _qwen38_state(context, selected)


def test_state_reads_name_the_layers_they_belong_to():
    deepseek, glm, qwen = _models()
    names = [item.name for item in deepseek.state(43, 32768)]
    assert "blk.0.kv_window" in names and "blk.0.indexer_keys" not in names
    assert {"blk.2.indexer_keys", "blk.2.compressed_rows_selected", "blk.3.compressed_rows"} <= set(names)
    assert not [n for n in names if n.startswith("blk.1.compressed")]
    assert [item.name for item in deepseek.state(3, 2051) if item.name.startswith("blk.2.")] == [
        "blk.2.kv_window", "blk.2.indexer_keys", "blk.2.compressed_rows_selected"]
    assert [item.name for item in deepseek.state(3, 2050) if item.name.startswith("blk.2.")] == [
        "blk.2.kv_window", "blk.2.compressed_rows_selected"]  # every complete row visible: no keys scored
    assert not [item for item in deepseek.state(4, 100) if item.name == "blk.3.compressed_rows"]  # < 128 tokens
    assert sum(item.name.endswith("kda_state") for item in glm.state(45, 2048)) == 34
    assert sum(item.name.endswith("kv_selected") for item in qwen.state(48, 2048)) == 12


def _dense_params_per_token(model, recipe: str) -> int:
    """Σ rows·cols of every decoder-layer matrix (the head excluded), from the plan's own matrices."""
    from ds4_bench.synthetic_plan import Matrix

    return sum(m.groups * m.rows * m.cols for m in model.plan(recipe, model.layers)
               if isinstance(m, Matrix) and m.name.startswith("blk."))


def test_prefill_plan_covers_every_layer_matrix_once_per_call():
    from ds4_bench.synthetic_plan import prefill_plan

    for model in _models():
        dense, routed = prefill_plan(model.plan("q2", model.layers))
        assert sum(m.flops(1) * m.calls for m in dense) == 2 * _dense_params_per_token(model, "q2")
        assert len({(m.qtype, m.rows, m.cols) for m in dense}) == len(dense)
        assert not any(name.startswith(("blk.", "output")) for m in dense for name in m.names)
        assert len(routed) == 1


def test_qwen38_prefill_flops_follow_the_spec():
    """Spec qwen38.md §2.1, §2.4: per-token multiply-adds of the 48 layers' matrices and 10 of 512 experts."""
    from ds4_bench.synthetic_plan import prefill_plan
    from ds4_bench.synthetic_qwen38 import MODEL

    D, hc = 2560, 4 * 2560
    site = 2 * 320 * hc + 4 * hc
    common = 2 * site + 512 * D + D + 3 * 640 * D
    delta_net = (2 * 16 * 128 + 48 * 128) * D + 48 * 128 * D + 2 * 48 * D + D * 48 * 128
    attention = 2 * 24 * 256 * D + 2 * 2 * 256 * D + 4 * 128 * D + 128 * D + D * 24 * 256
    ple = hc * D + D * D
    want = 48 * common + 36 * delta_net + 12 * attention + ple
    for recipe in ("q2", "q4"):
        dense, (routed,) = prefill_plan(MODEL.plan(recipe, 48))
        assert sum(m.flops(7) * m.calls for m in dense) == 2 * 7 * want
        assert routed.calls == 48 and routed.flops(7) == 2 * 7 * 10 * 3 * 640 * D
    assert prefill_plan(MODEL.plan("q2", 48))[1][0].experts.down_cols == 768  # padded rows, not counted as work


def test_glm53_prefill_flops_follow_the_spec():
    """Spec glm5.md §2.2: 3 dense + 42 MoE layers, 11 DSA + 34 KDA layers, 8 of 288 experts."""
    from ds4_bench.synthetic_glm53 import MODEL
    from ds4_bench.synthetic_plan import prefill_plan

    D, hc = 4096, 4 * 4096
    kda = 3 * 8192 * D + 2 * (128 * D + 8192 * 128) + 64 * D + D * 8192
    dsa = (1536 * D + 16384 * 1536 + 512 * D + 4096 * 1536 + 2 * 128 * D + 32 * D
           + 2 * 64 * 512 * 256 + D * 16384)
    want = 45 * 2 * 24 * hc + 34 * kda + 11 * dsa + 3 * 3 * 12288 * D + 42 * (288 * D + 3 * 2048 * D)
    dense, (routed,) = prefill_plan(MODEL.plan("q2", 45))
    assert sum(m.flops(1) * m.calls for m in dense) == 2 * want
    assert routed.calls == 42 and routed.flops(1) == 2 * 8 * 3 * 2048 * D


def test_deepseek4_prefill_matches_the_earlier_list():
    """The shapes and calls per model the DeepSeek-only bench timed (names now the GGUF tensors')."""
    from ds4_bench.synthetic_deepseek4 import MODEL
    from ds4_bench.synthetic_plan import prefill_plan

    dense, (routed,) = prefill_plan(MODEL.plan("q2", 43))
    calls = {}
    for m in dense:
        calls[m.qtype, m.rows, m.cols] = m.calls
    assert calls == {("F16", 24, 16384): 86, ("Q8_0", 1024, 4096): 43 + 8 * 43, ("Q8_0", 32768, 1024): 43,
                     ("Q8_0", 512, 4096): 43, ("F16", 1024, 4096): 42, ("F16", 512, 4096): 40,
                     ("F16", 8192, 1024): 21, ("F16", 64, 4096): 21, ("F16", 256, 4096): 42 + 43,
                     ("Q8_0", 4096, 8192): 43, ("Q8_0", 2048, 4096): 86, ("Q8_0", 4096, 2048): 43}
    assert routed.calls == 43 and routed.flops(2048) == 2 * 2048 * 6 * 3 * 2048 * 4096


def test_deepseek4_fits_in_an_h200_with_q2_and_not_with_q4():
    from ds4_bench.synthetic_deepseek4 import MODEL
    from ds4_bench.synthetic_plan import fitting_layers

    assert fitting_layers(MODEL, "q2", 139 * 2**30) == 43
    assert 20 < fitting_layers(MODEL, "q4", 139 * 2**30) < 43


@pytest.mark.parametrize("context", [2048, 2050, 2051, 32768])
def test_a_flash_step_reads_the_indexer_queries_only_once_it_has_rows_to_choose(context):
    """The index queries' q_b (1024 → 64×128) and head weights (4096 → 64), F16, of the 21 CSA layers: read only
    once the step's position (the context) has more than 512 complete rows of 4 tokens: from 2051."""
    from ds4_bench.synthetic_deepseek4 import decode_plan
    from ds4_bench.synthetic_plan import read_bytes

    full = read_bytes(decode_plan("q2", 43))
    indexer = 21 * 2 * (8192 * 1024 + 64 * 4096)
    assert read_bytes(decode_plan("q2", 43, context=context)) == full - (indexer if context < 2051 else 0)
