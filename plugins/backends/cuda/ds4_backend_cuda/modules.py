"""Compilation of the ``.cu`` sources through ``cupy.RawModule`` (NVRTC), once per process.

Each weight format gets its own module (the kernels of :data:`QUANT_KERNELS`; the formats of :data:`INT8_TYPES`
also get the integer decode kernels of ``quant_int8.cu``, compiled after ``quant.cu`` in the same module), so the
formats compile in parallel threads and a process that needs one format compiles only that one; the recurrent-layer
kernels, the small glue kernels of a decode step and the sampling kernels are three more modules. CuPy keys its
on-disk kernel cache by source text and options, so an unchanged source compiles once per machine; :func:`warm`
forces that, the prefill's modules included, at load time rather than at the first prompt.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from concurrent.futures import ThreadPoolExecutor
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np

from .launch import Kernel

#: Weight formats the quant kernels are instantiated for (the struct names in kernels/quant.cu).
QUANT_TYPES: tuple[str, ...] = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_K", "Q6_K", "Q2_K", "IQ2_XXS", "MXFP4")
#: Kernel names of :func:`quant_kernel` -> template instantiation in quant.cu (``Q`` is the format struct).
QUANT_KERNELS: dict[str, str] = {"gemv1": "gemv<Q, 1>", "gemv8": "gemv<Q, 8>", "moe_gemv": "moe_gemv<Q>",
                                 "moe_gate_up": "moe_gate_up<Q>", "dequant_rows": "dequant_rows<Q>",
                                 "mix_slices": "mix_slices<Q>", "hc_expand_mix_norm": "hc_expand_mix_norm<Q>"}
#: Formats with integer decode kernels (int8 activations, ``__dp4a``) and those kernels' instantiations.
INT8_TYPES: tuple[str, ...] = ("Q8_0", "Q4_K", "Q2_K", "IQ2_XXS", "MXFP4")
INT8_KERNELS: dict[str, str] = {"gemv1_i8": "gemv_i8<Q>", "moe_gemv_i8": "moe_gemv_i8<Q>",
                                "moe_gate_up_i8": "moe_gate_up_i8<Q>", "moe_down_sum_i8": "moe_down_sum_i8<Q>"}
_OPTIONS = ("--std=c++17",)


def source(name: str) -> str:
    """Text of ``kernels/<name>`` shipped in this package."""
    return resources.files(__package__).joinpath("kernels", name).read_text(encoding="utf-8")


def program(*names: str) -> str:
    """The sources ``names`` of one module, after ``pdl.cuh`` (``grid_wait``, which their kernels call),
    ``reduce.cuh`` (``block_sum``), ``act.cuh`` (the int8 activation's writers) and ``hc_norm.cuh`` (the
    hyper-connection's split and collapse, which the glue module's kernels and quant.cu's ``hc_expand_mix_norm``
    share)."""
    return "\n".join(source(name) for name in ("pdl.cuh", "reduce.cuh", "act.cuh", "hc_norm.cuh", *names))


#: Options of the sm_90a modules (Hopper's architecture-specific instructions, such as ``wgmma``).
_SM90A_OPTIONS = ("--std=c++17", "--gpu-architecture=sm_90a", "-ftz=true", "--device-as-default-execution-space")


class CompiledModule:
    """A module compiled by :func:`sm90a_module`: ``get_function`` and ``get_global`` by source-level name, as on a
    ``cupy.RawModule``."""

    def __init__(self, module: Any, lowered: dict[str, str]):
        self.module, self.lowered = module, lowered

    def get_function(self, name: str) -> Any:
        return self.module.get_function(self.lowered.get(name, name))

    def get_global(self, name: str) -> Any:
        import cupy

        return cupy.cuda.MemoryPointer(cupy.cuda.UnownedMemory(self.module.get_global_var(name), 0, self.module), 0)


def sm90a_module(code: str, names: list[str]) -> CompiledModule:
    """``code`` compiled by NVRTC for sm_90a with the kernels ``names``, cached on disk beside CuPy's kernels.

    CuPy's own compilation names the device's architecture (sm_90), whose code may not contain ``wgmma``; the cubin
    is keyed by the source, the options, the names and NVRTC's version."""
    import cupy
    from cupy._core.core import assemble_cupy_compiler_options
    from cupy.cuda import nvrtc

    options = assemble_cupy_compiler_options(_SM90A_OPTIONS)  # CuPy's include paths (cuda_fp16.h), as RawModule's
    key = hashlib.sha256("\0".join((code, *options, *names, str(nvrtc.getVersion()))).encode()).hexdigest()
    cache = Path(os.environ.get("CUPY_CACHE_DIR", Path.home() / ".cupy" / "kernel_cache"))
    cubin_path, names_path = cache / f"ds4_sm90a_{key}.cubin", cache / f"ds4_sm90a_{key}.json"
    if cubin_path.exists() and names_path.exists():
        cubin, lowered = cubin_path.read_bytes(), json.loads(names_path.read_text())
    else:
        program = nvrtc.createProgram(code, "ds4_sm90a.cu", [], [])
        try:
            for name in names:
                nvrtc.addNameExpression(program, name)
            try:
                nvrtc.compileProgram(program, list(options))
            except nvrtc.NVRTCError as error:
                log = nvrtc.getProgramLog(program).strip()
                raise RuntimeError(f"NVRTC could not build sm_90a code: {log}") from error
            cubin = nvrtc.getCUBIN(program)
            lowered = {name: nvrtc.getLoweredName(program, name) for name in names}
        finally:
            nvrtc.destroyProgram(program)
        cache.mkdir(parents=True, exist_ok=True)
        for path, data in ((cubin_path, cubin), (names_path, json.dumps(lowered).encode())):
            partial = path.with_suffix(f".{os.getpid()}.part")
            partial.write_bytes(data)
            partial.replace(path)  # atomic: a concurrent process reads a whole file or none
    module = cupy.cuda.Module()
    module.load(cubin)
    return CompiledModule(module, lowered)


