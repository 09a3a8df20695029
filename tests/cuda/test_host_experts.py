"""Which routed experts the CUDA backend keeps in host memory when the device is too small (CPU), and on the GPU
that reading them from there gives the bits of experts held on the device."""

from __future__ import annotations

import numpy as np
import pytest
from ds4_backend_cuda.host_experts import HEADROOM, MEMORY_TYPE_HOST, plan
from gguf import GGMLQuantizationType

from ds4_core.errors import BackendError
from ds4_core.gguf import TensorInfo

GiB = 2**30


def _flash_like(layers: int = 4) -> list[TensorInfo]:
    """Per layer 1 GiB of attention and 3 GiB of routed experts (gate, up, down), then a 1 GiB output head."""
    out = []
    for i in range(layers):
        out.append(TensorInfo(f"blk.{i}.attn_q_b.weight", GGMLQuantizationType.Q8_0, (8, 8), 0, GiB))
        out += [TensorInfo(f"blk.{i}.ffn_{p}_exps.weight", GGMLQuantizationType.IQ2_XXS, (8, 8), 0, GiB)
                for p in ("gate", "up", "down")]
    return [*out, TensorInfo("output.weight", GGMLQuantizationType.Q8_0, (8, 8), 0, GiB)]


def _layers(names: set[str]) -> set[int]:
    assert all("_exps." in n for n in names)
    return {int(n.split(".")[1]) for n in names}


def test_nothing_moves_while_the_weights_fit():
    tensors = _flash_like()
    assert plan(tensors, device_free=17 * GiB, host_free=None, setting="auto") == set()


