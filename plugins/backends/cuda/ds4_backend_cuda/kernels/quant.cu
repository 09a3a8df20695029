// Quantized-weight kernels over raw GGUF blocks (compiled by NVRTC through cupy.RawModule).
//
// Each weight format is a struct: QK elements and BYTES bytes per block, decoded 8 consecutive elements at a
// time (`decode(block, part, v)` writes elements 8*part .. 8*part+7 of the block into v), and CHUNK, the blocks
// of one row that a warp stages in shared memory at once (about 1 KB). The arithmetic follows
// ds4_core/quants.py (the numpy oracle) operation for operation.

#include <cuda_fp16.h>

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

// IQ2_XXS magnitudes: 256 grid rows of 8 values (8, 25 or 43), filled from the host once per module.
__device__ __align__(16) u8 iq2xxs_grid[256 * 8];

__device__ __forceinline__ float half_at(const u8* p) {
    u16 bits = (u16)p[0] | ((u16)p[1] << 8);
    return __half2float(__ushort_as_half(bits));
}

__device__ __forceinline__ u16 u16_at(const u8* p) {  // p is 2-byte aligned
    return *reinterpret_cast<const u16*>(p);
}

__device__ __forceinline__ u32 u32_at(const u8* p) {  // p is 4-byte aligned
    return *reinterpret_cast<const u32*>(p);
}

// Integer -> float without the quarter-rate I2F: byte i of w placed under the exponent of 2^23 gives 2^23 + byte.
__device__ __forceinline__ float byte_plus_2p23(u32 w, int i) {
    return __int_as_float(__byte_perm(w, 0x4B000000u, 0x7440 + i));
}

// Byte i of w as a float (exact), likewise without I2F.
__device__ __forceinline__ float byte_float(u32 w, int i) {
    return byte_plus_2p23(w, i) - 8388608.0f;
}

// Unsigned bytes of (w0, w1) dotted with 8 activations, each byte minus `bias` (exact: small integers).
__device__ __forceinline__ float bytes_dot(u32 w0, u32 w1, float bias, float4 a, float4 b) {
    const float k = 8388608.0f + bias;
    return (byte_plus_2p23(w0, 0) - k) * a.x + (byte_plus_2p23(w0, 1) - k) * a.y +
           (byte_plus_2p23(w0, 2) - k) * a.z + (byte_plus_2p23(w0, 3) - k) * a.w +
           (byte_plus_2p23(w1, 0) - k) * b.x + (byte_plus_2p23(w1, 1) - k) * b.y +
           (byte_plus_2p23(w1, 2) - k) * b.z + (byte_plus_2p23(w1, 3) - k) * b.w;
}

__device__ __forceinline__ float dot8(const float* v, float4 a, float4 b) {
    return v[0] * a.x + v[1] * a.y + v[2] * a.z + v[3] * a.w + v[4] * b.x + v[5] * b.y + v[6] * b.z + v[7] * b.w;
}

// dot(b, part, a, b, xsum): the 8 elements of `part` dotted with activations (a, b), whose sum is xsum when
// XSUM (formats with a min term). Formats without their own use their decode.
template <class Q>
__device__ __forceinline__ float dot_by_decode(const u8* blk, int part, float4 a, float4 b) {
    float v[8];
    Q::decode(blk, part, v);
    return dot8(v, a, b);
}

#define DOT_BY_DECODE(Q)                                                                                  \
    static constexpr bool XSUM = false;                                                                  \
    static __device__ __forceinline__ float dot(const u8* blk, int part, float4 a, float4 b, float) {    \
        return dot_by_decode<Q>(blk, part, a, b);                                                          \
    }

struct F32 {
    static constexpr int QK = 8, BYTES = 32, CHUNK = 32;
    static __device__ __forceinline__ void decode(const u8* b, int, float* v) {
        const float4* p = reinterpret_cast<const float4*>(b);
        float4 a = p[0], c = p[1];
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = c.x; v[5] = c.y; v[6] = c.z; v[7] = c.w;
    }
    DOT_BY_DECODE(F32)
};

struct F16 {
    static constexpr int QK = 8, BYTES = 16, CHUNK = 64;
    static __device__ __forceinline__ void decode(const u8* b, int, float* v) {
        uint4 q = *reinterpret_cast<const uint4*>(b);
        u32 w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            v[2 * i] = __half2float(__ushort_as_half((u16)(w[i] & 0xFFFF)));
            v[2 * i + 1] = __half2float(__ushort_as_half((u16)(w[i] >> 16)));
        }
    }
    DOT_BY_DECODE(F16)
};

