// Quantized-weight kernels over raw GGUF blocks (compiled by NVRTC through cupy.RawModule).
//
// Each weight format is a struct: QK elements and BYTES bytes per block, and UNIT consecutive
// elements that one thread decodes at a time (`decode(block, part, v)` writes elements
// part*UNIT .. part*UNIT+UNIT-1 of the block into v). Float formats use blocks of UNIT elements.
// The arithmetic follows ds4_core/quants.py (the numpy oracle) operation for operation.

#include <cuda_fp16.h>

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;

// IQ2_XXS magnitudes: 256 grid rows of 8 values (8, 25 or 43), filled from the host once per module.
__device__ __align__(16) u8 iq2xxs_grid[256 * 8];

__device__ __forceinline__ float half_at(const u8* p) {
    u16 bits = (u16)p[0] | ((u16)p[1] << 8);
    return __half2float(__ushort_as_half(bits));
}

__device__ __forceinline__ u16 u16_at(const u8* p) {  // p is 2-byte aligned
    return *reinterpret_cast<const u16*>(p);
}

struct F32 {
    static constexpr int QK = 8, BYTES = 32, UNIT = 8;
    static __device__ __forceinline__ void decode(const u8* b, int, float* v) {
        const float4* p = reinterpret_cast<const float4*>(b);
        float4 a = p[0], c = p[1];
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = c.x; v[5] = c.y; v[6] = c.z; v[7] = c.w;
    }
};

struct F16 {
    static constexpr int QK = 8, BYTES = 16, UNIT = 8;
    static __device__ __forceinline__ void decode(const u8* b, int, float* v) {
        uint4 q = *reinterpret_cast<const uint4*>(b);
        u32 w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            v[2 * i] = __half2float(__ushort_as_half((u16)(w[i] & 0xFFFF)));
            v[2 * i + 1] = __half2float(__ushort_as_half((u16)(w[i] >> 16)));
        }
    }
};

struct BF16 {
    static constexpr int QK = 8, BYTES = 16, UNIT = 8;
    static __device__ __forceinline__ void decode(const u8* b, int, float* v) {
        uint4 q = *reinterpret_cast<const uint4*>(b);
        u32 w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            v[2 * i] = __uint_as_float(w[i] << 16);
            v[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
        }
    }
};

// d (f16), 32 int8 codes. A unit is 8 codes, so four neighbouring lanes read one block's codes contiguously.
struct Q8_0 {
    static constexpr int QK = 32, BYTES = 34, UNIT = 8;
    static __device__ __forceinline__ void decode(const u8* b, int part, float* v) {
        float d = half_at(b);
#pragma unroll
        for (int i = 0; i < 4; i++) {
            u16 two = u16_at(b + 2 + 8 * part + 2 * i);
            v[2 * i] = (float)(signed char)(two & 0xFF) * d;
            v[2 * i + 1] = (float)(signed char)(two >> 8) * d;
        }
    }
};

// d (f16), 16 bytes: element i < 16 is the low nibble of byte i, element 16 + i its high nibble; minus 8.
struct Q4_0 {
    static constexpr int QK = 32, BYTES = 18, UNIT = 32;
    static __device__ __forceinline__ void decode(const u8* b, int, float* v) {
        float d = half_at(b);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            u16 two = u16_at(b + 2 + 2 * i);
            v[2 * i] = (float)((int)(two & 0xF) - 8) * d;
            v[2 * i + 1] = (float)((int)((two >> 8) & 0xF) - 8) * d;
            v[16 + 2 * i] = (float)((int)((two >> 4) & 0xF) - 8) * d;
            v[16 + 2 * i + 1] = (float)((int)(two >> 12) - 8) * d;
        }
    }
};

