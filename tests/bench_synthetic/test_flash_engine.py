"""The whole-model synthetic Flash of ``ds4 bench`` built without a file: on the numpy backend it is, bit for bit, the
model that ``Engine`` loads from the file ``--write-gguf`` writes with the same seed; its loader checks names, shapes
and types as a file's would."""

from __future__ import annotations

import numpy as np
import pytest
from ds4_bench.flash_engine import PlanWeights, backend_ops, build_flash, prefill, print_engine
from ds4_bench.flash_gguf import flash_config, tensor_bytes, tensor_plan, write_flash_gguf
from test_flash_gguf import TOY, TOY_LAYERS

from ds4_core.engine import Engine
from ds4_core.errors import ModelConfigError

SEED = 5


@pytest.fixture(scope="module")
def file_engine(tmp_path_factory):
    path = write_flash_gguf(tmp_path_factory.mktemp("flash") / "toy.gguf", TOY_LAYERS, seed=SEED, progress=False,
                            shapes=TOY)
    engine = Engine.load(path, backend="numpy", ctx=64)
    yield engine
    engine.close()


def test_built_in_memory_it_is_the_model_of_the_written_file(file_engine):
    backend, ops = backend_ops("numpy")
    loaded = []
    model = build_flash(backend, ops, TOY_LAYERS, seed=SEED, shapes=TOY, progress=loaded.append)
    plan = tensor_plan(flash_config(TOY_LAYERS, TOY), "q2")
    assert sum(loaded) == sum(t.nbytes for t in plan)  # every planned tensor, once
    ids = (np.arange(37, dtype=np.int32) * 7) % TOY["vocab_size"]
    session = file_engine.new_session()
    want = session.feed(ids, logits="last")
    state = model.new_state(64)
    np.testing.assert_array_equal(prefill(model, state, ids, len(ids)), want)
    np.testing.assert_array_equal(model.forward(ids[:1], state), session.feed(ids[:1]))  # a decode step


def test_layers_of_one_role_share_their_bytes_and_roles_differ():
    cfg = flash_config(TOY_LAYERS, TOY)
    t = {x.name: x for x in tensor_plan(cfg, "q2")}
    q_b = [tensor_bytes(t[f"blk.{i}.attn_q_b.weight"], cfg, SEED) for i in (0, 3)]
    np.testing.assert_array_equal(q_b[0], q_b[1])
    assert q_b[0].size == t["blk.0.attn_q_b.weight"].nbytes
    assert not np.array_equal(tensor_bytes(t["blk.0.attn_q_a.weight"], cfg, SEED)[:1024], q_b[0][:1024])
    assert not np.array_equal(tensor_bytes(t["blk.0.attn_q_b.weight"], cfg, SEED + 1), q_b[0])


@pytest.mark.parametrize("ask,match", [
    (("blk.0.nonexistent.weight", None, None), "has no tensor 'blk.0.nonexistent.weight'"),
    (("blk.0.attn_q_b.weight", (3, 4), None), r"shape \(256, 64\) in the synthetic Flash, \(3, 4\) asked"),
    (("blk.0.attn_q_b.weight", None, ("F16",)), r"Q8_0 in the synthetic Flash, one of \['F16'\] asked"),
])
def test_loader_refuses_what_the_plan_does_not_hold(ask, match):
    backend, _ = backend_ops("numpy")
    weights = PlanWeights(flash_config(TOY_LAYERS, TOY), "q2", backend, SEED)
    with pytest.raises(ModelConfigError, match=match):
        weights.get(*ask)
    assert weights.get("blk.0.attn_q_b.weight", (256, 64), ("Q8_0",)).shape == (256, 64)  # and it goes on


def test_the_report_gives_each_prefill_median_with_its_spread_and_says_which_steps_skip_the_indexer(capsys):
    """A whole-model prefill is the median of a few runs; the report gives their range beside it, so that a slow
    episode of the machine shows as a wide spread. A decode step whose CSA rows are all visible says so."""
    runs = [0.2561, 0.2546, 0.3801]
    report = {"layers": 43, "full_layers": 43, "weights_device_bytes": 86.72e9, "weights_plan_bytes": 86.71e9,
              "seconds": 66.0, "prefill_chunk": 2048, "decode": [{
                  "context": context, "all_visible": context <= 2048, "graph_s": 4.82e-3, "tokens_per_s": 207.5,
                  "graph_fraction": 0.467, "bytes_per_step": 9.594e9, "eager_s": 0.1258, "replay_vs_eager": 0.0,
                  "device_used_bytes": 90.3e9} for context in (2048, 32768)],
              "prefill": [{"tokens": 2048, "seconds": float(np.median(runs)), "runs": runs,
                           "tokens_per_s": 2048 / float(np.median(runs)), "fraction_of_matmul_roof": 0.268,
                           "device_used_bytes": 90.3e9}]}
    print_engine(report)
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("  decode at context   2048: graph replay   4.820 ms a step (207.5 t/s of GPU time)")
    assert lines[1].endswith("GB; every complete CSA row visible, so no index queries or scores")
    assert lines[2].startswith("  decode at context  32768") and lines[2].endswith("in use 90.3 GB")
    assert lines[3] == ("  prefill   2048 tokens in chunks of 2048:    256.1 ms (median of 3: 254.6-380.1 ms), "
                        "7997 t/s, 26.8% of the matmul roof by its weight matmuls; device memory in use 90.3 GB")


def test_the_bench_and_the_model_agree_on_which_steps_leave_the_indexer_out():
    """The bench's numerator leaves the indexer's reads out exactly where the model's recorded step does."""
    from ds4_bench.synthetic_deepseek4 import FLASH, all_visible

    backend, ops = backend_ops("numpy")
    model = build_flash(backend, ops, TOY_LAYERS, seed=SEED, shapes=TOY, progress=lambda n: None)
    shapes = {**FLASH, "index_topk": TOY["index_topk"]}
    assert [model.all_visible(c) for c in range(40)] == [all_visible(c, shapes) for c in range(40)]
    assert model.all_visible(18) and not model.all_visible(19)  # top-4 of rows of 4 tokens: (4 + 1) * 4 - 1