struct BF16 {
    static constexpr int QK = 8, BYTES = 16, CHUNK = 64;
    static __device__ __forceinline__ void decode(const u8* b, int, float* v) {
        uint4 q = *reinterpret_cast<const uint4*>(b);
        u32 w[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (int i = 0; i < 4; i++) {
            v[2 * i] = __uint_as_float(w[i] << 16);
            v[2 * i + 1] = __uint_as_float(w[i] & 0xFFFF0000u);
        }
    }
    DOT_BY_DECODE(BF16)
};

// d (f16), 32 int8 codes.
struct Q8_0 {
    static constexpr int QK = 32, BYTES = 34, CHUNK = 16;
    static __device__ __forceinline__ void decode(const u8* b, int part, float* v) {
        float d = half_at(b);
        const u8* q = b + 2 + 8 * part;
        u32 w[2] = {((u32)u16_at(q) | ((u32)u16_at(q + 2) << 16)) ^ 0x80808080u,  // int8 + 128
                    ((u32)u16_at(q + 4) | ((u32)u16_at(q + 6) << 16)) ^ 0x80808080u};
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = (byte_float(w[i / 4], i % 4) - 128.0f) * d;
    }
    static constexpr bool XSUM = false;
    static __device__ __forceinline__ float dot(const u8* b, int part, float4 xa, float4 xb, float) {
        const u8* q = b + 2 + 8 * part;
        u32 w0 = ((u32)u16_at(q) | ((u32)u16_at(q + 2) << 16)) ^ 0x80808080u;  // int8 + 128
        u32 w1 = ((u32)u16_at(q + 4) | ((u32)u16_at(q + 6) << 16)) ^ 0x80808080u;
        return half_at(b) * bytes_dot(w0, w1, 128.0f, xa, xb);
    }
};

// d (f16), 16 bytes: element i < 16 is the low nibble of byte i, element 16 + i its high nibble; minus 8.
struct Q4_0 {
    static constexpr int QK = 32, BYTES = 18, CHUNK = 64;
    static __device__ __forceinline__ void decode(const u8* b, int part, float* v) {
        float d = half_at(b);
        const u8* q = b + 2 + 8 * (part & 1);
        int shift = 4 * (part >> 1);
        u32 w[2] = {(((u32)u16_at(q) | ((u32)u16_at(q + 2) << 16)) >> shift) & 0x0F0F0F0Fu,
                    (((u32)u16_at(q + 4) | ((u32)u16_at(q + 6) << 16)) >> shift) & 0x0F0F0F0Fu};
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = (byte_float(w[i / 4], i % 4) - 8.0f) * d;
    }
    static constexpr bool XSUM = false;
    static __device__ __forceinline__ float dot(const u8* b, int part, float4 xa, float4 xb, float) {
        const u8* q = b + 2 + 8 * (part & 1);
        int shift = 4 * (part >> 1);
        u32 w0 = (((u32)u16_at(q) | ((u32)u16_at(q + 2) << 16)) >> shift) & 0x0F0F0F0Fu;
        u32 w1 = (((u32)u16_at(q + 4) | ((u32)u16_at(q + 6) << 16)) >> shift) & 0x0F0F0F0Fu;
        return half_at(b) * bytes_dot(w0, w1, 8.0f, xa, xb);
    }
};

// d, dmin (f16), 12 bytes of 6-bit scales/mins, 128 bytes of nibbles: elements 64g .. 64g+31 are the low
// nibbles of bytes 32g .. 32g+31 (sub-block 2g), elements 64g+32 .. 64g+63 their high nibbles (sub-block 2g+1).
struct Q4_K {
    static constexpr int QK = 256, BYTES = 144, CHUNK = 4;
    static __device__ __forceinline__ void scale_min(const u8* p, int s, int& sc, int& m) {
        if (s < 4) {
            sc = p[s] & 63;
            m = p[s + 4] & 63;
        } else {
            sc = (p[s + 4] & 0xF) | ((p[s - 4] >> 6) << 4);
            m = (p[s + 4] >> 4) | ((p[s] >> 6) << 4);
        }
    }
    static __device__ __forceinline__ void decode(const u8* b, int part, float* v) {
        int s = part >> 2, g = s >> 1, shift = 4 * (s & 1);
        int sc, m;
        scale_min(b + 4, s, sc, m);
        float a = half_at(b) * (float)sc, o = half_at(b + 2) * (float)m;
        uint2 q = *reinterpret_cast<const uint2*>(b + 16 + 32 * g + 8 * (part & 3));
        u32 w[2] = {(q.x >> shift) & 0x0F0F0F0Fu, (q.y >> shift) & 0x0F0F0F0Fu};
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = a * byte_float(w[i / 4], i % 4) - o;
    }
    static constexpr bool XSUM = true;
    static __device__ __forceinline__ float dot(const u8* b, int part, float4 xa, float4 xb, float xsum) {
        int s = part >> 2, g = s >> 1, shift = 4 * (s & 1);
        int sc, m;
        scale_min(b + 4, s, sc, m);
        uint2 q = *reinterpret_cast<const uint2*>(b + 16 + 32 * g + 8 * (part & 3));
        float dot = bytes_dot((q.x >> shift) & 0x0F0F0F0Fu, (q.y >> shift) & 0x0F0F0F0Fu, 0.0f, xa, xb);
        return half_at(b) * (float)sc * dot - half_at(b + 2) * (float)m * xsum;
    }
};

// 128 bytes low nibbles, 64 bytes high bit pairs, 16 int8 scales, d (f16): element e = 128h + 32q + l takes
// the nibble (q >> 1) of ql[64h + 32(q & 1) + l] and bits 2q of qh[32h + l]; its scale is e / 16.
struct Q6_K {
    static constexpr int QK = 256, BYTES = 210, CHUNK = 4;
    static __device__ __forceinline__ void decode(const u8* b, int part, float* v) {
        int e0 = 8 * part, h = e0 / 128, q = (e0 % 128) / 32, l0 = e0 % 32;
        float a = half_at(b + 208) * (float)(signed char)b[192 + part / 2];
        const u8* ql = b + 64 * h + 32 * (q & 1) + l0;
        const u8* qh = b + 128 + 32 * h + l0;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            int low = (ql[i] >> (4 * (q >> 1))) & 0xF;
            int high = (qh[i] >> (2 * q)) & 3;
            v[i] = a * (float)((low | (high << 4)) - 32);
        }
    }
    DOT_BY_DECODE(Q6_K)
};