def _kernels(qtype: str) -> dict[str, str]:
    return {**QUANT_KERNELS, **INT8_KERNELS} if qtype in INT8_TYPES else QUANT_KERNELS


def _expression(kernel: str, qtype: str) -> str:
    return _kernels(qtype)[kernel].replace("Q", qtype, 1)


def quant_program(qtype: str) -> tuple[str, list[str]]:
    """The source text of ``qtype``'s quant module and its kernels' name expressions."""
    names = [_expression(kernel, qtype) for kernel in _kernels(qtype)]
    return program("quant.cu", *(("quant_int8.cu",) if qtype in INT8_TYPES else ())), names


@functools.cache
def quant_module(qtype: str) -> Any:
    """The compiled ``quant.cu`` (+ ``quant_int8.cu``) with the kernels of ``qtype`` (IQ2_XXS: tables filled in)."""
    import cupy

    code, names = quant_program(qtype)
    module = cupy.RawModule(code=code, options=_OPTIONS, name_expressions=names)
    if qtype == "IQ2_XXS":
        write_global(module, "iq2xxs_i8_words", iq2xxs_int8_words(fill_iq2xxs_grid(module)))
    for name in names:  # compile now (RawModule compiles lazily), inside the caller's thread
        module.get_function(name)
    return module


def iq2xxs_codes(grid: np.ndarray) -> np.ndarray:
    """IQ2_XXS's grid ``[256, 8]`` (magnitudes 8, 25, 43) as the codes 0, 1, 2 that the kernels' tables hold."""
    return np.searchsorted(np.array([8, 25, 43]), np.asarray(grid).reshape(256, 8)).astype(np.uint32)


def write_global(module: Any, name: str, values: np.ndarray) -> None:
    """Copies ``values`` into the module's ``__device__`` array ``name`` (of their element type and size)."""
    import cupy

    cupy.ndarray(values.shape, values.dtype, module.get_global(name))[...] = cupy.asarray(values)


def fill_iq2xxs_grid(module: Any) -> np.ndarray:
    """Writes IQ2_XXS's grid ``[256, 8]`` into the module's ``iq2xxs_grid`` (quant.cu) and returns it."""
    from ds4_core.quants import iq2xxs_tables

    grid, _ = iq2xxs_tables()
    write_global(module, "iq2xxs_grid", grid.astype(np.uint8).reshape(-1))
    return grid


