"""Programmatic dependent launches (``ds4_backend_cuda.launch``): the driver structures and argument bytes (no GPU
needed), every kernel launched that way waiting for its predecessor, and the same results on the GPU either way."""

from __future__ import annotations

import ctypes
import enum
import re

import numpy as np
import pytest
from ds4_backend_cuda import launch
from ds4_backend_cuda.modules import GLUE_SOURCES, source

#: Kernels that load weights before they wait, and the helper they wait in.
_WAIT_LATER = {"gemv_i8": "block_activation(", "gemv": "D::run("}
#: The statements a kernel may run before its wait, each on constant data: filling a lookup table, prefetching the
#: hyper-connection mix's weights, loading the router's first weights (into an array declared for them); and the
#: extra block of a launch that hosts a hyper-connection's split, which waits inside ``hosted_split``.
_CONSTANT_PROLOGUES = {"I8<Q>::fill(table)", "mix_slice_prefetch<Q>(fn, row_bytes, M)", "uint4 q[ROUTER_BATCH]",
                       "router_fetch(W, fmt, D, E, 0, q)", "if (hosted_split(HC_HOSTED_SPLIT_ARGS)) return"}


def test_driver_structures_have_cuda_h_layout():
    # CUlaunchAttribute: 4-byte id, padding to 8, a 64-byte union; CUlaunchConfig: seven uints, then pointers
    assert ctypes.sizeof(launch._Attribute) == 72 and launch._Attribute.value.offset == 8
    assert launch._Config.stream.offset == 32 and launch._Config.attrs.offset == 40
    assert launch._Config.num_attrs.offset == 48 and ctypes.sizeof(launch._Config) == 56


@pytest.mark.parametrize(("value", "expected"), [
    (np.int32(-3), np.int32(-3).tobytes()), (np.float32(0.5), np.float32(0.5).tobytes()),
    (np.uint64(7), np.uint64(7).tobytes()), (np.float16(1.5), np.float16(1.5).tobytes()),
    (5, np.int64(5).tobytes()), (2**63 + 1, np.uint64(2**63 + 1).tobytes()), (2.5, np.float64(2.5).tobytes()),
    (True, b"\x01"), (np.bool_(False), b"\x00"), (None, bytes(8)),
    (enum.IntEnum("E", "A B")(2), np.int64(2).tobytes())])
def test_arguments_are_the_bytes_cupy_would_pass(value, expected):
    buffer, offsets = launch._packed([value])
    assert offsets == (0,) and buffer.raw[:len(expected)] == expected


def test_arguments_are_laid_out_as_a_c_parameter_list():
    """Each argument at an offset aligned to its size, as a kernel's parameters sit: padding after a bool before
    an int32, after an int32 before a pointer."""
    args = [True, np.int32(7), None, np.float32(2.0), 3, np.uint8(9), 1.5]
    buffer, offsets = launch._packed(args)
    assert offsets == (0, 4, 8, 16, 24, 32, 40)
    raw = buffer.raw
    for value, offset, width in zip(args, offsets, (1, 4, 8, 4, 8, 1, 8), strict=True):
        assert raw[offset:offset + width] == launch._packed([value])[0].raw[:width]
    assert launch._packed([])[1] == ()


def test_an_unknown_argument_type_is_refused():
    with pytest.raises(TypeError, match="CuPy array or a number"):
        launch._packed([np.int32(1), "x"])


def test_launch_configurations_are_made_once_a_shape():
    first = launch._config((128, 6), (256,), 0, 0)
    assert launch._config([128, 6], [256], 0, 0) is first and launch._config((128, 6), (256,), 0, 1) is not first
    assert list(first.grid) == [128, 6, 1] and list(first.block) == [256, 1, 1] and first.num_attrs == 1
    assert first.attrs.contents.id == launch._PROGRAMMATIC_STREAM_SERIALIZATION and first.attrs.contents.value == 1


def _kernels(text: str) -> dict[str, str]:
    """Kernel name -> its body up to the next kernel, for each ``__global__`` function of ``text``."""
    starts = [m.start() for m in re.finditer(r"__global__", text)]
    bodies = {}
    for start, end in zip(starts, [*starts[1:], len(text)], strict=True):
        chunk = text[start:end]
        signature, body = chunk.split("{", 1)
        name = re.findall(r"(\w+)\s*\(", re.sub(r"__launch_bounds__\([^)]*\)", "", signature))[0]
        bodies[name] = body
    return bodies