// 16 scale bytes (low nibble scale, high nibble min), 64 bytes of 2-bit codes, d, dmin (f16): element
// e = 128h + 32j + l is bits 2j of qs[32h + l]; its scale byte is e / 16.
struct Q2_K {
    static constexpr int QK = 256, BYTES = 84, CHUNK = 4;
    static __device__ __forceinline__ void decode(const u8* b, int part, float* v) {
        int e0 = 8 * part, h = e0 / 128, j = (e0 % 128) / 32, l0 = e0 % 32;
        u8 packed = b[part / 2];
        float a = half_at(b + 80) * (float)(packed & 0xF), o = half_at(b + 82) * (float)(packed >> 4);
        u32 w[2] = {(u32_at(b + 16 + 32 * h + l0) >> (2 * j)) & 0x03030303u,
                    (u32_at(b + 20 + 32 * h + l0) >> (2 * j)) & 0x03030303u};
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = a * byte_float(w[i / 4], i % 4) - o;
    }
    static constexpr bool XSUM = true;
    static __device__ __forceinline__ float dot(const u8* b, int part, float4 xa, float4 xb, float xsum) {
        int e0 = 8 * part, h = e0 / 128, j = (e0 % 128) / 32, l0 = e0 % 32;
        u8 packed = b[part / 2];
        u32 w0 = (u32_at(b + 16 + 32 * h + l0) >> (2 * j)) & 0x03030303u;
        u32 w1 = (u32_at(b + 20 + 32 * h + l0) >> (2 * j)) & 0x03030303u;
        return half_at(b + 80) * (float)(packed & 0xF) * bytes_dot(w0, w1, 0.0f, xa, xb) -
               half_at(b + 82) * (float)(packed >> 4) * xsum;
    }
};

// d (f16), then 8 groups of 8 bytes: 4 grid indices and a u32 holding four 7-bit sign indices and a
// 4-bit scale. Part = 4 * group + k is the 8 elements of grid index k; the eighth sign bit makes the minus
// count even. The four parts of a group share its header (Head), which a one-token dot reads once per group.
struct IQ2_XXS {
    static constexpr int QK = 256, BYTES = 66, CHUNK = 4, GROUP = 4;
    struct Head {
        float scale;
        u32 grid, aux;  // the four grid indices; the sign indices and scale
    };
    static __device__ __forceinline__ Head head(const u8* b, int g) {
        const u8* p = b + 2 + 8 * g;
        const u32 aux = (u32)u16_at(p + 4) | ((u32)u16_at(p + 6) << 16);
        return {half_at(b) * ((float)(aux >> 28) + 0.5f) * 0.25f, (u32)u16_at(p) | ((u32)u16_at(p + 2) << 16), aux};
    }
    static __device__ __forceinline__ u32 signs(const Head& h, int k) {
        const u32 s = (h.aux >> (7 * k)) & 127;
        return s | ((__popc(s) & 1) << 7);
    }
    static __device__ __forceinline__ uint2 magnitudes(const Head& h, int k) {
        return *reinterpret_cast<const uint2*>(iq2xxs_grid + 8 * ((h.grid >> (8 * k)) & 255));
    }
    static __device__ __forceinline__ void decode(const u8* b, int part, float* v) {
        const Head h = head(b, part / 4);
        const u32 sg = signs(h, part % 4);
        const uint2 mags = magnitudes(h, part % 4);
#pragma unroll
        for (int i = 0; i < 8; i++) {
            float value = h.scale * byte_float(i < 4 ? mags.x : mags.y, i % 4);
            v[i] = (sg >> i) & 1 ? -value : value;
        }
    }
    static constexpr bool XSUM = false;
    // Signs flip the activations (sign bit xor), magnitudes go through byte_plus_2p23.
    static __device__ __forceinline__ float dot_part(const Head& h, int k, float4 xa, float4 xb) {
        const u32 sg = signs(h, k);
        const uint2 mags = magnitudes(h, k);
        float x[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            float xi = __int_as_float(__float_as_int(x[i]) ^ ((sg << (31 - i)) & 0x80000000u));
            s += (byte_plus_2p23(i < 4 ? mags.x : mags.y, i % 4) - 8388608.0f) * xi;
        }
        return h.scale * s;
    }
    static __device__ __forceinline__ float dot(const u8* b, int part, float4 xa, float4 xb, float) {
        return dot_part(head(b, part / 4), part % 4, xa, xb);
    }
};