// d, dmin (f16), 12 bytes of 6-bit scales/mins, 128 bytes of nibbles. A unit is 64 elements: sub-blocks
// 2g (low nibbles of bytes 32g..32g+31) and 2g+1 (their high nibbles).
struct Q4_K {
    static constexpr int QK = 256, BYTES = 144, UNIT = 64;
    static __device__ __forceinline__ void scale_min(const u8* p, int s, int& sc, int& m) {
        if (s < 4) {
            sc = p[s] & 63;
            m = p[s + 4] & 63;
        } else {
            sc = (p[s + 4] & 0xF) | ((p[s - 4] >> 6) << 4);
            m = (p[s + 4] >> 4) | ((p[s] >> 6) << 4);
        }
    }
    static __device__ __forceinline__ void decode(const u8* b, int g, float* v) {
        float d = half_at(b), dmin = half_at(b + 2);
        int sc0, m0, sc1, m1;
        scale_min(b + 4, 2 * g, sc0, m0);
        scale_min(b + 4, 2 * g + 1, sc1, m1);
        float a0 = d * (float)sc0, o0 = dmin * (float)m0, a1 = d * (float)sc1, o1 = dmin * (float)m1;
        const uint4* q = reinterpret_cast<const uint4*>(b + 16 + 32 * g);
        uint4 h0 = q[0], h1 = q[1];
        u32 w[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
#pragma unroll
        for (int i = 0; i < 32; i++) {
            u32 byte = (w[i / 4] >> (8 * (i % 4))) & 0xFF;
            v[i] = a0 * (float)(byte & 0xF) - o0;
            v[32 + i] = a1 * (float)(byte >> 4) - o1;
        }
    }
};

// 128 bytes low nibbles, 64 bytes high bit pairs, 16 int8 scales, d (f16). A unit is the 16 elements of one
// scale: element e = 128h + 32q + l takes the nibble (q >> 1) of ql[64h + 32(q & 1) + l] and bits 2q of qh[32h + l].
struct Q6_K {
    static constexpr int QK = 256, BYTES = 210, UNIT = 16;
    static __device__ __forceinline__ void decode(const u8* b, int part, float* v) {
        int e0 = 16 * part, h = e0 / 128, q = (e0 % 128) / 32, l0 = e0 % 32;
        float a = half_at(b + 208) * (float)(signed char)b[192 + part];
        const u8* ql = b + 64 * h + 32 * (q & 1) + l0;
        const u8* qh = b + 128 + 32 * h + l0;
#pragma unroll
        for (int i = 0; i < 16; i++) {
            int low = (ql[i] >> (4 * (q >> 1))) & 0xF;
            int high = (qh[i] >> (2 * q)) & 3;
            v[i] = a * (float)((low | (high << 4)) - 32);
        }
    }
};

// 16 scale bytes (low nibble scale, high nibble min), 64 bytes of 2-bit codes, d, dmin (f16). A unit is the
// 16 elements of one scale byte: element e = 128h + 32j + l is bits 2j of qs[32h + l].
struct Q2_K {
    static constexpr int QK = 256, BYTES = 84, UNIT = 16;
    static __device__ __forceinline__ void decode(const u8* b, int part, float* v) {
        int e0 = 16 * part, h = e0 / 128, j = (e0 % 128) / 32, l0 = e0 % 32;
        float d = half_at(b + 80), dmin = half_at(b + 82);
        u8 packed = b[part];
        float a = d * (float)(packed & 0xF), o = dmin * (float)(packed >> 4);
        const u32* q = reinterpret_cast<const u32*>(b + 16 + 32 * h + l0);
        u32 w[4] = {q[0], q[1], q[2], q[3]};
#pragma unroll
        for (int i = 0; i < 16; i++) {
            u32 byte = (w[i / 4] >> (8 * (i % 4))) & 0xFF;
            v[i] = a * (float)((byte >> (2 * j)) & 3) - o;
        }
    }
};

// d (f16), then 8 groups of 8 bytes: 4 grid indices and a u32 holding four 7-bit sign indices and a
// 4-bit scale. A unit is the 8 elements of one grid index (part = 4 * group + k); the eighth sign bit
// makes the minus count even.
struct IQ2_XXS {
    static constexpr int QK = 256, BYTES = 66, UNIT = 8;
    static __device__ __forceinline__ void decode(const u8* b, int part, float* v) {
        int g = part / 4, k = part % 4;
        const u8* p = b + 2 + 8 * g;
        u32 aux = (u32)u16_at(p + 4) | ((u32)u16_at(p + 6) << 16);
        float scale = half_at(b) * ((float)(aux >> 28) + 0.5f) * 0.25f;
        const u8* row = iq2xxs_grid + 8 * p[k];
        u32 signs = (aux >> (7 * k)) & 127;
        signs |= (__popc(signs) & 1) << 7;
        uint2 mags = *reinterpret_cast<const uint2*>(row);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            u32 m = ((i < 4 ? mags.x : mags.y) >> (8 * (i % 4))) & 0xFF;
            float value = scale * (float)m;
            v[i] = (signs >> i) & 1 ? -value : value;
        }
    }
};

// E8M0 scale byte, 16 bytes of E2M1 codes (low nibbles: elements 0-15, high nibbles: 16-31).
struct MXFP4 {
    static constexpr int QK = 32, BYTES = 17, UNIT = 32;
    static __device__ __forceinline__ void decode(const u8* b, int, float* v) {
        const float values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
        float scale = ldexpf(1.0f, (int)b[0] - 128);
#pragma unroll
        for (int i = 0; i < 16; i++) {
            u8 byte = b[1 + i];
            v[i] = values[byte & 0xF] * scale;
            v[16 + i] = values[byte >> 4] * scale;
        }
    }
};

