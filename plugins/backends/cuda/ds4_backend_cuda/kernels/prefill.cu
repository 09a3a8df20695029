// Prefill kernels around cuBLAS tensor-core GEMMs. Compiled appended to quant.cu, whose format structs
// (Q::decode, QK, BYTES) decode the blocks: weights become 16-bit tiles (fp16 or bf16, chosen per format by
// prefill.py), activations 16-bit with one power-of-two scale, and the routed experts' glue runs on the device
// (gather by expert, SwiGLU, weighted scatter). 16-bit values travel as raw u16 bits.

struct Half {  // IEEE fp16, round to nearest even
    static __device__ __forceinline__ u32 from(float v) { return __half_as_ushort(__float2half_rn(v)); }
    static __device__ __forceinline__ u32 from2(float lo, float hi) {  // one conversion for both
        __half2 h = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<u32*>(&h);
    }
};

struct BHalf {  // bfloat16, round to nearest even; a NaN stays a (quiet) NaN
    static __device__ __forceinline__ u32 from(float v) {
        u32 b = __float_as_uint(v);
        if ((b & 0x7FFFFFFFu) > 0x7F800000u) return (b >> 16) | 0x40u;
        return (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
    }
    static __device__ __forceinline__ u32 from2(float lo, float hi) { return from(lo) | (from(hi) << 16); }
};

template <class O>
__device__ __forceinline__ uint4 pack8(const float* v) {
    return make_uint4(O::from2(v[0], v[1]), O::from2(v[2], v[3]), O::from2(v[4], v[5]), O::from2(v[6], v[7]));
}

// Elements 8 * part .. + 7 of block b as O bits: Q::decode, then pack8.
template <class Q, class O>
__device__ __forceinline__ uint4 decode16(const u8* b, int part) {
    float v[8];
    Q::decode(b, part, v);
    return pack8<O>(v);
}

// Columns c .. c + 31 (c a multiple of 32) of the row whose blocks start at base, as O bits: columns c + 8j .. + 7
// at out[j ^ swz] (swz < 4: a swizzled tile's order of 16-byte chunks). Four decode16s; for IQ2_XXS to fp16, whose
// 32 columns are one group, the group's head is read once.
template <class Q, class O>
struct Decode32 {
    static __device__ __forceinline__ void run(const u8* base, int c, uint4* out, int swz) {
#pragma unroll 1
        for (int j = 0; j < 4; j++)
            out[j ^ swz] = decode16<Q, O>(base + (c + 8 * j) / Q::QK * Q::BYTES, (c + 8 * j) % Q::QK / 8);
    }
};

// IQ2_XXS's grid rows as the four prmt selectors of IQ2Half::part (16 bits each, pair q at bits 16q), filled from the
// host: the selector of a pair of codes a, b (0, 1, 2 for 8, 25, 43) picks fp16 bytes from (lo, hi) = (8s | 25s, 43s).
// One 8-byte lookup a row; computing each selector from 2-bit codes took four instructions a pair.
__device__ uint2 iq2xxs_selectors[256];

// IQ2_XXS to fp16 (the routed experts' prefill is bound by this decode): the group's three magnitudes times its scale
// are rounded once, and each pair of weights is picked from them by one prmt whose selector the pair's two codes make
// (as Q2_K's decode); signs flip the fp16 sign bits after rounding, which commutes with negation. The bits of decode +
// pack8<Half>. IQ2Half holds a group's magnitudes; part k gives its elements 8k .. 8k + 7.
struct IQ2Half {
    IQ2_XXS::Head h;
    u32 lo, hi;  // fp16 of 8, 25 (lo) and 43 (hi) times the scale

    __device__ __forceinline__ explicit IQ2Half(const IQ2_XXS::Head& head)
        : h(head), lo(Half::from2(8.f * head.scale, 25.f * head.scale)), hi(Half::from(43.f * head.scale)) {}