// E2M1 code -> value: magnitudes 0, 1, 2, 3, 4, 6, 8, 12 (computed, so no indexed local table), bit 3 the sign.
__device__ __forceinline__ float e2m1(u32 n) {
    int m = n & 7;
    float mag = m < 4 ? (float)m : (float)((4 + 2 * (m & 1)) << ((m >> 1) - 2));
    return n & 8 ? -mag : mag;
}

// E8M0 scale byte, 16 bytes of E2M1 codes (low nibbles: elements 0-15, high nibbles: 16-31).
struct MXFP4 {
    static constexpr int QK = 32, BYTES = 17, CHUNK = 32;
    static __device__ __forceinline__ void decode(const u8* b, int part, float* v) {
        float scale = ldexpf(1.0f, (int)b[0] - 128);
        int shift = 4 * (part >> 1);
        const u8* q = b + 1 + 8 * (part & 1);
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = e2m1((q[i] >> shift) & 0xF) * scale;
    }
    DOT_BY_DECODE(MXFP4)
};

// Parts that share a header in a format with Q::GROUP (read once per group by a one-token dot), else 1.
template <class Q, class = void>
struct Group {
    static constexpr int N = 1;
};
template <class Q>
struct Group<Q, decltype(void(Q::GROUP))> {
    static constexpr int N = Q::GROUP;
};

// Row r of a matrix whose rows may lie in several buffers of equal row width (projections of one input, read in one
// launch): segs null, w's row r; else segs holds nsegs pairs (first row, base address), by first row.
__device__ __forceinline__ const u8* row_at(const u8* w, const long long* __restrict__ segs, int nsegs, int r,
                                            long long row_bytes) {
    if (!segs) return w + (long long)r * row_bytes;
    int i = 0;
    while (i + 1 < nsegs && r >= segs[2 * (i + 1)]) ++i;
    return reinterpret_cast<const u8*>(segs[2 * i + 1]) + (long long)(r - (int)segs[2 * i]) * row_bytes;
}

__device__ __forceinline__ float warp_sum(float s) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    return s;
}

// Weights are streamed once: 16-byte loads that skip L1, so the activations stay cached there.
__device__ __forceinline__ uint4 load_stream(const u8* p) {
    return __ldcs(reinterpret_cast<const uint4*>(p));
}

#define MAX_TOKENS 8

// One warp's dot products of R weight rows with NT activation vectors, staged through shared memory.
//
// The warp walks its rows' chunks ks, ks + KS, ... (CHUNK blocks of each row). A chunk is fetched with 16-byte
// loads over the aligned span that covers it, spread across all 32 lanes and all R rows (coalesced whatever the
// block size), into registers; while the lanes decode one chunk from shared memory the loads of the next are in
// flight. Rows are any R pointers (rows of one matrix, or gate and up rows of one expert).
template <class Q, int R, int NT>
struct WarpDot {
    static constexpr int SEGS = Q::CHUNK * Q::BYTES / 16 + 2;  // 16-byte slots per row: chunk + alignment slack
    static constexpr int SLOTS = R * SEGS;
    static constexpr int LOADS = (SLOTS + 31) / 32;  // 16-byte loads per lane per chunk
    static constexpr int PARTS = Q::QK / 8;

    // acc[j][t] += row_j . x_t, x_t = x + t * x_stride (t < ntok <= NT). stage: this warp's SLOTS slots.
    static __device__ __forceinline__ void run(const u8* const (&row)[R], int ncols, const float* __restrict__ x,
                                               long long x_stride, int ntok, int ks, int KS, uint4* stage,
                                               float (&acc)[R][NT]) {
        int lane = threadIdx.x & 31;
        int nblocks = ncols / Q::QK;
        int nchunks = (nblocks + Q::CHUNK - 1) / Q::CHUNK;
        uint4 buf[LOADS];
        if (ks < nchunks) fetch(row, ks, nblocks, lane, buf);
        grid_wait();  // the first weights are in flight (pdl.cuh); x is the previous kernel's output
        for (int c = ks; c < nchunks; c += KS) {
            __syncwarp();
#pragma unroll
            for (int i = 0; i < LOADS; i++) {
                int slot = lane + 32 * i;
                if (slot < SLOTS) stage[slot] = buf[i];
            }
            __syncwarp();
            if (c + KS < nchunks) fetch(row, c + KS, nblocks, lane, buf);
            int b0 = c * Q::CHUNK;
            int nb = min(Q::CHUNK, nblocks - b0);
            int skew[R];
#pragma unroll
            for (int j = 0; j < R; j++) skew[j] = (int)(reinterpret_cast<u64>(row[j] + (long long)b0 * Q::BYTES) & 15);
            const u8* base = reinterpret_cast<const u8*>(stage);
            if constexpr (NT == 1 && Group<Q>::N > 1) {  // a lane takes a group: its header is read once
                constexpr int G = Group<Q>::N, GROUPS = PARTS / G;
                for (int u = lane; u < nb * GROUPS; u += 32) {
                    typename Q::Head head[R];
#pragma unroll
                    for (int j = 0; j < R; j++)
                        head[j] = Q::head(base + j * SEGS * 16 + skew[j] + (u / GROUPS) * Q::BYTES, u % GROUPS);
                    const float4* xv = reinterpret_cast<const float4*>(x + (long long)b0 * Q::QK + 8 * G * u);
#pragma unroll
                    for (int k = 0; k < G; k++) {
                        const float4 xa = xv[2 * k], xb = xv[2 * k + 1];
#pragma unroll
                        for (int j = 0; j < R; j++) acc[j][0] += Q::dot_part(head[j], k, xa, xb);
                    }
                }
                continue;
            }
            for (int u = lane; u < nb * PARTS; u += 32) {
                int blk = u / PARTS, part = u % PARTS;
                const float* xu = x + (long long)b0 * Q::QK + 8 * u;
                if constexpr (NT == 1) {
                    const float4* xv = reinterpret_cast<const float4*>(xu);
                    float4 xa = xv[0], xb = xv[1];
                    float xs = Q::XSUM ? xa.x + xa.y + xa.z + xa.w + xb.x + xb.y + xb.z + xb.w : 0.f;
#pragma unroll
                    for (int j = 0; j < R; j++)
                        acc[j][0] += Q::dot(base + j * SEGS * 16 + skew[j] + blk * Q::BYTES, part, xa, xb, xs);
                } else {
#pragma unroll
                    for (int j = 0; j < R; j++) {
                        float v[8];
                        Q::decode(base + j * SEGS * 16 + skew[j] + blk * Q::BYTES, part, v);
#pragma unroll
                        for (int t = 0; t < NT; t++) {
                            if (t < ntok) {
                                const float4* xv = reinterpret_cast<const float4*>(xu + t * x_stride);
                                acc[j][t] += dot8(v, xv[0], xv[1]);
                            }
                        }
                    }
                }
            }
        }
    }