template <class Q>
__device__ __forceinline__ const u8* unit_block(const u8* row, int u, int& part) {
    constexpr int PARTS = Q::QK / Q::UNIT;
    part = u % PARTS;
    return row + (long long)(u / PARTS) * Q::BYTES;
}

__device__ __forceinline__ float warp_sum(float s) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    return s;
}

#define MAX_TOKENS 8

// y[t, r] = sum_c W[r, c] x[t, c] for t < ntok <= MAX_TOKENS. One warp per row r; blockDim.x = 32 * rows per block.
template <class Q>
__global__ void gemv(const u8* __restrict__ w, long long row_bytes, int nrows, int ncols,
                     const float* __restrict__ x, int ntok, float* __restrict__ y) {
    int lane = threadIdx.x & 31;
    int r = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (r >= nrows) return;
    const u8* row = w + (long long)r * row_bytes;
    float acc[MAX_TOKENS];
#pragma unroll
    for (int t = 0; t < MAX_TOKENS; t++) acc[t] = 0.f;
    int units = ncols / Q::UNIT;
    for (int u = lane; u < units; u += 32) {
        int part;
        const u8* blk = unit_block<Q>(row, u, part);
        float v[Q::UNIT];
        Q::decode(blk, part, v);
        const float* xu = x + (long long)u * Q::UNIT;
#pragma unroll
        for (int t = 0; t < MAX_TOKENS; t++) {
            if (t < ntok) {
                const float4* xt = reinterpret_cast<const float4*>(xu + (long long)t * ncols);
                float s = 0.f;
#pragma unroll
                for (int i = 0; i < Q::UNIT / 4; i++) {
                    float4 xv = xt[i];
                    s += v[4 * i] * xv.x + v[4 * i + 1] * xv.y + v[4 * i + 2] * xv.z + v[4 * i + 3] * xv.w;
                }
                acc[t] += s;
            }
        }
    }
#pragma unroll
    for (int t = 0; t < MAX_TOKENS; t++) {
        if (t < ntok) {
            float s = warp_sum(acc[t]);
            if (lane == 0) y[(long long)t * nrows + r] = s;
        }
    }
}

// Routed-expert GEMV for P (token, slot) pairs: y[p, r] = sum_c W_{idx[p]}[r, c] x[p / x_div, c].
// Expert ids are read on the device; a negative id gives zeros. grid = (row blocks, P).
template <class Q>
__global__ void moe_gemv(const u8* __restrict__ w, long long expert_bytes, long long row_bytes, int nrows, int ncols,
                         const int* __restrict__ idx, const float* __restrict__ x, int x_div,
                         float* __restrict__ y) {
    int lane = threadIdx.x & 31;
    int r = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int p = blockIdx.y;
    if (r >= nrows) return;
    int e = idx[p];
    float acc = 0.f;
    if (e >= 0) {
        const u8* row = w + (long long)e * expert_bytes + (long long)r * row_bytes;
        const float* xp = x + (long long)(p / x_div) * ncols;
        int units = ncols / Q::UNIT;
        for (int u = lane; u < units; u += 32) {
            int part;
            const u8* blk = unit_block<Q>(row, u, part);
            float v[Q::UNIT];
            Q::decode(blk, part, v);
            const float4* xt = reinterpret_cast<const float4*>(xp + (long long)u * Q::UNIT);
#pragma unroll
            for (int i = 0; i < Q::UNIT / 4; i++) {
                float4 xv = xt[i];
                acc += v[4 * i] * xv.x + v[4 * i + 1] * xv.y + v[4 * i + 2] * xv.z + v[4 * i + 3] * xv.w;
            }
        }
    }
    acc = warp_sum(acc);
    if (lane == 0) y[(long long)p * nrows + r] = acc;
}

// out[i, :] = row rows[i] of W as float32 (rows == nullptr: row i). One thread per unit.
template <class Q>
__global__ void dequant_rows(const u8* __restrict__ w, long long row_bytes, int ncols, const int* __restrict__ rows,
                             int nrows, float* __restrict__ out) {
    long long units = ncols / Q::UNIT;
    long long id = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (id >= units * nrows) return;
    long long i = id / units;
    int u = (int)(id % units);
    long long src = rows ? (long long)rows[i] : i;
    int part;
    const u8* blk = unit_block<Q>(w + src * row_bytes, u, part);
    float v[Q::UNIT];
    Q::decode(blk, part, v);
    float* o = out + i * ncols + (long long)u * Q::UNIT;
#pragma unroll
    for (int k = 0; k < Q::UNIT; k++) o[k] = v[k];
}