    __device__ __forceinline__ uint4 part(int k) const {
        const u32 sg = IQ2_XXS::signs(h, k);
        const u32 spread[2] = {(sg & 0xFu) * 0x10204080u, (sg >> 4) * 0x10204080u};  // bit 8i + 7: element i's sign
        const uint2 sel = iq2xxs_selectors[(h.grid >> (8 * k)) & 255];
        u32 o[4];
#pragma unroll
        for (int q = 0; q < 4; q++) {
            u32 mask;  // prmt's sign mode: byte 1 (3) all ones when element 2q (2q + 1) is negative
            asm("prmt.b32 %0, %1, 0, %2;" : "=r"(mask) : "r"(spread[q / 2]), "r"(q % 2 ? 0xB4A4u : 0x9484u));
            const u32 s = q < 2 ? sel.x : sel.y;  // prmt reads a selector's low 16 bits
            o[q] = __byte_perm(lo, hi, q % 2 ? s >> 16 : s) ^ (mask & 0x80008000u);
        }
        return make_uint4(o[0], o[1], o[2], o[3]);
    }
};

template <>
__device__ __forceinline__ uint4 decode16<IQ2_XXS, Half>(const u8* b, int part) {
    return IQ2Half(IQ2_XXS::head(b, part / 4)).part(part % 4);
}

// For 32 columns, one group: its head and magnitudes are read once.
template <>
struct Decode32<IQ2_XXS, Half> {
    static __device__ __forceinline__ void run(const u8* base, int c, uint4* out, int swz) {
        const IQ2Half g(IQ2_XXS::head(base + c / IQ2_XXS::QK * IQ2_XXS::BYTES, c % IQ2_XXS::QK / 32));
#pragma unroll
        for (int k = 0; k < 4; k++) out[k ^ swz] = g.part(k);
    }
};

// Columns c .. c + 15 (c a multiple of 16) of the row whose blocks start at base, as O bits: columns c + 8j .. + 7 at
// out[j] (moe_wgmma16's A fragments).
template <class Q, class O>
struct Decode16 {
    static __device__ __forceinline__ void run(const u8* base, int c, uint4 (&out)[2]) {
#pragma unroll
        for (int j = 0; j < 2; j++)
            out[j] = decode16<Q, O>(base + (c + 8 * j) / Q::QK * Q::BYTES, (c + 8 * j) % Q::QK / 8);
    }
};

// Half of an IQ2_XXS group: its head is read once.
template <>
struct Decode16<IQ2_XXS, Half> {
    static __device__ __forceinline__ void run(const u8* base, int c, uint4 (&out)[2]) {
        const IQ2Half g(IQ2_XXS::head(base + c / IQ2_XXS::QK * IQ2_XXS::BYTES, c % IQ2_XXS::QK / 32));
        const int k = c % 32 / 8;
        out[0] = g.part(k);
        out[1] = g.part(k + 1);
    }
};

// Q2_K's columns e0 .. e0 + 15 of block b (e0 % 16 == 0), one scale group: its four values a * q - o (q = 0 .. 3) are
// computed and rounded once, and each pair of weights is picked from them by one prmt whose selector its two codes
// make (nibbles 2q, 2q + 1 of each): about half the instructions of decoding and rounding every weight, the same
// bits. d and dmin: the block's scales.
template <class O>
__device__ __forceinline__ void q2k_group16(const u8* b, int e0, float d, float dmin, uint4 (&out)[2]) {
    const u8* q = b + 16 + 32 * (e0 / 128) + e0 % 32;
    const int shift = 2 * (e0 % 128 / 32);
    const u8 packed = b[e0 / 16];
    const float a = d * (float)(packed & 0xF), o = dmin * (float)(packed >> 4);
    const u32 lo = O::from2(-o, fmaf(a, 1.f, -o)), hi = O::from2(fmaf(a, 2.f, -o), fmaf(a, 3.f, -o));
#pragma unroll
    for (int k = 0; k < 2; k++) {
        u32 pick[4];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            const u32 codes = (u32_at(q + 8 * k + 4 * h) >> shift) & 0x03030303u;  // a code a byte
            pick[2 * h] = __byte_perm(lo, hi, codes * 0x22u + 0x1010u);
            pick[2 * h + 1] = __byte_perm(lo, hi, (codes >> 16) * 0x22u + 0x1010u);
        }
        out[k] = make_uint4(pick[0], pick[1], pick[2], pick[3]);
    }
}

// Q2_K: d and dmin read once for the 32 columns (two 16-value scale groups of one 2-bit plane).
template <class O>
struct Decode32<Q2_K, O> {
    static __device__ __forceinline__ void run(const u8* base, int c, uint4* out, int swz) {
        const u8* b = base + c / Q2_K::QK * Q2_K::BYTES;
        const float d = half_at(b + 80), dmin = half_at(b + 82);
#pragma unroll
        for (int g = 0; g < 2; g++) {
            uint4 v[2];
            q2k_group16<O>(b, c % Q2_K::QK + 16 * g, d, dmin, v);
            out[(2 * g) ^ swz] = v[0];
            out[(2 * g + 1) ^ swz] = v[1];
        }
    }
};

template <class O>
struct Decode16<Q2_K, O> {
    static __device__ __forceinline__ void run(const u8* base, int c, uint4 (&out)[2]) {
        const u8* b = base + c / Q2_K::QK * Q2_K::BYTES;
        q2k_group16<O>(b, c % Q2_K::QK, half_at(b + 80), half_at(b + 82), out);
    }
};

// out[j, r, :] = row r (< nrows) of matrix e = experts[j] (experts null: e = j) of w as O, j = blockIdx.y.
// Matrix e starts at w + e * matrix_bytes, its rows row_bytes apart; ncols % 8 == 0; one thread per 8 values.
template <class Q, class O>
__global__ void dequant16(const u8* __restrict__ w, long long matrix_bytes, long long row_bytes, int nrows, int ncols,
                          const int* __restrict__ experts, long long out_stride, u16* __restrict__ out) {
    int units = ncols / 8;
    long long id = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (id >= (long long)nrows * units) return;
    long long r = id / units;
    int u = (int)(id - r * units);
    long long e = experts ? experts[blockIdx.y] : blockIdx.y;
    constexpr int PARTS = Q::QK / 8;
    const u8* blk = w + e * matrix_bytes + r * row_bytes + (long long)(u / PARTS) * Q::BYTES;
    *reinterpret_cast<uint4*>(out + blockIdx.y * out_stride + r * ncols + 8LL * u) = decode16<Q, O>(blk, u % PARTS);
}