    static __device__ __forceinline__ void fetch(const u8* const (&row)[R], int c, int nblocks, int lane,
                                                 uint4 (&buf)[LOADS]) {
        int b0 = c * Q::CHUNK;
        int len = min(Q::CHUNK, nblocks - b0) * Q::BYTES;
        const u8* start[R];
        int count[R];
#pragma unroll
        for (int j = 0; j < R; j++) {
            const u8* s = row[j] + (long long)b0 * Q::BYTES;
            start[j] = reinterpret_cast<const u8*>(reinterpret_cast<u64>(s) & ~(u64)15);
            count[j] = (int)((reinterpret_cast<u64>(s) + len + 15) / 16 - reinterpret_cast<u64>(start[j]) / 16);
        }
#pragma unroll
        for (int i = 0; i < LOADS; i++) {
            int slot = lane + 32 * i, j = slot / SEGS, k = slot - j * SEGS;
            const u8* p = nullptr;
            int n = 0;
#pragma unroll
            for (int jj = 0; jj < R; jj++) {
                if (jj == j) {
                    p = start[jj];
                    n = count[jj];
                }
            }
            if (slot < SLOTS && k < n) buf[i] = load_stream(p + 16 * k);
        }
    }
};

#define GEMV_WARPS 8
#define GEMV_ROWS 4

// y[t, r] = sum_c W[r, c] x_t[g(r), c] for t < ntok <= NT, where x_t[g] = x + t * x_stride + g * ncols and
// g(r) = r / group_rows (grouped projections; group_rows = nrows otherwise, a multiple of GEMV_ROWS if grouped);
// W's rows as row_at finds them.
// A block is GEMV_WARPS warps: GEMV_WARPS / KS groups of GEMV_ROWS rows, each row group split over KS warps
// by chunks and summed in a fixed order (deterministic).
template <class Q, int NT>
__global__ void __launch_bounds__(32 * GEMV_WARPS) gemv(
        const u8* __restrict__ w, long long row_bytes, int nrows, int ncols, const float* __restrict__ x,
        long long x_stride, int group_rows, int ntok, float* __restrict__ y, int KS,
        const long long* __restrict__ segs, int nsegs) {
    using D = WarpDot<Q, GEMV_ROWS, NT>;
    __shared__ uint4 stage[GEMV_WARPS][D::SLOTS];
    __shared__ float partial[GEMV_WARPS][GEMV_ROWS * NT];
    int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    int groups = GEMV_WARPS / KS, rg = warp / KS, ks = warp % KS;
    int r0 = (blockIdx.x * groups + rg) * GEMV_ROWS;
    const u8* row[GEMV_ROWS];
#pragma unroll
    for (int j = 0; j < GEMV_ROWS; j++) row[j] = row_at(w, segs, nsegs, min(r0 + j, nrows - 1), row_bytes);
    float acc[GEMV_ROWS][NT];
#pragma unroll
    for (int j = 0; j < GEMV_ROWS; j++)
#pragma unroll
        for (int t = 0; t < NT; t++) acc[j][t] = 0.f;
    const float* xg = x + (long long)(min(r0, nrows - 1) / group_rows) * ncols;
    D::run(row, ncols, xg, x_stride, ntok, ks, KS, stage[warp], acc);
#pragma unroll
    for (int j = 0; j < GEMV_ROWS; j++)
#pragma unroll
        for (int t = 0; t < NT; t++) {
            float s = warp_sum(acc[j][t]);
            if (lane == 0) partial[warp][j * NT + t] = s;
        }
    __syncthreads();
    if (ks == 0 && lane < GEMV_ROWS * NT) {
        int j = lane / NT, t = lane % NT;
        float s = 0.f;
        for (int i = 0; i < KS; i++) s += partial[warp + i][lane];
        if (r0 + j < nrows && t < ntok) y[(long long)t * nrows + r0 + j] = s;
    }
}

