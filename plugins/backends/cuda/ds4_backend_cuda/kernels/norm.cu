// RMSNorm and interleaved RoPE as one launch each. As CuPy array code they cost about 5 and 12 launches per call,
// and a decode step calls them a few dozen times, so in a recorded graph their launch gaps outweighed the work.

#include <cuda_fp16.h>

// y[r] = x[r] / sqrt(mean(x[r]^2) + eps) [· w] for rows of width d; one block per row (blockDim.x a multiple of 32,
// at most 1024); w may be null. A thread's first HELD elements and their weights are loaded at once and kept in
// registers for the second pass (a strided loop would wait for each load in turn, and weights loaded after the sum
// add a second memory round trip to a launch of a few µs); wider rows loop over the rest. With pos non-null the
// normalised row is also RoPE'd as rope_rows does (row r of token r / rows_per_token; d <= HELD · blockDim.x): a
// pair's two channels are held by neighbouring lanes.
#define HELD 8
extern "C" __global__ void rms_norm_rows(const float* __restrict__ x, const float* __restrict__ w, int d, float eps,
                                         float* __restrict__ y, const int* __restrict__ pos,
                                         const float* __restrict__ inv_freq, int half, int rows_per_token,
                                         const int* __restrict__ y_rows) {
    grid_wait();
    __shared__ float partial[32];
    const float* xr = x + (size_t)blockIdx.x * d;
    float v[HELD], g[HELD];
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < HELD; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        v[k] = i < d ? xr[i] : 0.f;
        g[k] = w && i < d ? w[i] : 1.f;
    }
#pragma unroll
    for (int k = 0; k < HELD; ++k) ss = fmaf(v[k], v[k], ss);
    for (int i = threadIdx.x + HELD * blockDim.x; i < d; i += blockDim.x) ss = fmaf(xr[i], xr[i], ss);
    const float root = sqrtf(block_sum(ss, partial) / (float)d + eps);
    float* yr = y + (size_t)(y_rows ? y_rows[blockIdx.x] : blockIdx.x) * d;  // y_rows: rows of y given, one a row
    const float p = pos ? (float)pos[blockIdx.x / rows_per_token] : 0.f;
#pragma unroll
    for (int k = 0; k < HELD; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        float out = v[k] / root * g[k];
        if (pos) {  // the same for the whole block
            const float partner = __shfl_xor_sync(0xffffffffu, out, 1);  // channel i ^ 1
            const int j = i - (d - 2 * half);
            if (j >= 0 && i < d) {
                float s, co;
                sincosf(p * inv_freq[j >> 1], &s, &co);
                out = (j & 1) ? partner * s + out * co : out * co - partner * s;
            }
        }
        if (i < d) yr[i] = out;
    }
    for (int i = threadIdx.x + HELD * blockDim.x; i < d; i += blockDim.x) yr[i] = w ? xr[i] / root * w[i] : xr[i] / root;
}

// rms_norm_rows for a prefill's many short rows: a warp a row (d % 128 == 0, d <= 128 · WARP_QUADS), as many rows
// a block as it has warps, so no barrier and no block per row (the block a row of rms_norm_rows moved its queries at a
// third of the copy rate). Lane l holds float4s l, l + 32, .. of its row: a rotated pair is in one float4. The same
// arithmetic as rms_norm_rows but the order of the sum of squares. With y16 non-null the rows go there as fp16
// (rounded to nearest) instead of to y: a prefill's queries, whose products take 16-bit operands.
#define WARP_QUADS 8
extern "C" __global__ void rms_norm_warps(const float* __restrict__ x, const float* __restrict__ w, int d, float eps,
                                          float* __restrict__ y, __half2* __restrict__ y16, long long rows,
                                          const int* __restrict__ pos, const float* __restrict__ inv_freq, int half,
                                          int rows_per_token) {
    grid_wait();
    const long long r = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= rows) return;  // whole warps leave together
    const int lane = threadIdx.x & 31, quads = d / 128;
    const float4* xr = reinterpret_cast<const float4*>(x + r * d);
    float4 v[WARP_QUADS];
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < WARP_QUADS; ++k)
        if (k < quads) v[k] = xr[lane + 32 * k];
#pragma unroll
    for (int k = 0; k < WARP_QUADS; ++k)
        if (k < quads) ss = fmaf(v[k].x, v[k].x, fmaf(v[k].y, v[k].y, fmaf(v[k].z, v[k].z, fmaf(v[k].w, v[k].w, ss))));
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float root = sqrtf(ss / (float)d + eps);
    const float p = pos ? (float)pos[r / rows_per_token] : 0.f;
    float4* yr = reinterpret_cast<float4*>(y + r * d);
