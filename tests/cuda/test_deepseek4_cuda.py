"""Tiny DeepSeek V4 models on the CUDA backend against the numpy reference backend."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

from ds4_core.backend import Ops, WeightLoader
from ds4_core.gguf import GGUFFile

pytestmark = pytest.mark.gpu

PROMPT_TOKENS = 90  # past the indexer's top-k (16 rows of 4 tokens) and several HCA windows of 16


def _build(directory: Path, outtype: str, overrides: dict | None = None) -> Path:
    from ds4_model_deepseek4 import tiny
    from ds4_model_deepseek4.convert import ArraySource, build_gguf

    path = directory / f"tiny-{outtype}.gguf"
    config = tiny.tiny_config({**tiny.DEFAULT_MODEL_OVERRIDES, **(overrides or {})})
    scratch = Path(tempfile.mkdtemp(dir=directory))
    tiny.write_tokenizer_files(scratch, tiny.shipped_tokenizer_json())
    build_gguf(ArraySource(tiny.random_weights(config, 0)), config, scratch, path, outtype, "tiny")
    shutil.rmtree(scratch)
    return path


@pytest.fixture(scope="module", params=["q8_0", "bf16"])
def tiny_gguf(request, tmp_path_factory) -> Path:
    return _build(tmp_path_factory.mktemp("tiny"), request.param)


def _ops(backend) -> Ops:
    if backend.name == "numpy":
        from ds4_model_deepseek4.ops import DEEPSEEK4_OPS

        from ds4_core.ops import CORE_OPS

        return Ops(backend, {**CORE_OPS, **DEEPSEEK4_OPS})
    from ds4_backend_cuda.plugin import kernel_refs

    from ds4_core.descriptors import resolve

    return Ops(backend, {op: resolve(ref) for op, ref in kernel_refs().items()})


def _run(path: Path, backend, chunks: list[int], ids: np.ndarray, **options) -> np.ndarray:
    from ds4_model_deepseek4.loader import load

    gguf = GGUFFile.open(path)
    try:
        model = load(gguf, WeightLoader(gguf, backend), _ops(backend), options)
        state = model.new_state(256)
        out, start = [], 0
        for n in chunks:
            out.append(backend.to_numpy(model.forward(ids[start:start + n], state)))
            start += n
        return np.concatenate(out)
    finally:
        gguf.close()


def _ids(n: int) -> np.ndarray:
    return np.random.default_rng(7).integers(9, 512, n).astype(np.int32)


def _close(got: np.ndarray, want: np.ndarray) -> None:
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3 * np.abs(want).max())


def test_prefill_matches_numpy(cuda_backend, tiny_gguf):
    from ds4_core.backends.numpy import NumpyBackend

    ids = _ids(PROMPT_TOKENS)
    want = _run(tiny_gguf, NumpyBackend(), [PROMPT_TOKENS], ids)
    got = _run(tiny_gguf, cuda_backend, [PROMPT_TOKENS], ids)
    _close(got, want)
    assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.95


def test_token_by_token_matches_chunked(cuda_backend, tiny_gguf):
    ids = _ids(PROMPT_TOKENS)
    chunked = _run(tiny_gguf, cuda_backend, [50, 7, PROMPT_TOKENS - 57], ids)
    single = _run(tiny_gguf, cuda_backend, [1] * PROMPT_TOKENS, ids)
    _close(single, chunked)


def test_qat_rounding_runs_on_cuda(cuda_backend, tmp_path_factory):
    from ds4_core.backends.numpy import NumpyBackend

    path = _build(tmp_path_factory.mktemp("qat"), "q8_0", {"index_head_dim": 32})  # QAT's Hadamard needs ≥ 32
    ids = _ids(80)
    want = _run(path, NumpyBackend(), [80], ids, qat_rounding=True)
    got = _run(path, cuda_backend, [80], ids, qat_rounding=True)
    assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.9


def test_engine_runs_on_backend_cuda(cuda_backend, tiny_gguf):
    from ds4_core.engine import Engine
    from ds4_core.plugins import get_plugin_manager

    if get_plugin_manager().registry.model_for_architecture("deepseek4") is None:
        pytest.skip("the deepseek4 model plugin does not load in this checkout")
    ids = _ids(20)
    engines = [Engine.load(tiny_gguf, backend=name, ctx=64) for name in ("cuda", "numpy")]
    try:
        got, want = (e.new_session().feed(ids) for e in engines)
        assert engines[0].backend.name == "cuda"
        _close(got, want)
    finally:
        for e in engines:
            e.close()


def _load(path: Path, backend):
    from ds4_model_deepseek4.loader import load

    gguf = GGUFFile.open(path)
    return gguf, load(gguf, WeightLoader(gguf, backend), _ops(backend), {})


def _decode(model, backend, ids: np.ndarray, prompt: int) -> tuple[np.ndarray, object]:
    state = model.new_state(256)
    out = [backend.to_numpy(model.forward(ids[:prompt], state))]
    out += [backend.to_numpy(model.forward(ids[p:p + 1], state)) for p in range(prompt, len(ids))]
    return np.concatenate(out), state


# 40: the steps start while every complete CSA row is visible (through position 66) and cross into the indexer's
# choice, each form recorded once; PROMPT_TOKENS: every step chooses.
@pytest.mark.parametrize("prompt", [PROMPT_TOKENS, 40])
def test_decode_replays_cuda_graphs_per_state_and_matches_eager_and_numpy(cuda_backend, tiny_gguf, prompt):
    from ds4_core.backends.numpy import NumpyBackend

    ids = _ids(prompt + 40)  # decode crosses CSA/HCA windows and the indexer's top-k
    gguf, model = _load(tiny_gguf, cuda_backend)
    try:
        assert model.decode_graphs is not None
        graphed, state = _decode(model, cuda_backend, ids, prompt)
        assert model.decode_graphs.replays(state)
        forms = {form for (form,) in model.decode_graphs._recordings[id(state)]}
        assert forms == ({True, False} if prompt < 66 else {False})
        model.decode_graphs = None  # the same weights, each step launched eagerly
        eager, _ = _decode(model, cuda_backend, ids, prompt)
    finally:
        gguf.close()
    np.testing.assert_allclose(graphed, eager, rtol=1e-4, atol=1e-4 * np.abs(eager).max())
    _close(graphed, _run(tiny_gguf, NumpyBackend(), [prompt] + [1] * 40, ids))


def test_graphed_session_restores_and_decodes_the_same_tokens(cuda_backend, tiny_gguf):
    from ds4_core.engine import Engine
    from ds4_core.plugins import get_plugin_manager
    from ds4_core.sampling import SamplingParams

    if get_plugin_manager().registry.model_for_architecture("deepseek4") is None:
        pytest.skip("the deepseek4 model plugin does not load in this checkout")
    engine = Engine.load(tiny_gguf, backend="cuda", ctx=256)
    try:
        session = engine.new_session()
        session.feed(_ids(30))
        snap = session.snapshot()
        greedy = SamplingParams(temperature=0.0)
        first = [g.id for g in session.generate(max_tokens=24, sampling=greedy, stop_ids=())]  # tokens with text
        assert len(first) >= 12 and engine.model.decode_graphs.replays(session.state)
        state = session.state
        session.restore(snap)  # copied into the same arrays: the recorded graph replays on
        assert session.state is state and engine.model.decode_graphs.replays(state)
        again = [g.id for g in session.generate(max_tokens=24, sampling=greedy, stop_ids=())]
        assert again == first
    finally:
        engine.close()


def test_engine_load_on_cuda_refuses_a_context_larger_than_device_memory(cuda_backend, tmp_path):
    import re

    from ds4_model_deepseek4.tiny import ensure_default_model
    from gguf import GGUFReader

    from ds4_core.engine import Engine
    from ds4_core.errors import ContextError

    path = tmp_path / "tiny-4G-context.gguf"
    shutil.copyfile(ensure_default_model(tmp_path / "cache"), path)
    field = GGUFReader(path, "r+").fields["deepseek4.context_length"]
    field.parts[field.data[0]][0] = 2**32 - 1  # the reader maps the file: this writes it
    del field
    with pytest.raises(ContextError) as err:
        Engine.load(path, backend="cuda", ctx=2**32 - 1)
    state, free = (float(x) for x in re.findall(r"([\d.]+) GiB", str(err.value)))
    assert free < 2 * state and free <= cuda_backend.free_memory() / 2**30 + 1 and "on cuda" in str(err.value)


def test_engine_load_on_cuda_refuses_weights_beyond_free_memory_and_reports_a_real_oom_midway(cuda_backend, tmp_path):
    """The pool's limit (``CUPY_GPU_MEMORY_LIMIT``'s) stands for a smaller device: below the weights the load is
    refused before any upload; with the pool barred from taking more device memory and its cached blocks taken a
    third of the way through, CuPy's own out-of-memory error comes out as one message that says how far the load
    got; then the same file loads and runs."""
    import re

    import cupy
    from ds4_model_deepseek4.tiny import ensure_default_model

    from ds4_core.engine import Engine
    from ds4_core.errors import DeviceMemoryError
    from ds4_core.memory import human_bytes

    path = ensure_default_model(tmp_path / "cache")
    with GGUFFile.open(path) as gguf:
        need = cuda_backend.weights_nbytes(gguf.tensors.values())
    pool, held = cupy.get_default_memory_pool(), []
    try:
        pool.free_all_blocks()
        pool.set_limit(size=pool.used_bytes() + need - 1)
        assert cuda_backend.free_memory() == need - 1
        with pytest.raises(DeviceMemoryError, match=re.escape(f"weights take {human_bytes(need)} on cuda, where ")):
            Engine.load(path, backend="cuda")
        pool.set_limit(size=0)

        def squeeze(done: int, total: int) -> None:
            if done > total // 3 and not pool.get_limit():
                pool.free_all_blocks()
                pool.set_limit(size=1)  # no new block from the device (0 would lift the limit)
                size = pool.free_bytes()
                while size >= 512:  # and the pool's cached blocks taken, as another user of the device would
                    try:
                        held.append(cupy.empty(size, cupy.uint8))
                    except cupy.cuda.memory.OutOfMemoryError:
                        size //= 2

        with pytest.raises(DeviceMemoryError, match=r"cuda ran out of memory after loading .+ of the file's") as err:
            Engine.load(path, backend="cuda", progress=squeeze)
        assert isinstance(err.value.__cause__, cupy.cuda.memory.OutOfMemoryError)
    finally:
        pool.set_limit(size=0)
    del held[:]
    engine = Engine.load(path, backend="cuda", ctx=64)
    assert len(engine.new_session().feed([1, 2, 3])) == 3
    engine.close()


def test_weights_on_the_device_are_the_files_tensor_bytes_within_2_percent(cuda_backend):
    import gc
    from importlib import resources

    import cupy

    from ds4_core.engine import Engine

    path = Path(str(resources.files("ds4_model_deepseek4").joinpath("data", "tiny-deepseek4.gguf")))
    pool = cupy.get_default_memory_pool()
    gc.collect()
    before = pool.used_bytes()
    engine = Engine.load(path, backend="cuda", ctx=64)
    try:
        gc.collect()
        on_device = pool.used_bytes() - before
        in_file = sum(t.nbytes for t in engine.gguf.tensors.values())
    finally:
        engine.close()
    assert abs(on_device - in_file) <= 0.02 * in_file, (on_device, in_file)


def test_fused_compressor_step_matches_its_composition(cuda_backend, tiny_gguf):
    """``compress_step`` (two launches) leaves every compressor state array as the model's own composition of core
    ops does, token after token across several windows, for CSA (overlapping, and the indexer's) and HCA."""
    import copy

    import attrs
    from ds4_backend_cuda.plugin import kernel_refs
    from ds4_model_deepseek4.state import CompressorState

    from ds4_core.descriptors import resolve

    gguf, model = _load(tiny_gguf, cuda_backend)
    try:
        ops = model.ops
        assert ops.has("compress_step")
        composed = Ops(cuda_backend, {op: resolve(ref) for op, ref in kernel_refs().items() if op != "compress_step"})
        compressors = [(b.attn.compressor, b.attn.inv_freq) for b in model.blocks if b.attn.compressor is not None]
        compressors += [(b.attn.indexer.compressor, b.attn.inv_freq) for b in model.blocks if b.attn.indexer]
        assert {c.overlap for c, _ in compressors} == {False, True}
        rng = np.random.default_rng(3)
        for comp, inv_freq in compressors:
            states = [CompressorState.empty(cuda_backend.xp, comp.m, comp.d, comp.overlap, 64) for _ in range(2)]
            states[1] = copy.deepcopy(states[0])
            for p in range(2 * comp.m + 3):
                x = cuda_backend.asarray(rng.standard_normal((1, model.cfg.hidden_size), dtype=np.float32))
                pos = cuda_backend.asarray(np.array([p], np.int32))
                for o, cs in zip((ops, composed), states, strict=True):
                    comp.step(o, o.linear(x, comp.kv), o.linear(x, comp.gate), pos, cs, inv_freq, None)
                fused, plain = ({k: cuda_backend.to_numpy(v) for k, v in attrs.asdict(cs, recurse=False).items()
                                 if v is not None and not isinstance(v, int)} for cs in states)
                for name, want in plain.items():
                    np.testing.assert_allclose(fused[name], want, rtol=1e-5, atol=1e-5, err_msg=name)
    finally:
        gguf.close()


@pytest.mark.parametrize("p", [0, 5, 127, 130, 2047])
def test_step_index_in_one_launch_matches_its_reference(cuda_backend, p):
    from ds4_backend_cuda import deepseek4_ops as cu
    from ds4_model_deepseek4 import ops as dref

    pos = np.array([p], np.int32)
    for specs in (((4, 0), (128, 20), (8, 3)), ()):
        got = cuda_backend.to_numpy(cu.step_index(cuda_backend.asarray(pos), 128, specs))
        np.testing.assert_array_equal(got, dref.step_index(pos, 128, specs))


def test_fused_index_select_chooses_the_references_rows(cuda_backend):
    """``index_select`` (one launch) gives exactly the numpy reference's rows and order: ties, -inf,
    R below and above k, limits from 0 to R, rows split over several blocks, and a decode step's row of 16K
    compressed rows (64K tokens at ratio 4) with Flash's k = 512."""
    from ds4_backend_cuda import deepseek4_ops as cu
    from ds4_model_deepseek4.ops import index_select

    rng = np.random.default_rng(9)
    for T, R, k in ((5, 7, 16), (4, 300, 64), (3, 1000, 512), (2, 600, 600), (1, 16384, 512)):
        scores = rng.integers(-20, 20, (T, R)).astype(np.float32)  # many ties
        scores[:, ::2] += rng.standard_normal((T, (R + 1) // 2)).astype(np.float32)
        scores[rng.random((T, R)) < 0.1] = -np.inf
        limit = rng.integers(0, R + 1, T).astype(np.int32)
        limit[0] = R
        if T > 1:
            limit[-1] = 0
        for offset in (0, 128):
            got = cu.index_select(cuda_backend.asarray(scores), cuda_backend.asarray(limit), k, offset)
            np.testing.assert_array_equal(cuda_backend.to_numpy(got), index_select(scores, limit, k, offset),
                                          err_msg=f"T={T} R={R} k={k} offset={offset}")


@pytest.mark.parametrize("kernel", ["index_select", "index_select_radix"])
def test_each_index_select_kernel_chooses_the_references_rows(cuda_backend, monkeypatch, kernel):
    """Each kernel behind ``index_select`` (the rank count and the radix select, pinned in turn) gives exactly the
    numpy reference's rows and order: R a power of two or not (3000), up to 16384 with k = 512 and the radix
    kernel's largest k (1024); scores from a few values (exact ties across the k-th place, -0 beside +0, -inf), all
    equal, or distinct; per-row limits of R, fewer than k and no complete row; offsets 0 and 128, and 128 after a
    prefix of 128 rows (a decode step's window), which each output row starts with."""
    from ds4_backend_cuda import deepseek4_ops as cu
    from ds4_model_deepseek4.ops import index_select

    monkeypatch.setattr(cu, "_select_kernel", lambda T, n, k: kernel)
    rng = np.random.default_rng(10)
    few = np.array([-1.5, -0.0, 0.0, 2.0, 7.25, -np.inf], np.float32)
    for T, R, k in ((5, 7, 16), (4, 300, 64), (2, 600, 600), (3, 3000, 512), (2, 2048, 1024), (3, 16384, 512)):
        limit = np.array([R, min(R, k - 3), 0, *rng.integers(0, R + 1, max(T - 3, 0))][:T], np.int32)
        for kind, scores in (("few", rng.choice(few, (T, R))), ("equal", np.zeros((T, R), np.float32)),
                             ("distinct", rng.standard_normal((T, R), dtype=np.float32))):
            for offset, prefix in ((0, None), (128, None), (128, np.arange(128, dtype=np.int32) - 1)):
                got = cu.index_select(cuda_backend.asarray(scores), cuda_backend.asarray(limit), k, offset,
                                      None if prefix is None else cuda_backend.asarray(prefix))
                np.testing.assert_array_equal(cuda_backend.to_numpy(got),
                                              index_select(scores, limit, k, offset, prefix),
                                              err_msg=f"{kernel} T={T} R={R} k={k} {kind} offset={offset} "
                                                      f"prefix={prefix is not None}")


def test_radix_index_select_replays_in_a_cuda_graph(cuda_backend):
    """A decode step's ``index_select`` (one row of 16K compressed rows, k = 512: the radix kernel) recorded in a
    CUDA graph chooses the reference's rows of the scores and limit held at each replay."""
    from ds4_backend_cuda import deepseek4_ops as cu
    from ds4_model_deepseek4.ops import index_select

    assert cu._select_kernel(1, 16384, 512) == "index_select_radix"
    rng = np.random.default_rng(11)
    scores = cuda_backend.asarray(rng.standard_normal((1, 16384), dtype=np.float32))
    limit = cuda_backend.asarray(np.array([16384], np.int32))
    _, replay = cuda_backend.capture(lambda: cu.index_select(scores, limit, 512, 128))
    assert replay is not None
    for lim in (16384, 9000, 300):
        fresh = rng.integers(-8, 8, (1, 16384)).astype(np.float32)  # ties, unlike the recorded run's scores
        scores[...] = cuda_backend.asarray(fresh)
        limit[...] = lim
        np.testing.assert_array_equal(cuda_backend.to_numpy(replay()),
                                      index_select(fresh, np.array([lim], np.int32), 512, 128), err_msg=f"limit={lim}")


@pytest.mark.parametrize("int8", ["0", "1"])
def test_fused_shared_expert_matches_its_composition(cuda_backend, tiny_gguf, monkeypatch, int8):
    """``shared_expert`` (gate, up and SwiGLU in one launch, then the down projection) gives the model's composition
    of core ops on every layer's shared expert, for one token and a few, on float and int8 activations; the bf16
    file's gate/up take the same kernel in its BF16 form. Each token is composed alone: one-token projections are
    the ones that take int8 activations, as the fused launch does for every token. With int8 activations the down
    projection quantizes h, whose last bits differ with the order of the sums, so a code of h may round the other
    way: the tolerance is that of one int8 step (~0.4% of a block's largest value); the launch itself is checked
    exactly in test_int8_gemv.py."""
    from ds4_backend_cuda import deepseek4_ops as cu
    from ds4_model_deepseek4.model import compose_shared_expert

    monkeypatch.setenv("DS4_CUDA_INT8", int8)
    gguf, model = _load(tiny_gguf, cuda_backend)
    try:
        assert model.ops.has("shared_expert")
        rng = np.random.default_rng(5)
        for block in model.blocks:
            moe = block.ffn
            weights = (moe.ffn_gate_shexp, moe.ffn_up_shexp, moe.ffn_down_shexp)
            for T in (1, 3):
                x = cuda_backend.asarray(rng.standard_normal((T, model.cfg.hidden_size), dtype=np.float32))
                got = cuda_backend.to_numpy(cu.shared_expert(x, *weights, moe.limit))
                want = np.concatenate([cuda_backend.to_numpy(compose_shared_expert(model.ops, x[t:t + 1], *weights,
                                                                                   moe.limit)) for t in range(T)])
                tol = 1e-2 if int8 == "1" and moe.ffn_gate_shexp.qtype == "Q8_0" else 1e-4
                np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())
    finally:
        gguf.close()