// Routed-expert GEMV for P (token, slot) pairs: y[p, r] = sum_c W_{idx[p]}[r, c] x[p / x_div, c].
// Expert ids are read on the device; a negative id gives zeros. grid = (row blocks, P), GEMV_WARPS row groups.
template <class Q>
__global__ void __launch_bounds__(32 * GEMV_WARPS) moe_gemv(
        const u8* __restrict__ w, long long expert_bytes, long long row_bytes, int nrows, int ncols,
        const int* __restrict__ idx, const float* __restrict__ x, int x_div, float* __restrict__ y) {
    grid_wait();
    using D = WarpDot<Q, GEMV_ROWS, 1>;
    __shared__ uint4 stage[GEMV_WARPS][D::SLOTS];
    int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    int p = blockIdx.y, e = idx[p];
    int r0 = (blockIdx.x * GEMV_WARPS + warp) * GEMV_ROWS;
    if (r0 >= nrows) return;
    float acc[GEMV_ROWS][1] = {};
    if (e >= 0) {
        const u8* row[GEMV_ROWS];
#pragma unroll
        for (int j = 0; j < GEMV_ROWS; j++)
            row[j] = w + (long long)e * expert_bytes + (long long)min(r0 + j, nrows - 1) * row_bytes;
        D::run(row, ncols, x + (long long)(p / x_div) * ncols, 0, 1, 0, 1, stage[warp], acc);
    }
#pragma unroll
    for (int j = 0; j < GEMV_ROWS; j++) {
        float s = warp_sum(acc[j][0]);
        if (lane == 0 && r0 + j < nrows) y[(long long)p * nrows + r0 + j] = s;
    }
}

// Fused routed-expert gate/up with SwiGLU: h[p, r] = silu(min(g, L)) * clip(u, -L, L) (no clamp when
// limit <= 0), g and u the rows r of W_gate and W_up of expert idx[p] against x[p / x_div]. Each warp reads
// GEMV_ROWS gate rows and the same up rows against one staged activation; a negative id gives zeros, and a null
// idx expert 0 for every pair (a shared expert).
template <class Q>
__global__ void __launch_bounds__(32 * GEMV_WARPS / 2) moe_gate_up(
        const u8* __restrict__ wg, const u8* __restrict__ wu, long long expert_bytes, long long row_bytes,
        int nrows, int ncols, const int* __restrict__ idx, const float* __restrict__ x, int x_div, float limit,
        float* __restrict__ h) {
    grid_wait();
    constexpr int WARPS = GEMV_WARPS / 2;
    using D = WarpDot<Q, 2 * GEMV_ROWS, 1>;
    __shared__ uint4 stage[WARPS][D::SLOTS];
    int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    int p = blockIdx.y, e = idx ? idx[p] : 0;
    int r0 = (blockIdx.x * WARPS + warp) * GEMV_ROWS;
    if (r0 >= nrows) return;
    float acc[2 * GEMV_ROWS][1] = {};
    if (e >= 0) {
        const u8* row[2 * GEMV_ROWS];
#pragma unroll
        for (int j = 0; j < GEMV_ROWS; j++) {
            long long off = (long long)e * expert_bytes + (long long)min(r0 + j, nrows - 1) * row_bytes;
            row[j] = wg + off;
            row[GEMV_ROWS + j] = wu + off;
        }
        D::run(row, ncols, x + (long long)(p / x_div) * ncols, 0, 1, 0, 1, stage[warp], acc);
    }
#pragma unroll
    for (int j = 0; j < GEMV_ROWS; j++) {
        float g = warp_sum(acc[j][0]), u = warp_sum(acc[GEMV_ROWS + j][0]);
        if (limit > 0) {
            g = fminf(g, limit);
            u = fminf(fmaxf(u, -limit), limit);
        }
        if (lane == 0 && r0 + j < nrows) h[(long long)p * nrows + r0 + j] = e >= 0 ? g / (1.0f + expf(-g)) * u : 0.f;
    }
}

