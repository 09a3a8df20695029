"""Would the routed IQ2_XXS gate/up run faster over a repacked layout? A probe, not the backend's kernel.

A GGUF IQ2_XXS block is 66 bytes (an fp16 scale, then 64 code bytes), so a lane's 8 bytes of a group sit at 2-byte
alignment: the decode kernel (``moe_gate_up_i8<IQ2_XXS>``) stages each chunk through shared memory and puts every
group together from 2-byte reads. Here each row is repacked in place: its blocks' 64-byte codes one after the other
(16-byte aligned), then their scales, the same bytes in the same row (1056 for 4096 columns), so rows and experts
keep their offsets. A kernel over that layout (below) loads a lane's group
as one aligned 8-byte word, keeps the next chunk's in registers, and reads the rows' scales from shared memory; its
dot products, their order and the SwiGLU are the decode kernel's, so the outputs must agree bit for bit, which is
checked. Both are timed on Flash's shapes (6 of 256 experts, 2 x 2048 rows of 4096, a new expert set each launch, in
CUDA graphs, both launched programmatically), with the activation handed over quantized as in a step.

Usage: python benchmarks/iq2_repack_probe.py [--rounds 3]   (needs a GPU with the CUDA backend)
"""

from __future__ import annotations

import argparse

import cupy as cp
import numpy as np
from decode_gemvs import PAIRS, SETS, D, E, F, graph_us, report
from ds4_backend_cuda import gemv, launch, modules
from ds4_bench.synthetic_device import copy_bandwidth, device_blocks

from ds4_core.backend import Weight
from ds4_core.quants import iq2xxs_tables