#pragma unroll
    for (int k = 0; k < WARP_QUADS; ++k) {
        if (k >= quads) continue;
        // the weights here, not beside the row: their registers cost a block a multiprocessor (86 registers: two)
        const float4 g = w ? reinterpret_cast<const float4*>(w)[lane + 32 * k] : make_float4(1.f, 1.f, 1.f, 1.f);
        float o[4] = {v[k].x / root * g.x, v[k].y / root * g.y, v[k].z / root * g.z, v[k].w / root * g.w};
        const int c = 4 * (lane + 32 * k);
#pragma unroll
        for (int e = 0; e < 4; e += 2) {
            const int j = c + e - (d - 2 * half);
            if (pos && j >= 0) {
                float s, co;
                sincosf(p * inv_freq[j >> 1], &s, &co);
                const float a = o[e], b = o[e + 1];
                o[e] = a * co - b * s;
                o[e + 1] = a * s + b * co;
            }
        }
        if (y16) {  // one 8-byte store, as the float4's is one 16-byte store
            const __half2 a = __floats2half2_rn(o[0], o[1]), b = __floats2half2_rn(o[2], o[3]);
            reinterpret_cast<uint2*>(y16)[(r * d + c) / 4] =
                make_uint2(*reinterpret_cast<const unsigned*>(&a), *reinterpret_cast<const unsigned*>(&b));
        } else {
            yr[lane + 32 * k] = make_float4(o[0], o[1], o[2], o[3]);
        }
    }
}

// Rotation of the trailing 2·half channels of each row of width d, pairs (2i, 2i+1) by pos[t] · inv_freq[i]
// (backwards when inverse); the leading channels are copied. Rows are grouped per token: row r belongs to token
// r / rows_per_token. One thread per element; n = all elements.
extern "C" __global__ void rope_rows(const float* __restrict__ x, const int* __restrict__ pos,
                                     const float* __restrict__ inv_freq, long long n, int d, int half,
                                     int rows_per_token, int inverse, float* __restrict__ y) {
    grid_wait();
    const long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n) return;
    const int c = (int)(e % d);
    const int j = c - (d - 2 * half);
    if (j < 0) {
        y[e] = x[e];
        return;
    }
    const long long row = e / d;
    const float angle = (float)pos[row / rows_per_token] * inv_freq[j >> 1];
    float s, co;
    sincosf(angle, &s, &co);
    if (inverse) s = -s;
    const float a = x[e - (j & 1)], b = x[e - (j & 1) + 1];
    y[e] = (j & 1) ? a * s + b * co : a * co - b * s;
}

// rope_rows in place on the rotated channels alone: pair i < half of row r (the trailing 2·half of its d channels)
// turned by pos[r / rows_per_token] · inv_freq[i] (backwards when inverse), the same arithmetic as rope_rows; the
// leading channels are neither read nor written. One thread per pair; n = rows · half.
extern "C" __global__ void rope_tail(float* __restrict__ x, const int* __restrict__ pos,
                                     const float* __restrict__ inv_freq, long long n, int d, int half,
                                     int rows_per_token, int inverse) {
    grid_wait();
    const long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n) return;
    const long long row = e / half;
    const int i = (int)(e - row * half);
    float s, co;
    sincosf((float)pos[row / rows_per_token] * inv_freq[i], &s, &co);
    if (inverse) s = -s;
    float2* pair = reinterpret_cast<float2*>(x + row * d + d - 2 * half) + i;
    const float2 v = *pair;
    *pair = make_float2(v.x * co - v.y * s, v.x * s + v.y * co);
}

// out[r * ld] = the sum of squares of row r of x [rows, d] (d % 4 == 0, x 16-byte aligned): a prefill's RMSNorm
// scale of the hyper-connection streams, whose mix needs no normalised copy of them. One block per row; a thread's
// float4 loads are all issued before its sum.
#define SQUARES_LOADS 4
extern "C" __global__ void row_squares(const float* __restrict__ x, int d, float* __restrict__ out, int ld) {
    grid_wait();
    __shared__ float partial[32];
    const float4* xr = reinterpret_cast<const float4*>(x + (size_t)blockIdx.x * d);
    const int d4 = d / 4;
    float ss = 0.f;
    for (int i0 = threadIdx.x; i0 < d4; i0 += SQUARES_LOADS * blockDim.x) {
        float4 v[SQUARES_LOADS];
#pragma unroll
        for (int k = 0; k < SQUARES_LOADS; ++k) {
            const int i = i0 + k * blockDim.x;
            v[k] = i < d4 ? xr[i] : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int k = 0; k < SQUARES_LOADS; ++k)
            ss = fmaf(v[k].x, v[k].x, fmaf(v[k].y, v[k].y, fmaf(v[k].z, v[k].z, fmaf(v[k].w, v[k].w, ss))));
    }
    ss = block_sum(ss, partial);
    if (threadIdx.x == 0) out[(size_t)blockIdx.x * ld] = ss;
}