// The power of two that brings amax into [2^13, 2^14): fp16 then holds every value above 2^-27 * amax as a
// normal number and nothing overflows (1 when amax is 0, infinite or NaN).
__device__ __forceinline__ float up_scale(float amax) {
    if (!(amax > 0.f) || amax > 3.4e38f) return 1.f;
    int e;
    frexpf(amax, &e);  // amax = m * 2^e, m in [0.5, 1)
    return ldexpf(1.f, min(14 - e, 126));
}

// The k64 order of moe_wgmma16's operands: column o = 16t + 4q + 2h + e of each 64 (t, q < 4; h, e < 2) sits at
// position 16q + 8h + 2t + e. Its A fragments give the thread t of a quad positions 2t, 2t + 1, 2t + 8, 2t + 9 of
// each 16-wide slice q, so in this order they are the 16 consecutive columns 16t .. 16t + 15, which it decodes
// whole; the activations (to16, store_tile, rows_to16 with k64) are written in the same order, and the products'
// sums run over the same pairs.
__device__ __forceinline__ int k64_position(int o) {
    return ((o >> 2) & 3) * 16 + ((o >> 1) & 1) * 8 + (o >> 4) * 2 + (o & 1);
}

// The index of element i (of rows of a multiple of 64) in the k64 order.
__device__ __forceinline__ long long k64_index(long long i) { return (i & ~63LL) + k64_position((int)(i & 63)); }

// out[i] = x[i] * s as O, s = up_scale(*amax); thread 0 also writes alpha_beta = (1 / s, 0), the GEMM's scalars
// that undo the scale (cuBLAS in device pointer mode). A thread converts 8 values, with 16-byte loads and a 16-byte
// store where x and out allow (one value a thread, 2-byte stores, ran at ~1.3 TB/s); k64: in the k64 order (n a
// multiple of 64), four 4-byte stores of pairs.
template <class O>
__global__ void to16(const float* __restrict__ x, long long n, const float* __restrict__ amax,
                     u16* __restrict__ out, float* __restrict__ alpha_beta, int k64) {
    const float s = up_scale(*amax);
    const long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (i == 0) {
        alpha_beta[0] = 1.f / s;
        alpha_beta[1] = 0.f;
    }
    if (i >= n) return;
    if (i + 8 <= n && !((reinterpret_cast<unsigned long long>(x) | reinterpret_cast<unsigned long long>(out)) & 15)) {
        const float4 a = reinterpret_cast<const float4*>(x + i)[0], b = reinterpret_cast<const float4*>(x + i)[1];
        const float v[8] = {a.x * s, a.y * s, a.z * s, a.w * s, b.x * s, b.y * s, b.z * s, b.w * s};
        const uint4 p = pack8<O>(v);  // the same rounding as O::from, a pair at a time
        if (!k64) {
            *reinterpret_cast<uint4*>(out + i) = p;
            return;
        }
        const u32 pairs[4] = {p.x, p.y, p.z, p.w};
#pragma unroll
        for (int j = 0; j < 4; j++) *reinterpret_cast<u32*>(out + k64_index(i + 2 * j)) = pairs[j];
        return;
    }
    for (long long j = i; j < n && j < i + 8; ++j) out[k64 ? k64_index(j) : j] = (u16)O::from(x[j] * s);
}

// to16 of rows of d values after the inverse RoPE of their trailing 2·half channels (rope_tail's arithmetic; row r
// of token r / rows_per_token), scaled by the power of two that up_scale gives *amax · factor: a bound of max|x|
// known without a pass over x (an attention output's, from its values'). d % 8 == 0, x and out 16-byte aligned;
// eight values a thread, whole pairs.
template <class O>
__global__ void rope_to16(const float* __restrict__ x, long long n, int d, int half, const int* __restrict__ pos,
                          const float* __restrict__ inv_freq, int rows_per_token, const float* __restrict__ amax,
                          float factor, u16* __restrict__ out, float* __restrict__ alpha_beta) {
    const float s = up_scale(*amax * factor);
    const long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * 8;
    if (i == 0) {
        alpha_beta[0] = 1.f / s;
        alpha_beta[1] = 0.f;
    }
    if (i >= n) return;
    const float4 a = reinterpret_cast<const float4*>(x + i)[0], b = reinterpret_cast<const float4*>(x + i)[1];
    float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    const long long row = i / d;
    const int c0 = (int)(i - row * d), first = d - 2 * half;
    if (c0 + 8 > first) {
        const float p = (float)pos[row / rows_per_token];
#pragma unroll
        for (int e = 0; e < 8; e += 2) {
            if (c0 + e < first) continue;
            float sn, co;
            sincosf(p * inv_freq[(c0 + e - first) / 2], &sn, &co);
            sn = -sn;
            const float u = v[e], w = v[e + 1];
            v[e] = u * co - w * sn;
            v[e + 1] = u * sn + w * co;
        }
    }
#pragma unroll
    for (int e = 0; e < 8; e++) v[e] *= s;
    *reinterpret_cast<uint4*>(out + i) = pack8<O>(v);
}