def iq2xxs_int8_words(grid: np.ndarray) -> np.ndarray:
    """The tables of the integer IQ2_XXS kernels (``iq2xxs_i8_words`` in quant_int8.cu) from the grid ``[256, 8]``:
    each row's codes (:func:`iq2xxs_codes`) as eight nibbles (256 words), then each 7-bit sign index with its parity
    as the eighth sign, bit e at nibble bit 4e + 2 (128 words)."""
    nibble = np.uint32(4) * np.arange(8, dtype=np.uint32)
    codes = iq2xxs_codes(grid)
    s7 = np.arange(128, dtype=np.uint32)
    parity = np.array([bin(s).count("1") & 1 for s in range(128)], dtype=np.uint32)
    bits = ((s7 | parity << 7)[:, None] >> np.arange(8, dtype=np.uint32)) & 1
    return np.concatenate([(codes << nibble).sum(axis=1), (bits << (nibble + 2)).sum(axis=1)]).astype(np.uint32)


@functools.cache
def quant_kernel(kernel: str, qtype: str) -> Kernel:
    """The kernel ``kernel`` (a key of :data:`QUANT_KERNELS`, or of :data:`INT8_KERNELS` for a format of
    :data:`INT8_TYPES`) for weight format ``qtype``, launched programmatically (:mod:`.launch`)."""
    return Kernel(quant_module(qtype).get_function(_expression(kernel, qtype)))


#: The prefill kernels' 16-bit types (``"f16"``, ``"bf16"``) -> their names in ``prefill.cu``.
HALF_TYPES: dict[str, str] = {"f16": "Half", "bf16": "BHalf"}
#: Sources of a weight format's prefill module (:mod:`.prefill`), after the shared headers.
PREFILL_SOURCES: tuple[str, ...] = ("quant.cu", "prefill.cu", "moe_tile.cu", "prefill_attend.cu")
#: The prefill module's template kernels of a 16-bit type alone.
PREFILL_HALF_KERNELS: tuple[str, ...] = ("to16", "rope_to16", "swiglu16", "rows_to16")


#: Sources of a weight format's sm_90a module (``moe_wgmma16``, :func:`sm90a_module`), after the shared headers.
WGMMA_SOURCES: tuple[str, ...] = ("quant.cu", "prefill.cu", "moe_tile.cu", "moe_wgmma.cu")


def _tile_kernels(core: str, qtype: str) -> list[str]:
    """The expert tiles ``moe_<core>16`` of ``qtype`` (both 16-bit types, one or two matrices) and their
    shared-memory sizes."""
    return [*(f"moe_{core}16<{qtype}, {o}, {nw}>" for o in HALF_TYPES.values() for nw in (1, 2)),
            *(f"tile_smem<{qtype}, {nw}>" for nw in (1, 2))]


def prefill_kernels(qtype: str) -> list[str]:
    """Name expressions of ``qtype``'s prefill module: the 16-bit dequantizers, the portable expert tiles
    (``moe_mma16``) and their shared-memory sizes, and the 16-bit kernels of :data:`PREFILL_HALF_KERNELS`."""
    halves = HALF_TYPES.values()
    return [*(f"dequant16<{qtype}, {o}>" for o in halves), *_tile_kernels("mma", qtype),
            *(f"{k}<{o}>" for k in PREFILL_HALF_KERNELS for o in halves)]


def wgmma_kernels(qtype: str) -> list[str]:
    """Name expressions of ``qtype``'s sm_90a module: the Hopper expert tiles (``moe_wgmma16``) and their
    shared-memory sizes."""
    return _tile_kernels("wgmma", qtype)


#: Column-register bounds the delta-rule kernel is instantiated for (a head's key width must fit one of them).
DELTA_RULE_DK: tuple[int, ...] = (16, 32, 64, 128, 256)


#: The kernels of ``recurrent.cu``: ``short_conv``, then ``delta_rule`` for each of :data:`DELTA_RULE_DK`.
RECURRENT_KERNELS: tuple[str, ...] = ("short_conv", *(f"delta_rule<{dk}>" for dk in DELTA_RULE_DK))