def test_auto_moves_the_last_layers_the_device_lacks_and_the_headroom():
    tensors = _flash_like()  # 17 GiB
    moved = plan(tensors, device_free=17 * GiB - 1, host_free=100 * GiB, setting="auto")
    layers = -(-(1 + HEADROOM) // (3 * GiB))  # a byte short, plus the headroom, in layers of 3 GiB of experts
    assert _layers(moved) == set(range(4 - layers, 4)) and len(moved) == 3 * layers  # gate, up and down together


def test_auto_moves_nothing_when_the_host_or_every_expert_is_not_enough():
    tensors = _flash_like()
    assert plan(tensors, device_free=12 * GiB, host_free=2 * GiB, setting="auto") == set()
    assert plan(tensors, device_free=2 * GiB, host_free=100 * GiB, setting="auto") == set()  # 5 GiB are not experts


@pytest.mark.parametrize(("setting", "layers"), [("off", set()), ("0", set()), ("all", {0, 1, 2, 3}),
                                                 ("1", {3}), ("3", {1, 2, 3}), (" All ", {0, 1, 2, 3})])
def test_the_setting_picks_layers_from_the_last(setting, layers):
    assert _layers(plan(_flash_like(), device_free=100 * GiB, host_free=100 * GiB, setting=setting)) == layers


def test_a_bad_setting_says_what_it_takes():
    with pytest.raises(BackendError, match=r"DS4_CUDA_HOST_EXPERTS='half': expected auto, off, all or a number"):
        plan(_flash_like(), device_free=GiB, host_free=GiB, setting="half")


@pytest.mark.gpu
@pytest.mark.parametrize("paths", ["float32", "default"])
def test_experts_in_host_memory_give_the_logits_of_experts_on_the_device(cuda_backend, tmp_path, monkeypatch, paths):
    """Every layer's routed experts in pinned host memory (``DS4_CUDA_HOST_EXPERTS=all``) give the logits of the same
    model held on the device: a prompt chunk of many pairs (the experts copied to the device whole), one of few
    pairs and graph-replayed decode steps (the picked experts gathered into device scratch), on the float32 paths
    and on the default int8 decode and tensor-core prefill."""
    import cupy
    from ds4_backend_cuda.backend import CudaBackend
    from ds4_backend_cuda.moe_ops import MOE_PAIR_LIMIT
    from ds4_model_deepseek4.tiny import ensure_default_model

    from ds4_core.engine import Engine

    if paths == "default":  # the suite pins the float32 paths (conftest.py)
        for name in ("DS4_CUDA_INT8", "DS4_CUDA_PREFILL"):
            monkeypatch.delenv(name)
    path = ensure_default_model(tmp_path / "cache")
    assert 40 * 2 > MOE_PAIR_LIMIT >= 20 * 2  # the tiny model routes each token to 2 experts
    uploaded: dict[str, object] = {}
    upload = CudaBackend.upload
    monkeypatch.setattr(CudaBackend, "upload",
                        lambda self, name, *a: uploaded.setdefault(name, upload(self, name, *a)))

    def run(setting: str, tokens: list[int]) -> np.ndarray:
        monkeypatch.setenv("DS4_CUDA_HOST_EXPERTS", setting)
        uploaded.clear()
        engine = Engine.load(path, backend="cuda", ctx=128)
        session = engine.new_session()
        session.prefill_chunk = 40  # 40 tokens of 2 experts each are more pairs than MOE_PAIR_LIMIT; 20 are fewer
        rows = [session.feed(list(range(3, 63)))[-1]]
        for i in range(8):
            if len(tokens) == i:
                tokens.append(int(np.argmax(rows[-1])))
            rows.append(session.feed([tokens[i]])[0])
        kinds = {name: cupy.cuda.runtime.pointerGetAttributes(w.data.data.ptr).type for name, w in uploaded.items()}
        host_bytes = engine.backend.memory_info().get("host", 0)
        engine.close()
        on_host = {name for name, kind in kinds.items() if kind == MEMORY_TYPE_HOST}
        assert on_host == ({n for n in kinds if n.startswith("blk.") and "_exps." in n} if setting == "all" else set())
        assert host_bytes == sum(uploaded[n].data.nbytes for n in on_host)  # what ds4 bench reports
        return np.stack(rows)

    tokens: list[int] = []
    on_device = run("off", tokens)
    np.testing.assert_array_equal(run("all", tokens), on_device)


@pytest.mark.gpu
def test_gathered_copies_the_picked_experts_and_no_others(cuda_backend):
    """``gathered`` copies expert idx[p] of each tensor into slot p, leaves a negative id's slot unread (-1), and
    declines tensors that are all on the device or whose experts are not whole 16-byte words. ``in_host_memory``
    skips the driver's query only while no array over pinned memory lives."""
    import gc

    import cupy
    from ds4_backend_cuda import host_experts
    from ds4_backend_cuda.host_experts import gathered, host_array, in_host_memory

    from ds4_core.backend import Weight

    rng = np.random.default_rng(7)
    shapes = [(5, 3, 12, 48), (5, 6, 20, 80)]  # F32 experts, rows, columns, row bytes: 144 and 480 bytes an expert
    host = [rng.integers(0, 256, (e * r, b), dtype=np.uint8) for e, r, _, b in shapes]
    weights = tuple(Weight(f"w{i}", "F32", (e, r, c), host_array(cupy, cupy.cuda.Device().id, h, e * r))
                    for i, ((e, r, c, _), h) in enumerate(zip(shapes, host, strict=True)))
    idx = cupy.asarray([4, -1, 0, 4], dtype=cupy.int32)
    copies, slots = gathered(weights, idx)
    assert slots.tolist() == [0, -1, 2, 3]
    for (e, r, c, _), h, w, copy in zip(shapes, host, weights, copies, strict=True):
        assert copy.shape == (4, r, c) and copy.qtype == w.qtype and copy.data.shape == (4 * r, h.shape[1])
        got = cupy.asnumpy(copy.data).reshape(4, r, -1)
        experts = h.reshape(e, r, -1)
        for p, expert in ((0, 4), (2, 0), (3, 4)):
            np.testing.assert_array_equal(got[p], experts[expert])
    on_device = tuple(Weight(w.name, w.qtype, w.shape, cupy.asarray(h)) for w, h in zip(weights, host, strict=True))
    assert gathered(on_device, idx) is None
    odd = rng.integers(0, 256, (5 * 3, 36), dtype=np.uint8)  # 108 bytes an expert
    assert gathered((Weight("odd", "F32", (5, 3, 9), host_array(cupy, cupy.cuda.Device().id, odd, 15)),), idx) is None
    assert in_host_memory(weights[0]) and not in_host_memory(on_device[0])
    gc.collect()  # earlier tests' engines, if not yet collected, hold owners too
    live = len(host_experts._live)
    assert live >= 2
    del weights, w  # the odd tensor's owner went with its Weight already
    gc.collect()
    assert len(host_experts._live) == live - 2