// Expert-major padded activations: row (j, m) = (blockIdx.y, blockIdx.x) of out is row pairs[seg_off[j] + m] / k
// of x16 when m < seg_cnt[j] (pairs: (token, slot) ids sorted by expert), zeros otherwise. ncols % 8 == 0.
extern "C" __global__ void gather16(const u16* __restrict__ x16, int ncols, const int* __restrict__ pairs, int k,
                                    const int* __restrict__ seg_off, const int* __restrict__ seg_cnt, int m_pad,
                                    u16* __restrict__ out) {
    int j = blockIdx.y, m = blockIdx.x;
    uint4* dst = reinterpret_cast<uint4*>(out + ((long long)j * m_pad + m) * ncols);
    bool live = m < seg_cnt[j];
    const uint4* src = live ? reinterpret_cast<const uint4*>(x16 + (long long)(pairs[seg_off[j] + m] / k) * ncols)
                            : nullptr;
    for (int c = threadIdx.x; c < ncols / 8; c += blockDim.x) dst[c] = live ? src[c] : make_uint4(0, 0, 0, 0);
}

__device__ __forceinline__ float block_max(float v, float* shared) {  // blockDim.x a multiple of 32, <= 1024
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    int warp = threadIdx.x / 32;
    if ((threadIdx.x & 31) == 0) shared[warp] = v;
    __syncthreads();
    v = 0.f;
    for (int i = 0; i < (int)blockDim.x / 32; i++) v = fmaxf(v, shared[i]);
    return v;
}

// *amax = max |x[i]| over n floats (*amax zeroed before the launch; NaNs skipped, as fmaxf skips them): a block's
// maximum, then one atomicMax on its bits, which order as the values do for non-negative floats. 16-byte loads where
// x is 16-byte aligned. (CuPy's two-pass reduction read ~1.5 TB/s.)
extern "C" __global__ void amax_abs(const float* __restrict__ x, long long n, float* __restrict__ amax) {
    __shared__ float shared[32];
    const long long stride = (long long)gridDim.x * blockDim.x;
    const long long first = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    const long long n4 = reinterpret_cast<unsigned long long>(x) & 15 ? 0 : n / 4;
    float m = 0.f;
    for (long long i = first; i < n4; i += stride) {
        const float4 v = reinterpret_cast<const float4*>(x)[i];
        m = fmaxf(m, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
    }
    for (long long i = 4 * n4 + first; i < n; i += stride) m = fmaxf(m, fabsf(x[i]));
    m = block_max(m, shared);
    if (threadIdx.x == 0) atomicMax(reinterpret_cast<int*>(amax), __float_as_int(m));
}

__device__ __forceinline__ float swiglu1(float g, float u, float limit) {
    if (limit > 0) {
        g = fminf(g, limit);
        u = fminf(fmaxf(u, -limit), limit);
    }
    return g / (1.0f + expf(-g)) * u;
}

// Row (j, m) of gu holds [gate | up] (2 * R floats): h = swiglu(gate, up) stored as O times the row's power of two
// s, hs = 1 / s (folded into the scatter). Padding rows (m >= seg_cnt[j]) give zeros. One block per row.
template <class O>
__global__ void swiglu16(const float* __restrict__ gu, int R, float limit, const int* __restrict__ seg_cnt, int m_pad,
                         u16* __restrict__ h, float* __restrict__ hs) {
    __shared__ float shared[32];
    long long row = (long long)blockIdx.y * m_pad + blockIdx.x;
    const float* g = gu + row * 2 * R;
    u16* out = h + row * R;
    if ((int)blockIdx.x >= seg_cnt[blockIdx.y]) {
        for (int c = threadIdx.x; c < R; c += blockDim.x) out[c] = 0;
        if (threadIdx.x == 0) hs[row] = 0.f;
        return;
    }
    float amax = 0.f;
    for (int c = threadIdx.x; c < R; c += blockDim.x) amax = fmaxf(amax, fabsf(swiglu1(g[c], g[R + c], limit)));
    float s = up_scale(block_max(amax, shared));
    for (int c = threadIdx.x; c < R; c += blockDim.x) out[c] = (u16)O::from(swiglu1(g[c], g[R + c], limit) * s);
    if (threadIdx.x == 0) hs[row] = 1.f / s;
}

// ypairs[p, :] = y[row, :] * hs[row] * weights[p] for row (j, m) = (blockIdx.y, blockIdx.x), m < seg_cnt[j],
// p = pairs[seg_off[j] + m]. Each pair is written once, so the final sum over a token's k slots is deterministic.
extern "C" __global__ void scatter_pairs(const float* __restrict__ y, int D, const float* __restrict__ hs,
                                         const int* __restrict__ pairs, const float* __restrict__ weights,
                                         const int* __restrict__ seg_off, const int* __restrict__ seg_cnt, int m_pad,
                                         float* __restrict__ ypairs) {
    int j = blockIdx.y, m = blockIdx.x;
    if (m >= seg_cnt[j]) return;
    long long row = (long long)j * m_pad + m;
    int p = pairs[seg_off[j] + m];
    float scale = hs[row] * weights[p];
    const float4* src = reinterpret_cast<const float4*>(y + row * D);
    float4* dst = reinterpret_cast<float4*>(ypairs + (long long)p * D);
    for (int c = threadIdx.x; c < D / 4; c += blockDim.x) {
        float4 v = src[c];
        dst[c] = make_float4(v.x * scale, v.y * scale, v.z * scale, v.w * scale);
    }
}

// out[t, :] = the sum over slots j (in order) of ypairs[t * k + j, :], the rows of the slots with an expert
// (0 <= idx[t * k + j] < E; no kernel writes the others). D % 4 == 0; one float4 a thread, grid (., T). The loads of
// SUM_SLOTS slots are issued together (one after another, each waited on, they ran at half the copy rate).
#define SUM_SLOTS 8
extern "C" __global__ void sum_pairs(const float* __restrict__ ypairs, const int* __restrict__ idx, int k, int E, int D,
                                     float* __restrict__ out) {
    const long long t = blockIdx.y;
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (4 * c >= D) return;
    float4 s = make_float4(0.f, 0.f, 0.f, 0.f);
    for (int j0 = 0; j0 < k; j0 += SUM_SLOTS) {
        float4 v[SUM_SLOTS];
#pragma unroll
        for (int i = 0; i < SUM_SLOTS; i++) {
            const int j = j0 + i, e = j < k ? idx[t * k + j] : -1;
            v[i] = e >= 0 && e < E ? reinterpret_cast<const float4*>(ypairs + (t * k + j) * D)[c]
                                   : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int i = 0; i < SUM_SLOTS; i++) s = make_float4(s.x + v[i].x, s.y + v[i].y, s.z + v[i].z, s.w + v[i].w);
    }
    reinterpret_cast<float4*>(out + t * D)[c] = s;
}

// Routed experts without 16-bit weight copies: each block dequantizes MMA_BM rows of one expert's matrix into
// shared memory, MMA_BK columns at a time, and multiplies them on tensor cores with up to MMA_BN tokens of that
// expert (mma.sync m16n8k16, fp32 accumulation; inline PTX, so no header beyond NVRTC's own), so quantized weights
// are read once per token tile and never written back.
//
// The column loop is software-pipelined with cp.async (sm_80+), which copies global memory into shared memory
// without holding registers: while the warps multiply step s, the activation tile of step s + 1 (into the other of
// two B tiles) and, when step s + 1 opens a new span of blocks, the raw weight blocks of that span (a shared
// staging area) are already on their way, so the decode of step s + 1 reads shared memory rather than waiting on
// L2 or DRAM. A format whose staging area would push the block past 48 KB of static shared memory (Q4_K, Q6_K,
// F16, BF16 and F32 with two matrices) decodes straight from global memory as before; its activations are still
// prefetched. Only the time of the loads changes: the same bytes reach Q::decode and the MMAs run in the same order.

#define MMA_BM 64
#define MMA_BN 64
#define MMA_BK 64
#define MMA_LD (MMA_BK + 8)   // shared row stride in 16-bit values: 144 bytes keeps ldmatrix conflict-free
#define MMA_CLD (MMA_BM + 4)  // accumulator tile row stride in floats (token-major)

// Copy N (4, 8 or 16) bytes global -> shared asynchronously; 16-byte copies skip L1 (the weights stream).
template <int N>
__device__ __forceinline__ void cp_async(void* dst, const void* src) {
    u32 addr = (u32)__cvta_generic_to_shared(dst);
    if constexpr (N == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(addr), "l"(src) : "memory");
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(addr), "l"(src), "n"(N) : "memory");
}

