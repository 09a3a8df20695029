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

// Columns c .. c + 15 (c a multiple of 16) of the row whose blocks start at base, as O bits: columns c + 8j .. + 7 at
// out[j] (the routed experts' A fragments, kernels/moe_tile.cu).
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

// Q2_K's columns c .. c + 15 (c % 16 == 0), one scale group: its four values a * q - o (q = 0 .. 3) are computed and
// rounded once, and each pair of weights is picked from them by one prmt whose selector its two codes make (nibbles
// 2q, 2q + 1 of each): about half the instructions of decoding and rounding every weight, the same bits.
template <class O>
struct Decode16<Q2_K, O> {
    static __device__ __forceinline__ void run(const u8* base, int c, uint4 (&out)[2]) {
        const u8* b = base + c / Q2_K::QK * Q2_K::BYTES;
        const int e0 = c % Q2_K::QK, shift = 2 * (e0 % 128 / 32);
        const u8* q = b + 16 + 32 * (e0 / 128) + e0 % 32;
        const u8 packed = b[e0 / 16];
        const float a = half_at(b + 80) * (float)(packed & 0xF), o = half_at(b + 82) * (float)(packed >> 4);
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

// The k64 order of the routed experts' tile operands (kernels/moe_tile.cu): column o = 16t + 4q + 2h + e of each 64
// (t, q < 4; h, e < 2) sits at position 16q + 8h + 2t + e. Their A fragments give the thread t of a quad positions
// 2t, 2t + 1, 2t + 8, 2t + 9 of each 16-wide slice q, so in this order they are the 16 consecutive columns
// 16t .. 16t + 15, which it decodes whole; the activations (to16 with k64, rows_to16, store_tile) are written in the
// same order, and the products' sums run over the same pairs.
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

// out[i, :] = h[i, :] times the row's power of two s as O, in the k64 order (R a multiple of 64: the down tiles'
// operand), hs[i] = 1 / s. One block per row of R floats.
template <class O>
__global__ void rows_to16(const float* __restrict__ h, int R, u16* __restrict__ out, float* __restrict__ hs) {
    __shared__ float shared[32];
    long long row = blockIdx.x;
    const float* src = h + row * R;
    float amax = 0.f;
    for (int c = threadIdx.x; c < R; c += blockDim.x) amax = fmaxf(amax, fabsf(src[c]));
    float s = up_scale(block_max(amax, shared));
    for (int c = threadIdx.x; c < R; c += blockDim.x) out[row * R + k64_index(c)] = (u16)O::from(src[c] * s);
    if (threadIdx.x == 0) hs[row] = 1.f / s;
}
