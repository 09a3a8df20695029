"""The GLM 5.2 ops against transformers / torch: the sigmoid group-limited router and the indexer LayerNorm."""

from __future__ import annotations

import numpy as np
import pytest
from ds4_model_glm5.ops import layer_norm, moe_route_sigmoid

from ds4_core.backend import Weight

torch = pytest.importorskip("torch")


def _w(a: np.ndarray) -> Weight:
    return Weight("w", "F32", a.shape, a.astype(np.float32))


@pytest.mark.parametrize(("experts", "groups", "kept", "k", "norm"), [(8, 1, 1, 3, True), (16, 4, 2, 4, True),
                                                                       (12, 3, 1, 2, False)])
def test_router_matches_transformers(experts, groups, kept, k, norm):
    from transformers import GlmMoeDsaConfig
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaTopkRouter

    cfg = GlmMoeDsaConfig(hidden_size=32, n_routed_experts=experts, n_group=groups, topk_group=kept,
                          num_experts_per_tok=k, norm_topk_prob=norm, routed_scaling_factor=2.5)
    router = GlmMoeDsaTopkRouter(cfg)
    rng = np.random.default_rng(experts)
    weight, bias = rng.standard_normal((experts, 32)).astype(np.float32), rng.standard_normal(experts) * 0.3
    x = rng.standard_normal((50, 32)).astype(np.float32)
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(weight))
        router.e_score_correction_bias.copy_(torch.from_numpy(bias))
        _, ref_w, ref_idx = router(torch.from_numpy(x))
    idx, w = moe_route_sigmoid(x @ weight.T, _w(bias), k, 2.5, groups, kept, norm)
    # transformers returns the chosen set unsorted: compare as {expert: weight} per token
    for t in range(len(x)):
        ours = dict(zip(idx[t].tolist(), w[t].tolist(), strict=True))
        theirs = dict(zip(ref_idx[t].tolist(), ref_w[t].tolist(), strict=True))
        assert ours.keys() == theirs.keys()
        np.testing.assert_allclose([ours[e] for e in theirs], list(theirs.values()), rtol=1e-5)


def test_layer_norm_matches_torch():
    rng = np.random.default_rng(0)
    x, w, b = rng.standard_normal((7, 3, 16)) * 3 + 1, rng.standard_normal(16), rng.standard_normal(16)
    ln = torch.nn.LayerNorm(16, eps=1e-6)
    with torch.no_grad():
        ln.weight.copy_(torch.from_numpy(w))
        ln.bias.copy_(torch.from_numpy(b))
        ref = ln(torch.from_numpy(x).float()).numpy()
    np.testing.assert_allclose(layer_norm(x, _w(w), _w(b), 1e-6), ref, rtol=1e-5, atol=1e-5)
