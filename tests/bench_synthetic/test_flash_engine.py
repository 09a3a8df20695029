"""The whole-model synthetic Flash of ``ds4 bench`` built without a file: on the numpy backend it is, bit for bit, the
model that ``Engine`` loads from the file ``--write-gguf`` writes with the same seed; its loader checks names, shapes
and types as a file's would."""

from __future__ import annotations

import numpy as np
import pytest
from ds4_bench.flash_engine import PlanWeights, backend_ops, build_flash, prefill
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