def test_every_programmatically_launched_kernel_waits_before_its_work():
    quant = _kernels(source("quant.cu") + source("quant_int8.cu"))
    glue = _kernels("".join(source(name) for name in GLUE_SOURCES))
    assert {"gemv", "gemv_i8", "moe_gate_up_i8", "hc_split_norm", "attend_rows", "route_topk"} <= {*quant, *glue}
    for name, body in {**quant, **glue}.items():
        if name in _WAIT_LATER:
            assert _WAIT_LATER[name] in body, name
            continue
        statements = [re.sub(r"//.*", "", part).strip() for part in body.split("grid_wait()", 1)[0].split(";")]
        early = [st for st in statements if st and not st.startswith(("__shared__", "extern __shared__", "using ",
                                                                      "constexpr "))]
        assert set(early) <= _CONSTANT_PROLOGUES, f"{name} runs {early} before grid_wait()"
    assert "grid_wait();" in source("quant_int8.cu").split("block_activation(", 1)[1].split("}", 1)[0]
    assert "grid_wait();" in source("quant_int8.cu").split("bool hosted_split(", 1)[1].split("}", 1)[0]
    run = source("quant.cu").split("void run(", 1)[1]
    assert run.index("fetch(row, ks") < run.index("grid_wait();") < run.index("stage[slot] = buf[i]")


def test_a_kernel_lets_its_successor_launch_only_after_its_own_wait():
    """``grid_wait`` waits, then releases the successor, and no kernel source releases it elsewhere: a successor
    released before the wait may start before the kernel two back has ended, and read its output stale (pdl.cuh)."""
    from importlib import resources

    release, wait = "griddepcontrol.launch_dependents", "griddepcontrol.wait"
    body = source("pdl.cuh").split("void grid_wait()", 1)[1].split("}", 1)[0]
    assert body.index(wait) < body.index(release)
    names = [f.name for f in resources.files("ds4_backend_cuda").joinpath("kernels").iterdir()
             if f.name.endswith((".cu", ".cuh"))]
    assert "pdl.cuh" in names and "quant_int8.cu" in names
    for name in names:
        text = re.sub(r"//.*", "", source(name))
        expected = 1 if name == "pdl.cuh" else 0
        assert text.count(release) == expected, f"{name} releases its successor outside grid_wait()"
        assert text.count("cudaTriggerProgrammaticLaunchCompletion") == 0, name


@pytest.mark.gpu
def test_programmatic_launches_give_the_plain_launches_results_in_a_recorded_step(cuda_backend, monkeypatch):
    """A chain of dependent kernels (each reads the last one's output) recorded as a graph with programmatic edges
    and replayed on new inputs gives, bit for bit, what plain launches give."""
    import cupy as cp
    from ds4_backend_cuda import ops

    from ds4_core.backend import Weight
    from ds4_core.quants import random_blocks

    if not launch.programmatic():
        pytest.skip("programmatic dependent launch needs compute capability 9.0")
    rng = np.random.default_rng(5)
    w = cuda_backend.upload("w", "Q8_0", (512, 512), random_blocks("Q8_0", 512 * 512 // 32, rng).reshape(-1))
    norm = Weight("n", "F32", (512,), cp.asarray(rng.standard_normal(512, dtype=np.float32)))
    start = rng.standard_normal((1, 512), dtype=np.float32)
    x = cp.asarray(start)

    def chain():
        y = x
        for _ in range(8):
            y = ops.rms_norm(ops.linear(y, w), norm, 1e-6)
        return y

    firsts = []
    for flag in ("0", "1"):
        monkeypatch.setenv(launch.PDL_ENV, flag)
        x[...] = cp.asarray(start)  # both recordings start from the same input
        first, replay = cuda_backend.capture(chain)
        assert replay is not None
        firsts.append(cp.asnumpy(first))
        x[...] = cp.asarray(rng.standard_normal((1, 512), dtype=np.float32))  # the replay reads the new input
        got = cp.asnumpy(replay())
        monkeypatch.setenv(launch.PDL_ENV, "0")
        np.testing.assert_array_equal(got, cp.asnumpy(chain()), err_msg=f"{launch.PDL_ENV}={flag}")
    np.testing.assert_array_equal(firsts[0], firsts[1])
    assert np.isfinite(firsts[0]).all()