// Wait for this thread's cp.async copies (a __syncthreads after it makes every thread's copies visible).
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }

// The staging of raw weight blocks in the routed experts' tile kernels (moe_mma16, moe_wgmma16) for NW matrices of
// format Q: a span is the columns whose blocks are copied at once (one MMA_BK step, or a whole block when QK > MMA_BK:
// the next copy then comes QK / MMA_BK steps later), WIN the bytes of a row's blocks in a span. Copies of CH bytes
// keep each byte's address modulo CH, at least the alignment a block of BYTES bytes can rely on (blocks lie back to
// back), so Q::decode's wide loads stay aligned in shared memory; a row's window starts up to CH - 1 bytes after a CH
// boundary, hence LD. Whole CH-byte chunks never pass the end of a buffer whose end is CH-aligned (device allocations
// are).
template <class Q, int NW, int CH_>
struct StagePlan {
    static constexpr int SPAN = Q::QK > MMA_BK ? Q::QK : MMA_BK;
    static constexpr int WIN = SPAN / Q::QK * Q::BYTES;
    static constexpr int CH = CH_;
    static constexpr int LD = (WIN + 2 * CH - 2) / CH * CH, RAW = NW * MMA_BM * LD;
};

// Shared memory of moe_mma16<Q, *, NW>: NW A tiles and two B tiles of TILE 16-bit values, then the staging area,
// copied in 16-byte chunks where it still fits beside them in static shared memory's 48 KB (mma_chunk); STAGED: it
// fits at all. BLOCKS: the blocks per SM the registers are capped for (128 or 80 a thread), as many as shared memory
// admits on sm_90 when staged: other blocks' decodes and MMAs fill this block's barriers (Q4_K spills a few bytes
// under the cap; without one ptxas takes 150-255 registers and 2-3 blocks fit).
template <class Q, int NW>
constexpr int mma_chunk() {
    return (NW + 2) * MMA_BM * MMA_LD * 2 + StagePlan<Q, NW, 16>::RAW <= 48 * 1024 || Q::BYTES % 16 == 0 ? 16
           : Q::BYTES % 8 == 0                                                                           ? 8
                                                                                                         : 4;
}