@functools.cache
def recurrent_module() -> Any:
    """The compiled ``recurrent.cu``: ``short_conv`` and ``delta_rule<DK>`` for each of :data:`DELTA_RULE_DK`."""
    import cupy

    templates = list(RECURRENT_KERNELS[1:])
    module = cupy.RawModule(code=source("recurrent.cu"), options=_OPTIONS, name_expressions=templates)
    for name in RECURRENT_KERNELS:  # short_conv is extern "C": found by its plain name
        module.get_function(name)
    return module


#: The small glue kernels of a decode step: top-k, few-token contractions, hyper-connections, RMSNorm, RoPE,
#: attention and routing weights.
GLUE_SOURCES: tuple[str, ...] = ("select.cu", "rows.cu", "hc.cu", "norm.cu", "attention.cu", "route.cu",
                                 "compress.cu")
GLUE_KERNELS: tuple[str, ...] = ("topk_rank", "dot_rows", "mix_rows", "relu_head_sum", "indexer_scores_rows",
                                 "indexer_scores_spread", "hc_split", "hc_split_norm", "hc_split_norm_rows",
                                 "hc_collapse", "hc_expand", "hc_expand_rows", "rms_norm_rows", "rms_norm_warps",
                                 "row_squares", "rope_rows", "rope_tail", "attend_rows", "attend_merge",
                                 "attend_softmax", "route_scores", "route_weights", "route_topk", "route_linear_topk",
                                 "compress_pool", "compress_finish", "index_select", "index_select_radix", "step_index",
                                 "window_softmax", "gather_experts")


@functools.cache
def glue_module() -> Any:
    """The compiled :data:`GLUE_SOURCES` with the kernels :data:`GLUE_KERNELS`."""
    import cupy

    module = cupy.RawModule(code=program(*GLUE_SOURCES), options=_OPTIONS)
    for name in GLUE_KERNELS:
        module.get_function(name)
    return module


@functools.cache
def glue_kernel(name: str) -> Kernel:
    """The glue kernel ``name`` (of :data:`GLUE_KERNELS`), launched programmatically (:mod:`.launch`)."""
    return Kernel(glue_module().get_function(name))


#: The sampling kernels of ``sample.cu``: a row's argmax and the candidates of the sampler chain.
SAMPLE_KERNELS: tuple[str, ...] = ("argmax_blocks", "chain_candidates")


@functools.cache
def sample_module() -> Any:
    """The compiled ``sample.cu`` with the kernels :data:`SAMPLE_KERNELS`."""
    import cupy

    module = cupy.RawModule(code=source("sample.cu"), options=_OPTIONS)
    for name in SAMPLE_KERNELS:
        module.get_function(name)
    return module


def warm() -> None:
    """Compile (or load from CuPy's cache) every module now, in parallel: a thread a format for its decode kernels
    and, unless ``DS4_CUDA_PREFILL=32``, its tensor-core prefill kernels; one more for the rest."""
    import cupy

    from . import prefill
    from .numerics import tensor_core_prefill

    device = cupy.cuda.Device().id
    with_prefill = tensor_core_prefill()

    def build(qtype: str | None) -> None:
        with cupy.cuda.Device(device):
            if qtype is None:
                recurrent_module()
                glue_module()
                sample_module()
            else:
                quant_module(qtype)
                if with_prefill:
                    prefill.warm(qtype)

    with ThreadPoolExecutor(max_workers=len(QUANT_TYPES) + 1) as pool:
        list(pool.map(build, (*QUANT_TYPES, None)))


def portable_programs() -> dict[str, tuple[str, list[str]]]:
    """Every module the backend compiles through NVRTC for the device's own architecture, by a name: its source text
    and its kernels' name expressions. The sm_90a module (``moe_wgmma.cu``, :func:`sm90a_module`) is not one of them:
    it runs on compute capability 9.0 alone."""
    programs = {}
    for qtype in QUANT_TYPES:
        programs[f"quant {qtype}"] = quant_program(qtype)
        programs[f"prefill {qtype}"] = (program(*PREFILL_SOURCES), prefill_kernels(qtype))
    programs["glue"] = (program(*GLUE_SOURCES), list(GLUE_KERNELS))
    programs["recurrent"] = (source("recurrent.cu"), list(RECURRENT_KERNELS))
    programs["sample"] = (source("sample.cu"), list(SAMPLE_KERNELS))
    return programs