_SOURCE = r'''typedef unsigned int u32;
typedef unsigned short u16;
#include <cuda_fp16.h>

// The routed IQ2_XXS gate/up of one token over repacked rows: a row's blocks' 64 code bytes apiece (ncols / 4
// bytes, 16-byte aligned), then their fp16 scales (ncols / 128 bytes). A lane loads its group's 8 code bytes as one
// aligned uint2.
#ifndef PROBE_WARPS
#define PROBE_WARPS 8
#endif
#ifndef PROBE_MIN
#define PROBE_MIN 3  // blocks a multiprocessor the registers are bounded for
#endif
#define PROBE_ROWS 4  // rows of each matrix a warp
// The palette words of the prmt: literals, or (PROBE_PALETTE) read from the table, which keeps ptxas from copying a
// literal into a register before every prmt.
#ifdef PROBE_PALETTE
#define PALETTE_ARGS , u32 pos, u32 neg
#define PALETTE_PASS , pos, neg
#else
#define PALETTE_ARGS
#define PALETTE_PASS
#endif
__device__ __forceinline__ int probe_signed_bytes(u32 selectors PALETTE_ARGS) {
    u32 v;
#ifdef PROBE_PALETTE
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(v) : "r"(pos), "r"(neg), "r"(selectors));
#else
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(v) : "r"(0x002B1908u), "r"(0x00D5E7F8u), "r"(selectors));
#endif
    return (int)v;
}
__device__ __forceinline__ float probe_dot(uint2 w, u32 dbits, const int (&q)[8], float dx,
                                           const u32* table PALETTE_ARGS) {
    const u32* codes = table;
    const u32* signs = table + 256;
    int sum = 0;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        const u32 sel = codes[(w.x >> (8 * k)) & 0xFF] | signs[(w.y >> (7 * k)) & 127];
        sum = __dp4a(probe_signed_bytes(sel PALETTE_PASS), q[2 * k], sum);
        sum = __dp4a(probe_signed_bytes(sel >> 16 PALETTE_PASS), q[2 * k + 1], sum);
    }
    return __half2float(__ushort_as_half((u16)dbits)) * dx * 0.125f * (float)(sum * (int)(2 * (w.y >> 28) + 1));
}
extern "C" __global__ void __launch_bounds__(32 * PROBE_WARPS, PROBE_MIN) gate_up_repacked(
        const unsigned char* __restrict__ wg, const unsigned char* __restrict__ wu, const u32* __restrict__ words,
        int nrows, const int* __restrict__ idx,
        const unsigned char* __restrict__ act, int ncols, float* __restrict__ h) {
    __shared__ __align__(16) u32 table[388];
    __shared__ __align__(16) u16 scales[PROBE_WARPS][2 * PROBE_ROWS][16];  // a warp's rows' block scales
    for (int i = threadIdx.x; i < 386; i += blockDim.x) table[i] = words[i];  // codes, signs, palette
    __syncthreads();
#if __CUDA_ARCH__ >= 900  // as the backend's grid_wait (pdl.cuh), after the same constant prologue
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, p = blockIdx.y, e = idx[p];
    const int r0 = (blockIdx.x * PROBE_WARPS + warp) * PROBE_ROWS;
    const long long row0 = (long long)e * nrows + r0;
    const int words_a_row = ncols / 32 + ncols / 1024, chunks = ncols / 1024;  // uint2 a row; chunks of 32 groups
    const uint2* gq = reinterpret_cast<const uint2*>(wg) + row0 * words_a_row + lane;
    const uint2* uq = reinterpret_cast<const uint2*>(wu) + row0 * words_a_row + lane;
    {  // the rows' scales, 32 bytes a row after its codes: a lane loads 8 of them (ncols = 4096)
        const int row = lane >> 2, part = lane & 3;
        const uint2* from = reinterpret_cast<const uint2*>(row < PROBE_ROWS ? wg : wu) +
                            (row0 + (row & (PROBE_ROWS - 1))) * words_a_row + ncols / 32 + part;
        *reinterpret_cast<uint2*>(&scales[warp][row][4 * part]) = *from;
    }
    const signed char* aq = reinterpret_cast<const signed char*>(act);
    const float* ad = reinterpret_cast<const float*>(act + ncols + ncols / 4);
    uint2 w[8];
#pragma unroll
    for (int k = 0; k < 4; k++) {
        w[k] = gq[k * words_a_row];
        w[4 + k] = uq[k * words_a_row];
    }
    __syncwarp();
    float acc[8] = {};
#ifdef PROBE_PALETTE
    const u32 pos = table[384], neg = table[385];
#endif
#pragma unroll 1
    for (int c = 0; c < chunks; c++) {
        uint2 wn[8];
        if (c + 1 < chunks) {
            const int at = (c + 1) * 32;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                wn[k] = gq[k * words_a_row + at];
                wn[4 + k] = uq[k * words_a_row + at];
            }
        }
        const int grp = c * 32 + lane;
        const int4* xv = reinterpret_cast<const int4*>(aq + 32 * grp);
        const int4 qa = xv[0], qb = xv[1];
        const int q[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
        const float dx = ad[grp];
#pragma unroll
        for (int k = 0; k < 8; k++)
            acc[k] += probe_dot(w[k], scales[warp][k][4 * c + (lane >> 3)], q, dx, table PALETTE_PASS);
        if (c + 1 < chunks) {
#pragma unroll
            for (int k = 0; k < 8; k++) w[k] = wn[k];
        }
    }
    float g = 0.f, u = 0.f;
#pragma unroll
    for (int k = 0; k < PROBE_ROWS; k++) {
        float gk = acc[k], uk = acc[PROBE_ROWS + k];
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) {
            gk += __shfl_xor_sync(0xffffffffu, gk, off);
            uk += __shfl_xor_sync(0xffffffffu, uk, off);
        }
        if (lane == k) {
            g = gk;
            u = uk;
        }
    }
    if (lane < PROBE_ROWS && r0 + lane < nrows) h[(long long)p * nrows + r0 + lane] = g / (1.0f + expf(-g)) * u;
}
'''
_ROWS = 4  # PROBE_ROWS
#: Variants timed: (name, warps a block, blocks a multiprocessor, palette read from the table).
_VARIANTS = (("repacked rows", 8, 3, False), ("repacked, palette from the table", 8, 3, True),
             ("repacked, palette, 4-warp blocks", 4, 6, True))