template <class Q, int NW>
struct MmaPlan : StagePlan<Q, NW, mma_chunk<Q, NW>()> {
    using Base = StagePlan<Q, NW, mma_chunk<Q, NW>()>;
    static constexpr int TILE = MMA_BM * MMA_LD;  // 16-bit values of an A or B tile
    static constexpr int OPS = (NW + 2) * TILE * 2, ACC = NW * MMA_BN * MMA_CLD * 4;
    static constexpr bool STAGED = OPS + Base::RAW <= 48 * 1024;
    static constexpr int USED = OPS + (STAGED ? Base::RAW : 0), SMEM = USED > ACC ? USED : ACC;
    static constexpr int BLOCKS = NW == 2 ? 4 : 6;
};

// One thread's rows of a tile kernel: it stages the raw windows of row drow of each of the NW matrices (two threads a
// row, part 0 and 1, copy alternate chunks) into the staging area R and decodes that row's columns dc .. dc + 31 of
// each step. arow[n]: the row's first block in matrix n (w0 or w1).
template <class Q, int NW, class S>
struct TileRows {
    const u8* arow[NW];
    int drow, part, dc;

    __device__ __forceinline__ TileRows(const u8* w0, const u8* w1, long long row_offset, int drow_, int part_)
        : drow(drow_), part(part_), dc(32 * part_) {
        arow[0] = w0 + row_offset;
        if constexpr (NW == 2) arow[1] = w1 + row_offset;
    }

    // Start the cp.async copies of span p's windows into R.
    __device__ __forceinline__ void stage(u8* R, int p) const {
        if constexpr (S::STAGED) {
#pragma unroll
            for (int n = 0; n < NW; n++) {
                const u8* win = arow[n] + (long long)p * S::WIN;
                int lead = (int)(reinterpret_cast<unsigned long long>(win) & (S::CH - 1));
                const u8* from = win - lead;
                u8* to = R + (n * MMA_BM + drow) * S::LD;
#pragma unroll
                for (int ch = part; ch < S::LD / S::CH; ch += 2)
                    if (ch * S::CH < lead + S::WIN) cp_async<S::CH>(to + ch * S::CH, from + ch * S::CH);
            }
        }
    }

    // Step s's columns of matrix n as O bits (R: the staged windows of the step's span): columns dc + 8j .. + 7 at
    // out[j ^ swz].
    template <class O>
    __device__ __forceinline__ void decode(const u8* R, int n, int s, uint4* out, int swz) const {
        const int col = s * MMA_BK + dc;
        if constexpr (S::STAGED) {
            const u8* win = arow[n] + (long long)(col / S::SPAN) * S::WIN;
            const u8* base = R + (n * MMA_BM + drow) * S::LD + (int)(reinterpret_cast<unsigned long long>(win) & (S::CH - 1));
            Decode32<Q, O>::run(base, col % S::SPAN, out, swz);
        } else {
            Decode32<Q, O>::run(arow[n], col, out, swz);
        }
    }
};

// The tile kernels' epilogue (128 threads) from the accumulators in shared memory, C[n][token][row] (row stride MMA_CLD): NW = 2
// stores h = swiglu(alpha * gate, alpha * up) at [(first + m) * ldc + r]: as float32 into out, or with out16 non-null
// as O times s16 into out16 (the down projection's operand; the caller's s16 keeps |h| <= limit^2 in range); NW = 1
// writes out[p * ldc + r] = alpha * hs[first + m] * weights[p] * acc, p = pairs[first + m] (hs null: 1). K64: out16's
// rows in the k64 order (moe_wgmma16's operand).
template <class O, int NW, bool K64 = false>
__device__ __forceinline__ void store_tile(const float* C, float a, int r0, int nrows, int first, int cnt,
                                           const int* __restrict__ pairs, float limit, const float* __restrict__ hs,
                                           const float* __restrict__ weights, float* __restrict__ out, int ldc,
                                           u16* __restrict__ out16, float s16) {
    for (int id = threadIdx.x; id < MMA_BN * MMA_BM; id += 128) {
        int m = id / MMA_BM, r = id % MMA_BM;
        if (m >= cnt || r0 + r >= nrows) continue;
        float v = a * C[m * MMA_CLD + r];
        if constexpr (NW == 2) {
            const float h = swiglu1(v, a * C[(MMA_BN + m) * MMA_CLD + r], limit);
            const long long at = (long long)(first + m) * ldc + r0;
            if (out16)
                out16[at + (K64 ? k64_position(r) : r)] = (u16)O::from(h * s16);
            else
                out[at + r] = h;
        } else {
            int p = pairs[first + m];
            out[(long long)p * ldc + r0 + r] = v * (hs ? hs[first + m] : 1.f) * weights[p];
        }
    }
}

// Four 8x8 16-bit matrices from shared memory; lane l gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const u16* row) {
    u32 addr = (u32)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// d += a (16x16, row-major) * b (16x8, column-major), fp32 accumulators; O picks fp16 or bf16 operands.
