"""The synthetic decode step of ``ds4 bench`` at toy shapes: CUDA-graph replay gives the eager results."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = pytest.mark.gpu

TOY = {"hidden": 256, "layers": 3, "vocab": 1000, "q_lora": 64, "heads": 4, "head_dim": 64, "o_groups": 2,
       "o_lora": 32, "experts": 8, "k": 3, "inter": 256, "hc": 4, "index_heads": 4, "index_dim": 32}


@pytest.mark.parametrize("recipe", ["q2", "q4", "mxfp4"])
def test_graph_replay_equals_eager_and_counts_bytes(cuda_backend, recipe):
    import cupy as cp
    from ds4_bench.synthetic import build_decode_step

    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        step = build_decode_step(recipe, TOY["layers"], TOY)
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
    assert step.nbytes > TOY["vocab"] * TOY["hidden"]  # the head alone
