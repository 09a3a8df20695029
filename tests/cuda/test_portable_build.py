"""Every kernel module builds for compute capability 8.0, the backend's floor (the probe's), with nvcc and no GPU.

The GPU tests run on Hopper, where a Hopper-only instruction outside its guard (``kernels/pdl.cuh``) would pass
unseen; code built for sm_80 runs on every 8.x device. The builds take the text and the kernel names that the backend
hands NVRTC (``modules.portable_programs``; the Hopper modules' ``modules.wgmma_kernels``). Dynamic shared memory is a
launch-time limit, not checked here."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import pytest
from ds4_backend_cuda.modules import QUANT_TYPES, WGMMA_SOURCES, portable_programs, program, wgmma_kernels
from ds4_backend_cuda.nvcc_build import build_cubin, functions, instances, matches, nvcc
from ds4_backend_cuda.probe import MIN_COMPUTE_CAPABILITY

needs_nvcc = pytest.mark.skipif(nvcc() is None, reason="needs CUDA's nvcc (no GPU)")
FLOOR = "sm_{}{}".format(*MIN_COMPUTE_CAPABILITY)


def _build_all(programs: dict[str, tuple[str, list[str]]], arch: str, tmp_path) -> None:
    """Builds every program for ``arch`` in parallel; asserts each built and holds every kernel it names."""
    def build(name):
        code, kernels = programs[name]
        cubin = tmp_path / f"{name.replace(' ', '_')}.cubin"
        done = build_cubin(code, kernels, arch, cubin)
        return done, functions(cubin.read_bytes()) if done.returncode == 0 else []

    with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
        built = dict(zip(programs, pool.map(build, programs), strict=True))
    failed = {name: done.stderr[-3000:] for name, (done, _) in built.items() if done.returncode}
    assert not failed, failed
    missing = {name: [k for k in programs[name][1] if not any(matches(k, f) for f in found)]
               for name, (_, found) in built.items()}
    assert not any(missing.values()), missing


@needs_nvcc
def test_every_module_builds_for_the_probes_floor_with_every_kernel(tmp_path):
    assert FLOOR == "sm_80"
    programs = portable_programs()
    assert len(programs) == 23  # 10 formats' quant and prefill modules, glue, recurrent, sample
    _build_all(programs, FLOOR, tmp_path)


@needs_nvcc
def test_every_formats_hopper_module_builds_for_sm90a_with_every_kernel(tmp_path):
    """The sm_90a modules (``moe_wgmma16``), which the backend compiles for compute capability 9.0 at load, one a
    format."""
    code = program(*WGMMA_SOURCES)
    _build_all({qtype: (code, wgmma_kernels(qtype)) for qtype in QUANT_TYPES}, "sm_90a", tmp_path)


@needs_nvcc
def test_the_prefill_module_needs_the_floor(tmp_path):
    """Below 8.0 the prefill's tiles do not build, so a Turing device must be refused by the probe, not by NVRTC."""
    code, kernels = portable_programs()["prefill F16"]
    done = build_cubin(code, kernels, "sm_75", tmp_path / "prefill.cubin")
    assert done.returncode != 0 and "requires .target sm_80" in done.stderr


@needs_nvcc
def test_a_hopper_instruction_fails_the_sm80_build_unless_guarded(tmp_path):
    bare = '__global__ void k(int* x) { asm volatile("griddepcontrol.wait;" ::: "memory"); *x = 1; }'
    done = build_cubin(bare, ["k"], "sm_80", tmp_path / "bare.cubin")
    assert done.returncode != 0 and "griddepcontrol" in done.stderr
    guarded = program() + '__global__ void k(int* x) { grid_wait(); *x = 1; }'
    done = build_cubin(guarded, ["k"], "sm_80", tmp_path / "guarded.cubin")
    assert done.returncode == 0, done.stderr
    assert "_Z1kPi" in functions((tmp_path / "guarded.cubin").read_bytes())


def test_template_kernels_are_instantiated_and_matched_by_their_arguments():
    assert instances(["route_topk"]) == ""  # extern "C": compiled as it is
    assert instances(["moe_gate_up_i8<IQ2_XXS>", "route_topk", "gemv<Q8_0, 8>"]) == (
        "static void* ds4_instances[] = {(void*)&moe_gate_up_i8<IQ2_XXS>, (void*)&gemv<Q8_0, 8>};\n")
    assert matches("moe_gate_up_i8<IQ2_XXS>", "_Z14moe_gate_up_i8I7IQ2_XXSEvPKh")
    assert not matches("moe_gate_up_i8<Q8_0>", "_Z14moe_gate_up_i8I7IQ2_XXSEvPKh")
    assert matches("gemv<Q8_0, 8>", "_Z4gemvI4Q8_0Li8EEvPKhxii")
    assert not matches("gemv<Q8_0, 1>", "_Z4gemvI4Q8_0Li8EEvPKhxii")
    assert not matches("gemv<Q8_0, 8>", "_Z7gemv_i8I4Q8_0EvPKhxii")
    assert matches("gemv_i8", "_Z7gemv_i8I4Q8_0EvPKhxii")  # a plain name: every instance
    assert matches("route_topk", "route_topk") and not matches("route_topk", "route_topk_rows")