def repacked(raw: cp.ndarray) -> cp.ndarray:
    """IQ2_XXS rows ``[rows, 66 · blocks]`` as each row's blocks' code bytes, then their scales (the same shape)."""
    blocks = raw.reshape(raw.shape[0], -1, 66)
    return cp.concatenate([blocks[:, :, 2:].reshape(raw.shape[0], -1), blocks[:, :, :2].reshape(raw.shape[0], -1)],
                          axis=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(1)
    roof = copy_bandwidth() / 1e9
    print(f"copy bandwidth (read + write, as ds4 bench measures it) {roof:.0f} GB/s")
    sets = [cp.asarray(rng.choice(E, PAIRS, replace=False).astype(np.int32)) for _ in range(SETS)]
    gate, up = (Weight(n, "IQ2_XXS", (E, F, D), device_blocks("IQ2_XXS", E * F, D)) for n in ("gate", "up"))
    wg, wu = repacked(gate.data), repacked(up.data)
    palette = np.array([0x002B1908, 0x00D5E7F8], np.uint32)  # bytes 8, 25, 43 and their negations
    words = cp.asarray(np.concatenate([modules.iq2xxs_int8_words(iq2xxs_tables()[0]), palette]))
    act = cp.zeros(gemv.act_bytes(D), cp.uint8)  # the handed-over activation: codes, half sums, scales
    act[:D] = cp.asarray(rng.integers(-127, 128, D).astype(np.int8).view(np.uint8))
    act[D + D // 4:] = cp.asarray(rng.uniform(0.01, 0.1, D // 32).astype(np.float32).view(np.uint8))
    x = cp.zeros((1, D), cp.float32)
    kernels = {name: (launch.Kernel(cp.RawModule(code=_SOURCE, options=(
        "--std=c++17", f"-DPROBE_WARPS={warps}", f"-DPROBE_MIN={blocks}", *(("-DPROBE_PALETTE",) if table else ())),
    ).get_function("gate_up_repacked")), warps) for name, warps, blocks, table in _VARIANTS}
    h_main, h_probe = cp.empty((PAIRS, F), cp.float32), cp.empty((PAIRS, F), cp.float32)

    def main_launch(s: cp.ndarray) -> object:
        k, grid, block, a = gemv.moe_gate_up_launch(gate, up, s, x, PAIRS, 0.0, h_main, int8=True, act_in=act)
        return lambda: k(grid, block, a)

    def probe_launch(name: str, s: cp.ndarray) -> object:
        kernel, warps = kernels[name]
        a = (wg, wu, words, np.int32(F), s, act, np.int32(D), h_probe)
        return lambda: kernel((F // (warps * _ROWS), PAIRS), (32 * warps,), a)

    for name in kernels:
        for s in sets[:2]:
            main_launch(s)()
            h_probe.fill(np.nan)
            probe_launch(name, s)()
            cp.cuda.Device().synchronize()
            diff = float(cp.abs(h_main - h_probe).max())
            print(f"{name}, experts {cp.asnumpy(s).tolist()}: largest |h| {float(cp.abs(h_main).max()):.4g}, "
                  f"largest difference {diff:.3g}{' (bit for bit)' if diff == 0 else ''}")
    nbytes = 2 * PAIRS * gate.data.nbytes // E
    for r in range(args.rounds):
        report(f"decode kernel, round {r + 1}", graph_us([main_launch(s) for s in sets]), nbytes, roof)
        for name in kernels:
            report(f"{name}, round {r + 1}", graph_us([probe_launch(name, s) for s in sets]), nbytes, roof)


if __name__ == "__main__":
    main()