template <class O>
__device__ __forceinline__ void mma16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1);

template <>
__device__ __forceinline__ void mma16816<Half>(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma16816<BHalf>(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// One expert, one token tile: NW = 2 multiplies the gate and up matrices (w0, w1), NW = 1 multiplies w0; the
// results leave through store_tile. tiles[3 * blockIdx.y ..] = (expert, first sorted pair, token count <= MMA_BN).
// Token m's activations are row gather ? pairs[first + m] / k : first + m of x16 [*, ncols] (16-bit bits).
// ncols % MMA_BK == 0 and a block of the format never straddles an MMA_BK step (QK a multiple or divisor of MMA_BK).
// Four warps, each 32 rows x 32 tokens of the tile. Thread tid copies column unit tid % 8 of tokens tid / 8 + 16i
// (i < 4) of the activations; it stages the raw windows of row tid / 2 of each matrix and decodes that row's columns
// 32 * (tid % 2) .. + 31 (Decode32: a format reads its scales once for them).
// Step s: wait for its copies, barrier (they are visible, and the MMAs of s - 1 are done with A), decode into A,
// barrier (A is complete, the staging area free), start the copies of s + 1, multiply step s.
template <class Q, class O, int NW>
__global__ void __launch_bounds__(128, (MmaPlan<Q, NW>::BLOCKS)) moe_mma16(
        const u8* __restrict__ w0, const u8* __restrict__ w1, long long expert_bytes, long long row_bytes, int nrows,
        int ncols, const int* __restrict__ tiles, const u16* __restrict__ x16, const int* __restrict__ pairs, int k,
        int gather, const float* __restrict__ alpha, float limit, const float* __restrict__ hs,
        const float* __restrict__ weights, float* __restrict__ out, int ldc, u16* __restrict__ out16, float s16) {
    static_assert(MMA_BM == 64 && MMA_BN == 64 && MMA_BK == 64, "the thread maps of the copies and the decode");
    using S = MmaPlan<Q, NW>;
    constexpr int TILE = S::TILE;
    __shared__ __align__(16) u8 smem[S::SMEM];
    u16* A = reinterpret_cast<u16*>(smem);  // NW tiles [MMA_BM][MMA_LD], then two B tiles [MMA_BN][MMA_LD]
    u16* B = A + NW * TILE;                 // step s reads B + (s & 1) * TILE
    u8* R = smem + S::OPS;  // STAGED: the raw window of (matrix n, row r) at (n * MMA_BM + r) * S::LD
    float* C = reinterpret_cast<float*>(smem);  // after the loop: NW tiles [MMA_BN][MMA_CLD]
    int e = tiles[3 * blockIdx.y], first = tiles[3 * blockIdx.y + 1], cnt = tiles[3 * blockIdx.y + 2];
    if (cnt == 0) return;  // a tile slot past the last tile (moe_tiles)
    int r0 = blockIdx.x * MMA_BM, tid = threadIdx.x, lane = tid & 31, warp = tid / 32;
    int wr = 32 * (warp >> 1), wc = 32 * (warp & 1);
    constexpr int UNITS = MMA_BN * MMA_BK / 8 / 128;  // 8-value activation units a thread copies a step
    const int c = 8 * (tid % 8);
    const u16* bsrc[UNITS];
    const TileRows<Q, NW, S> rows(w0, w1, (long long)e * expert_bytes + (long long)min(r0 + tid / 2, nrows - 1) * row_bytes,
                                  tid / 2, tid % 2);
#pragma unroll
    for (int i = 0; i < UNITS; i++) {
        int row = tid / 8 + 16 * i;
        long long src = row < cnt ? (gather ? pairs[first + row] / k : first + row) : -1;
        bsrc[i] = src < 0 ? nullptr : x16 + src * ncols + c;
    }
    // Start the copies of step s: its activations into B tile s & 1 (padding tokens: zeros, stored directly) and,
    // at the first step of a span, the raw windows.
    auto start_copies = [&](int s) {
        u16* b = B + (s & 1) * TILE;
#pragma unroll
        for (int i = 0; i < UNITS; i++) {
            uint4* dst = reinterpret_cast<uint4*>(b + (tid / 8 + 16 * i) * MMA_LD + c);
            if (bsrc[i]) cp_async<16>(dst, bsrc[i] + s * MMA_BK);
            else *dst = make_uint4(0, 0, 0, 0);
        }
        if (s % (S::SPAN / MMA_BK) == 0) rows.stage(R, s / (S::SPAN / MMA_BK));
    };
    float acc[NW][2][4][4] = {};
    // ldmatrix rows of this lane: A (16x16 at rows wr + 16i) and B (two 8-token tiles at wc + 16j).
    int a_row = wr + (lane & 7) + 8 * ((lane >> 3) & 1), a_col = 8 * (lane >> 4);
    int b_row = wc + (lane & 7) + 8 * (lane >> 4), b_col = 8 * ((lane >> 3) & 1);
    const int steps = ncols / MMA_BK;
    start_copies(0);
    for (int s = 0; s < steps; s++) {
        cp_async_wait_all();
        __syncthreads();
#pragma unroll
        for (int n = 0; n < NW; n++)
            rows.template decode<O>(R, n, s, reinterpret_cast<uint4*>(A + (n * MMA_BM + rows.drow) * MMA_LD + rows.dc), 0);
        __syncthreads();
        if (s + 1 < steps) start_copies(s + 1);
        const u16* Bs = B + (s & 1) * TILE;
#pragma unroll
        for (int kk = 0; kk < MMA_BK; kk += 16) {
            u32 b[2][4];  // b[j]: tokens wc + 16j .. +15 as two 16x8 operands (regs 0-1, 2-3)
#pragma unroll
            for (int j = 0; j < 2; j++) ldmatrix_x4(b[j], Bs + (b_row + 16 * j) * MMA_LD + kk + b_col);
#pragma unroll
            for (int n = 0; n < NW; n++)
#pragma unroll
                for (int i = 0; i < 2; i++) {
                    u32 a[4];
                    ldmatrix_x4(a, A + (n * MMA_BM + a_row + 16 * i) * MMA_LD + kk + a_col);
#pragma unroll
                    for (int j = 0; j < 4; j++) mma16816<O>(acc[n][i][j], a, b[j / 2][2 * (j % 2)], b[j / 2][2 * (j % 2) + 1]);
                }
        }
    }
    __syncthreads();  // every warp is done with A and B before C overlays them
    // Fragment (n, i, j): rows wr + 16i + g (+8 for regs 2-3), tokens wc + 8j + 2t (+1 for odd regs).
    int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int n = 0; n < NW; n++)
#pragma unroll
        for (int i = 0; i < 2; i++)
#pragma unroll
            for (int j = 0; j < 4; j++)
#pragma unroll
                for (int q = 0; q < 4; q++)
                    C[(n * MMA_BN + wc + 8 * j + 2 * t + (q & 1)) * MMA_CLD + wr + 16 * i + g + 8 * (q >> 1)] =
                        acc[n][i][j][q];
    __syncthreads();
    store_tile<O, NW>(C, *alpha, r0, nrows, first, cnt, pairs, limit, hs, weights, out, ldc, out16, s16);
}

// The first index i of sorted[0 .. n) with sorted[i] >= v (sorted ascending).
__device__ __forceinline__ int lower_bound(const int* __restrict__ sorted, int n, int v) {
    int lo = 0, hi = n;
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (sorted[mid] < v) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

// moe_mma16's tiles from the pairs' expert ids sorted[0 .. n) (ascending; ids >= E, slots without an expert, last):
// tiles[3 i ..] = (expert, first sorted pair, tokens <= MMA_BN), each expert's pairs in tiles of MMA_BN, experts in
// order; slots from the last tile up to max_tiles get no tokens. On the device, so a prefill's MoE reads nothing back
// to the host (the counts were a host synchronisation per layer). One block of at most 1024 threads.
extern "C" __global__ void moe_tiles(const int* __restrict__ sorted, int n, int E, int* __restrict__ tiles,
                                     int max_tiles) {
    __shared__ int scan[1024];
    int base = 0;  // tiles of the experts before this round's
    for (int e0 = 0; e0 < E; e0 += blockDim.x) {
        const int e = e0 + threadIdx.x;
        const int first = e < E ? lower_bound(sorted, n, e) : 0;
        const int cnt = e < E ? lower_bound(sorted, n, e + 1) - first : 0;
        const int own = (cnt + MMA_BN - 1) / MMA_BN;
        scan[threadIdx.x] = own;
        __syncthreads();
        for (int off = 1; off < (int)blockDim.x; off <<= 1) {  // inclusive prefix sum
            const int add = (int)threadIdx.x >= off ? scan[threadIdx.x - off] : 0;
            __syncthreads();
            scan[threadIdx.x] += add;
            __syncthreads();
        }
        const int t0 = base + scan[threadIdx.x] - own;
        for (int i = 0; i < own; i++) {
            tiles[3 * (t0 + i)] = e;
            tiles[3 * (t0 + i) + 1] = first + MMA_BN * i;
            tiles[3 * (t0 + i) + 2] = min(MMA_BN, cnt - MMA_BN * i);
        }
        base += scan[blockDim.x - 1];
        __syncthreads();
    }
    for (int i = base + threadIdx.x; i < max_tiles; i += blockDim.x) {
        tiles[3 * i] = 0;
        tiles[3 * i + 1] = 0;
        tiles[3 * i + 2] = 0;
    }
}

// out[i, :] = h[i, :] times the row's power of two s as O (k64: in the k64 order, R a multiple of 64), hs[i] = 1 / s.
// One block per row of R floats.
template <class O>
__global__ void rows_to16(const float* __restrict__ h, int R, u16* __restrict__ out, float* __restrict__ hs, int k64) {
    __shared__ float shared[32];
    long long row = blockIdx.x;
    const float* src = h + row * R;
    float amax = 0.f;
    for (int c = threadIdx.x; c < R; c += blockDim.x) amax = fmaxf(amax, fabsf(src[c]));
    float s = up_scale(block_max(amax, shared));
    for (int c = threadIdx.x; c < R; c += blockDim.x) out[row * R + (k64 ? k64_index(c) : c)] = (u16)O::from(src[c] * s);
    if (threadIdx.x == 0) hs[row] = 1.f / s;
}