// The hyper-connection mix of a few tokens, before its norm: block (s, t) takes the 256 columns from 256 s of token
// t's flattened streams x [T, K] and writes part[t, r, s] = fn[r] . x over them for r < M, and part[t, M, s] = the
// sum of x^2 over them. hc_split sums the slices in order and divides by the RMS of x: with the norm folded into the
// product, the mix is one launch spread over K / 256 blocks instead of a one-block norm and a GEMV of M rows.
// mix_slice is a block's work once each lane holds its 8 columns c .. c + 7 (every warp the same ones) in xa, xb.
template <class Q>
__device__ __forceinline__ void mix_slice(const u8* __restrict__ fn, long long row_bytes, int M, int c, float4 xa,
                                          float4 xb, float* __restrict__ part) {
    constexpr int WARPS = 8, AHEAD = 4;  // rows a warp loads before it sums them
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    float* out = part + (long long)blockIdx.y * (M + 1) * gridDim.x + blockIdx.x;
    for (int r0 = warp; r0 < M; r0 += WARPS * AHEAD) {
        float d[AHEAD];
#pragma unroll
        for (int i = 0; i < AHEAD; i++) {
            const int r = r0 + WARPS * i;
            float v[8];
            if (r < M) Q::decode(fn + r * row_bytes + (long long)(c / Q::QK) * Q::BYTES, (c % Q::QK) / 8, v);
            d[i] = r < M ? dot8(v, xa, xb) : 0.f;
        }
#pragma unroll
        for (int i = 0; i < AHEAD; i++) {
            const float sum = warp_sum(d[i]);
            if (lane == 0 && r0 + WARPS * i < M) out[(long long)(r0 + WARPS * i) * gridDim.x] = sum;
        }
    }
    if (warp == 0) {
        const float ss = warp_sum(xa.x * xa.x + xa.y * xa.y + xa.z * xa.z + xa.w * xa.w + xb.x * xb.x +
                                  xb.y * xb.y + xb.z * xb.z + xb.w * xb.w);
        if (lane == 0) out[(long long)M * gridDim.x] = ss;
    }
}

// The blocks of fn that mix_slice's thread decodes (the first eight warps'), prefetched into L1: constant data, so a
// kernel issues this before grid_wait, and the decode after the wait finds fn on chip instead of waiting on memory a
// second time.
template <class Q>
__device__ __forceinline__ void mix_slice_prefetch(const u8* __restrict__ fn, long long row_bytes, int M) {
    const int c = 256 * blockIdx.x + 8 * (threadIdx.x & 31);
    for (int r = threadIdx.x / 32; r < M && threadIdx.x < 256; r += 8) {
        const u8* b = fn + r * row_bytes + (long long)(c / Q::QK) * Q::BYTES;
        asm volatile("prefetch.global.L1 [%0];" ::"l"(b));
        asm volatile("prefetch.global.L1 [%0];" ::"l"(b + Q::BYTES - 1));
    }
}

template <class Q>
__global__ void __launch_bounds__(256) mix_slices(const u8* __restrict__ fn, long long row_bytes, int M, int K,
                                                  const float* __restrict__ x, float* __restrict__ part) {
    mix_slice_prefetch<Q>(fn, row_bytes, M);
    grid_wait();
    const int c = 256 * blockIdx.x + 8 * (threadIdx.x & 31);
    const float4* xv = reinterpret_cast<const float4*>(x + (long long)blockIdx.y * K + c);
    mix_slice<Q>(fn, row_bytes, M, c, xv[0], xv[1], part);
}

