"""``tools/train_tiny/fast_qwen38.py`` trains the same model as transformers' own Qwen4Exp code, only faster.

Oracle: the unpatched transformers ``Qwen4ExpForCausalLM`` (config ``families.QWEN38_CONFIG``) and
``mtp_qwen38.MtpHead`` with the same weights, float32. Block budgets are small enough that every query past a few
blocks selects, the sequence lengths are not multiples of the block size, and end-of-sequence tokens sit inside the
windows (PLE resets).
"""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers.models.qwen4_exp")

TRAIN_TINY = Path(__file__).parents[2] / "tools" / "train_tiny"
RELATIVE_TOLERANCE = 1e-5
VOCAB = 300
OVERRIDES = {"indexer_budget": 12, "num_hidden_layers": 4, "layer_types": ["linear_attention", "indexed_attention"] * 2,
             "ple_layer_ids": [1, 3]}  # 3 of up to 15 complete blocks per query


def _load(name: str):
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, TRAIN_TINY / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # train.py imports its siblings by bare name
        spec.loader.exec_module(module)
    return sys.modules[name]


families, fast_qwen38, mtp_qwen38 = _load("families"), _load("fast_qwen38"), _load("mtp_qwen38")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Small ops: threads only contend on a shared CI machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def pristine() -> torch.nn.Module:
    """The tiny model, unpatched (built here, not by ``families.py``, which may patch it), with randomised
    zero-centred norms and router (their zero init would hide selection bugs)."""
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    config = Qwen4ExpTextConfig(vocab_size=VOCAB, **{**families.QWEN38_CONFIG, **OVERRIDES})
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = Qwen4ExpForCausalLM(config)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "gate.weight" in name:
                param.copy_(0.3 * torch.randn(param.shape, generator=gen))
    return model.train()


@pytest.fixture
def reference(pristine) -> torch.nn.Module:
    return copy.deepcopy(pristine)


def _tokens(batch: int, length: int, seed: int) -> torch.Tensor:
    ids = torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))
    eos = families.QWEN38_CONFIG["eos_token_id"]
    ids[0, 5] = ids[0, 6] = ids[-1, length // 2] = eos
    return ids


def _loss_and_grads(model: torch.nn.Module, ids: torch.Tensor, mtp: torch.nn.Module | None = None):
    family = families.FAMILIES["qwen38"]
    logits, aux = family.forward(model, ids)
    targets = torch.randn(logits.shape, generator=torch.Generator().manual_seed(2))
    loss = (logits * targets).mean() + aux
    mtp_logits = None
    if mtp is not None:
        mtp_logits = mtp(ids)
        loss = loss + (mtp_logits * targets[:, 1:]).mean()
    modules = [model] if mtp is None else [model, mtp]
    for module in modules:
        module.zero_grad(set_to_none=True)
    loss.backward()
    grads = {f"{i}.{name}": p.grad for i, module in enumerate(modules) for name, p in module.named_parameters()}
    return logits.detach(), mtp_logits, grads


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    error = (actual - expected).norm() / expected.norm().clamp_min(1e-30)
    assert error <= RELATIVE_TOLERANCE, f"{what}: relative error {error:.2e}"


def test_block_selection_equals_transformers_indexer(reference):
    """The vectorised mask equals transformers' per-query loop, layer by layer, and really drops blocks."""
    attention = next(layer.self_attn for layer in reference.model.layers if hasattr(layer, "self_attn"))
    batch, length = 3, 47
    hidden = torch.randn(batch, length, reference.config.hidden_size, generator=torch.Generator().manual_seed(3))
    positions = torch.arange(length).expand(3, batch, -1)
    cos_sin = reference.model.rotary_emb(hidden, positions)
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    mask = torch.zeros(length, length).masked_fill(~causal, torch.finfo(torch.float32).min).expand(batch, 1, -1, -1)
    with torch.no_grad():
        expected = attention.indexer(hidden, cos_sin, mask, None)
        actual = fast_qwen38.causal_block_selection(attention.indexer, hidden, cos_sin)
    assert actual.dtype == torch.bool and actual.shape == expected.shape == (batch, 1, length, length)
    assert torch.equal(actual, expected)
    budget = OVERRIDES["indexer_budget"]
    assert int(actual[:, :, -1].sum(-1).max()) < budget + 4 < length  # the last query sees only its selection


def test_training_step_equals_transformers(reference, monkeypatch):
    """Logits and every parameter gradient (trunk and MTP head) match the unpatched model, and the vectorised
    selection is what ran (once per indexed layer of the trunk and of the MTP head)."""
    calls = []
    selection = fast_qwen38.causal_block_selection
    monkeypatch.setattr(fast_qwen38, "causal_block_selection", lambda *args: calls.append(1) or selection(*args))
    ids = _tokens(2, 61, seed=4)
    model = copy.deepcopy(reference)
    mtp_reference = mtp_qwen38.MtpHead(reference)
    ref_logits, ref_mtp, ref_grads = _loss_and_grads(reference, ids, mtp_reference)

    mtp = mtp_qwen38.MtpHead(model)  # hooks on its own trunk; same weights as the reference head
    mtp.load_state_dict(mtp_reference.state_dict())
    fast_qwen38.patch(model)
    fast_qwen38.patch_mtp(mtp)
    logits, mtp_logits, grads = _loss_and_grads(model, ids, mtp)

    _assert_close(logits, ref_logits, "logits")
    _assert_close(mtp_logits.detach(), ref_mtp.detach(), "MTP logits")
    assert grads.keys() == ref_grads.keys()
    for name, expected in ref_grads.items():
        if expected is None:  # the indexers: top-k selection passes no gradient, in transformers as here
            assert grads[name] is None, name
        else:
            _assert_close(grads[name], expected, name)
    assert sum(g is not None for g in grads.values()) > 100
    assert len(calls) == 2 + 1


def test_masked_and_cached_forwards_fall_back(reference):
    """With a padding mask, or decoding from a cache, the patched model still equals transformers."""
    model = fast_qwen38.patch(copy.deepcopy(reference)).eval()
    reference.eval()
    ids = _tokens(2, 30, seed=5)
    padding = torch.ones_like(ids)
    padding[1, :7] = 0
    with torch.no_grad():
        _assert_close(model(input_ids=ids, attention_mask=padding).logits,
                      reference(input_ids=ids, attention_mask=padding).logits, "masked logits")
        _assert_close(model(input_ids=ids).logits, reference(input_ids=ids).logits, "evaluation logits")
        generated = model.generate(ids[:1], max_new_tokens=4, do_sample=False)
        assert torch.equal(generated, reference.generate(ids[:1], max_new_tokens=4, do_sample=False))


def test_patch_twice_is_refused(reference):
    model = fast_qwen38.patch(copy.deepcopy(reference))
    with pytest.raises(RuntimeError, match="already patched"):
        fast_qwen38.patch(model)