// hc_expand (kernels/hc.cu, same arithmetic) of a slice's columns, then mix_slices of the expanded streams: one
// sub-layer's output spread over the streams and the next sub-layer's mix. out[t, k, d] = post[t, k] · y[t, d] +
// sum_i comb[t, i, k] · S[t, i, d] for n streams of D columns (D a multiple of 256, so a slice lies in one stream),
// where y is y + y2 when y2 is not null (a MoE's two outputs, added as a separate sum would); by the block's first
// eight warps: the first writes the slice to out, all mix it.
template <class Q>
__device__ __forceinline__ void expand_mix_slice(const u8* __restrict__ fn, long long row_bytes, int M,
                                                 const float* __restrict__ S, const float* __restrict__ y,
                                                 const float* __restrict__ y2, const float* __restrict__ post,
                                                 const float* __restrict__ comb, int n, int D, float* __restrict__ out,
                                                 float* __restrict__ part) {
    const int c = 256 * blockIdx.x + 8 * (threadIdx.x & 31), k = c / D, d = c % D;
    const long long t = blockIdx.y;
    const float* ct = comb + t * n * n;
    float v[8] = {};
    for (int i = 0; i < n; ++i) {
        const float ci = ct[i * n + k];
        const float4* si = reinterpret_cast<const float4*>(S + (t * n + i) * D + d);
        const float4 a = si[0], b = si[1];
        const float s8[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
        for (int j = 0; j < 8; ++j) v[j] = fmaf(ci, s8[j], v[j]);
    }
    const float pk = post[t * n + k];
    const float4* yv = reinterpret_cast<const float4*>(y + t * D + d);
    const float4 ya = yv[0], yb = yv[1];
    float y8[8] = {ya.x, ya.y, ya.z, ya.w, yb.x, yb.y, yb.z, yb.w};
    if (y2) {
        const float4* zv = reinterpret_cast<const float4*>(y2 + t * D + d);
        const float4 za = zv[0], zb = zv[1];
        const float z8[8] = {za.x, za.y, za.z, za.w, zb.x, zb.y, zb.z, zb.w};
#pragma unroll
        for (int j = 0; j < 8; ++j) y8[j] = __fadd_rn(y8[j], z8[j]);  // no contraction into the fmaf below
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = fmaf(pk, y8[j], v[j]);
    const float4 xa = make_float4(v[0], v[1], v[2], v[3]), xb = make_float4(v[4], v[5], v[6], v[7]);
    if (threadIdx.x < 32) {
        float4* o = reinterpret_cast<float4*>(out + (t * n + k) * D + d);
        o[0] = xa;
        o[1] = xb;
    }
    mix_slice<Q>(fn, row_bytes, M, c, xa, xb, part);
}

// A sub-layer's end and the next one's input in one launch: expand_mix_slice of slice s = blockIdx.x of token
// t = blockIdx.y (the HC_NORM_STREAMS streams S [T, n, D] and the output y (+ y2) into out, and the new streams'
// mix with fn's M rows into part [T, M + 1, slices]), then, in the last block of token t to finish (count[t] counts
// them, and that block sets it back to 0), hc_split_norm's work on the new streams: the first HC_NORM_THREADS threads
// make the mix row and pre (HcMixSums, then warp 0) while their loads of the streams are in flight, then collapse
// and normalise the streams with weight w into normed [T, D] (and act, not null for one token: its int8
// activation), and the extra warp runs the Sinkhorn meanwhile, into pre2, post2 and comb2. The same bits as
// hc_expand, mix_slices and hc_split_norm one after the other, without their launches' waits. fn has M = (2 + n) · n
// rows; with M = n, the model's end instead: the collapse's weights are hc_head's (the same formula as pre),
// normalised with the output norm w, and no Sinkhorn (pre2, post2, comb2 unused). With mix_row (one token), the
// last block writes the mix row there instead of running the Sinkhorn: a later launch runs it (split_hosting.py).
// HC_NORM_THREADS + 32 threads, grid (n · D / 256, T).
template <class Q>
__global__ void __launch_bounds__(HC_NORM_THREADS + 32) hc_expand_mix_norm(
        const u8* __restrict__ fn, long long row_bytes, int M, const float* __restrict__ S, const float* __restrict__ y,
        const float* __restrict__ y2, const float* __restrict__ post, const float* __restrict__ comb, int D,
        float* __restrict__ out, float* __restrict__ part, int* __restrict__ count, float norm_eps,
        const float* __restrict__ scale, const float* __restrict__ base, int iters, float eps,
        float* __restrict__ pre2, float* __restrict__ post2, float* __restrict__ comb2, const float* __restrict__ w,
        float* __restrict__ normed, u8* __restrict__ act, float* __restrict__ mix_row) {
    constexpr int N = HC_NORM_STREAMS;
    __shared__ float weight[N], row[(2 + N) * N], sums[(2 + N) * N + 1];
    __shared__ int last;
    mix_slice_prefetch<Q>(fn, row_bytes, M);
    grid_wait();
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, slices = gridDim.x;
    const bool head = M == N;
    const size_t t = blockIdx.y;
    if (warp < 8) expand_mix_slice<Q>(fn, row_bytes, M, S, y, y2, post, comb, N, D, out, part);
    __threadfence();  // this block's slice of out and part, visible to the block that counts last
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(count + t, 1) == slices - 1;
    __syncthreads();
    if (!last) return;
    if (threadIdx.x == 0) count[t] = 0;  // every block has counted: ready for the next launch
    // barrier 0 of all the block's threads, reached from two places: the row and the weights are made
    if (warp < HC_NORM_THREADS / 32) {
        HcMixSums mix;  // every warp's loads first, then the streams' (a warp's own were behind the others' streams)
        mix.load(part + t * (M + 1) * slices, M, slices, warp);
        asm volatile("bar.sync 2, %0;" ::"n"(HC_NORM_THREADS) : "memory");
        hc_norm_token(out + t * N * D, D, w, norm_eps, normed + t * D, act, weight, [&] {
            mix.store(M, slices, warp, sums);
            asm volatile("bar.sync 2, %0;" ::"n"(HC_NORM_THREADS) : "memory");
            if (warp == 0) {
                hc_mix_divide(row, sums, M, N * D, norm_eps);
                if (lane < N) weight[lane] = hc_sigmoid(row[lane] * scale[0] + base[lane]) + eps;
                if (mix_row)
                    for (int r = lane; r < M; r += 32) mix_row[t * M + r] = row[r];
            }
            asm volatile("bar.sync 0;" ::: "memory");
        });
    } else {
        asm volatile("bar.sync 0;" ::: "memory");
        if (!head && !mix_row)
            hc_split4_lane(row, scale, base, iters, eps, pre2 + t * N, post2 + t * N, comb2 + t * N * N);
    }
}

// out[i, :] = row rows[i] of W as float32 (rows == nullptr: row i). One thread per 8 elements.
template <class Q>
__global__ void dequant_rows(const u8* __restrict__ w, long long row_bytes, int ncols, const int* __restrict__ rows,
                             int nrows, float* __restrict__ out) {
    grid_wait();
    long long units = ncols / 8;
    long long id = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (id >= units * nrows) return;
    long long i = id / units;
    int u = (int)(id % units);
    long long src = rows ? (long long)rows[i] : i;
    constexpr int PARTS = Q::QK / 8;
    const u8* blk = w + src * row_bytes + (long long)(u / PARTS) * Q::BYTES;
    float v[8];
    Q::decode(blk, u % PARTS, v);
    float4* o = reinterpret_cast<float4*>(out + i * ncols + 8LL * u);
    o[0] = make_float4(v[0], v[1], v[2], v[3]);
    o[1] = make_float4(v[4], v[5], v[6], v[7]);
}
