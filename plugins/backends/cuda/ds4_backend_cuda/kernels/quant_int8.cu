// Integer decode path: compiled after quant.cu in one NVRTC module (it uses that file's format structs,
// WarpDot staging and helpers).
//
// Each block first quantizes the activation columns it reads into shared memory: blocks of 32 int8 values q with a
// float scale d = max|x| / 127 (x ~ q d, |x - q d| <= d / 2) and the float sums of each 16-element half of the block
// (for formats with a min term); the weights' first loads are in flight meanwhile, so this costs no launch and no
// round trip through memory. A lane then dots one 32-element group of a weight row with __dp4a (four int8 products
// per instruction, exact integer sums) and applies the weight and activation scales once per group: for the 2-bit
// formats about 1.5-2 instructions per weight instead of 5 on the float path.

// An int8 activation in shared memory: codes q[c], half sums s[c / 32] (first and second 16), scales d[c / 32];
// n columns take n + n / 4 + n / 8 bytes, in that order.
struct I8Act {
    const signed char* q;
    const float2* s;
    const float* d;
    float scale;  // what every dot product with the activation is multiplied by (an RMSNorm folded in, else 1)
};

// Columns 0 .. n - 1 of x (n a multiple of 32), times the weights `norm` where it is not null, quantized into shared
// memory at `smem` by all threads of the block: a thread takes 8 columns, four neighbouring lanes a block of 32
// (q = rint(v * 127 / max|v|)). `ss` gets this thread's sum of x^2 over its columns (x before the weights).
__device__ __forceinline__ I8Act quantize_shared(const float* __restrict__ x, int n, u8* smem,
                                                 const float* __restrict__ norm, float& ss) {
    signed char* q = reinterpret_cast<signed char*>(smem);
    float2* s = reinterpret_cast<float2*>(smem + n);
    float* d = reinterpret_cast<float*>(smem + n + n / 4);
    const int lane = threadIdx.x & 31;
#pragma unroll 4
    for (int c0 = 0; c0 < n; c0 += 8 * blockDim.x) {  // whole warps iterate: the shuffles need every lane
        const int c = c0 + 8 * threadIdx.x;
        float4 a = make_float4(0.f, 0.f, 0.f, 0.f), b = a;
        if (c < n) {
            a = reinterpret_cast<const float4*>(x + c)[0];
            b = reinterpret_cast<const float4*>(x + c)[1];
            ss += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w + b.x * b.x + b.y * b.y + b.z * b.z + b.w * b.w;
            if (norm) {
                const float4 wa = reinterpret_cast<const float4*>(norm + c)[0];
                const float4 wb = reinterpret_cast<const float4*>(norm + c)[1];
                a = make_float4(a.x * wa.x, a.y * wa.y, a.z * wa.z, a.w * wa.w);
                b = make_float4(b.x * wb.x, b.y * wb.y, b.z * wb.z, b.w * wb.w);
            }
        }
        float amax = fmaxf(fmaxf(fmaxf(fabsf(a.x), fabsf(a.y)), fmaxf(fabsf(a.z), fabsf(a.w))),
                           fmaxf(fmaxf(fabsf(b.x), fabsf(b.y)), fmaxf(fabsf(b.z), fabsf(b.w))));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
        const float inv = amax > 0.f ? 127.0f / amax : 0.f;
        float sum = (a.x + a.y) + (a.z + a.w) + ((b.x + b.y) + (b.z + b.w));
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);  // the 16 columns of this thread and its even/odd neighbour
        const float other = __shfl_xor_sync(0xffffffffu, sum, 2);
        if (c < n) {
            const int v[8] = {__float2int_rn(a.x * inv), __float2int_rn(a.y * inv), __float2int_rn(a.z * inv),
                              __float2int_rn(a.w * inv), __float2int_rn(b.x * inv), __float2int_rn(b.y * inv),
                              __float2int_rn(b.z * inv), __float2int_rn(b.w * inv)};
            u32 w[2];
#pragma unroll
            for (int k = 0; k < 2; k++)
                w[k] = (u32)(v[4 * k] & 255) | (u32)(v[4 * k + 1] & 255) << 8 | (u32)(v[4 * k + 2] & 255) << 16 |
                       (u32)(v[4 * k + 3] & 255) << 24;
            *reinterpret_cast<uint2*>(q + c) = make_uint2(w[0], w[1]);
            if ((lane & 3) == 0) {
                s[c / 32] = make_float2(sum, other);
                d[c / 32] = amax / 127.0f;
            }
        }
    }
    return {q, s, d, 1.f};
}

// Columns first .. n - 1 of an int8 activation of n columns that an earlier kernel wrote to global memory in
// I8Act's layout (act.cuh), read in place: no quantization and no block barrier before the first dot product.
__device__ __forceinline__ I8Act global_activation(const u8* __restrict__ act, int n, int first) {
    grid_wait();  // the weights' first loads are in flight (pdl.cuh); act is the previous kernel's output
    return {reinterpret_cast<const signed char*>(act) + first, reinterpret_cast<const float2*>(act + n) + first / 32,
            reinterpret_cast<const float*>(act + n + n / 4) + first / 32, 1.f};
}

__device__ __forceinline__ float half_at2(const u8* p) {  // p is 2-byte aligned
    return __half2float(__ushort_as_half(u16_at(p)));
}

__device__ __forceinline__ u32 u32_at2(const u8* p) {  // p is 2-byte aligned
    return (u32)u16_at(p) | ((u32)u16_at(p + 2) << 16);
}

// I8<Q>: format Q with CHUNK blocks staged per row (32 groups of 32 elements: one per lane), TABLE bytes of
// shared lookup tables filled by fill(), and dot(block, g, q, dx, s0, s1, table): group g (elements 32g .. 32g+31)
// of the block dotted with int8 activations q (8 words, 4 elements each) of scale dx and half sums s0, s1.
template <class Q>
struct I8;

// Codes at b + 2 are 2-byte aligned: aligned words funnel-shifted into place.
template <>
struct I8<Q8_0> : Q8_0 {
    static constexpr int CHUNK = 32, TABLE = 0;
    static __device__ __forceinline__ void fill(u8*) {}
    static __device__ __forceinline__ float dot(const u8* b, int, const int (&q)[8], float dx, float, float,
                                                const u8*) {
        const u8* c = b + 2;
        u32 shift = 8 * (u32)(reinterpret_cast<u64>(c) & 3);
        const u32* w = reinterpret_cast<const u32*>(c - (shift >> 3));
        int s = 0;
        u32 lo = w[0];
#pragma unroll
        for (int i = 0; i < 8; i++) {
            u32 hi = w[i + 1];
            s = __dp4a((int)__funnelshift_r(lo, hi, shift), q[i], s);
            lo = hi;
        }
        return half_at2(b) * dx * (float)s;
    }
};

// Group g is elements 128h + 32j + l (h = g / 4, j = g % 4, l < 32): bits 2j of qs[32h + l]; scale bytes 2g
// (l < 16) and 2g + 1 (l >= 16), low nibble scale, high nibble min. The codes are masked in place, not shifted
// down: each byte is then 4^j times its code (at most 192, so dp4a takes the weights unsigned), and the integer sum,
// 4^j times the true one and below 2^24, becomes the same float after a product with 4^-j.
template <>
struct I8<Q2_K> : Q2_K {
    static constexpr int CHUNK = 4, TABLE = 0;
    static __device__ __forceinline__ void fill(u8*) {}
    static __device__ __forceinline__ int dp4a_unsigned(u32 a, int b, int c) {
        int d;
        asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
        return d;
    }
    static __device__ __forceinline__ float dot(const u8* b, int g, const int (&q)[8], float dx, float s0,
                                                float s1, const u8*) {
        const u32* qs = reinterpret_cast<const u32*>(b + 16 + 32 * (g >> 2));
        const int j = g & 3;
        const u32 mask = 0x03030303u << (2 * j);
        int lo = 0, hi = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            lo = dp4a_unsigned(qs[i] & mask, q[i], lo);
            hi = dp4a_unsigned(qs[4 + i] & mask, q[4 + i], hi);
        }
        u32 sc = u16_at(b + 2 * g);
        u32 dd = u32_at(b + 80);
        float d = __half2float(__ushort_as_half((u16)(dd & 0xFFFF)));
        float dmin = __half2float(__ushort_as_half((u16)(dd >> 16)));
        int isum = (int)(sc & 0xF) * lo + (int)((sc >> 8) & 0xF) * hi;
        const float down = __int_as_float((127 - 2 * j) << 23);  // 4^-j
        return d * dx * ((float)isum * down) - dmin * ((float)((sc >> 4) & 0xF) * s0 + (float)(sc >> 12) * s1);
    }
};

// Group g: 4 grid indices (bytes) and aux (four 7-bit sign indices, 4-bit scale) at b + 2 + 8g. A grid row's
// magnitudes are 8, 25 or 43, so eight signed weights are eight picks from the palette {8, 25, 43, -8, -25, -43}:
// one prmt per four of them, whose selector nibbles are the magnitude's code (0-2) plus 4 when the weight is
// negative. Tables (iq2xxs_i8_words, written by the host at load): the grid rows as eight code nibbles (256 words),
// and each 7-bit sign index with its parity as the eighth sign spread to bit 2 of each nibble (128 words); a group of
// 8 weights is then two lookups, an or, two prmts and two dp4as, where byte masks of the signs and a second dp4a for
// the negated sum took eighteen.
__device__ __align__(16) u32 iq2xxs_i8_words[256 + 128];

template <>
struct I8<IQ2_XXS> : IQ2_XXS {
    static constexpr int CHUNK = 4, CODES = 256, SIGNS = 128, TABLE = 4 * (CODES + SIGNS);
    static constexpr u32 PALETTE_POS = 0x002B1908u, PALETTE_NEG = 0x00D5E7F8u;  // bytes 8, 25, 43 and their negations
    static __device__ __forceinline__ void fill(u8* table) {  // by all threads of the block
        const uint4* from = reinterpret_cast<const uint4*>(iq2xxs_i8_words);
        for (int i = threadIdx.x; i < TABLE / 16; i += blockDim.x) reinterpret_cast<uint4*>(table)[i] = from[i];
        __syncthreads();  // every warp reads the whole table, and with an activation read in place no other barrier
    }                     // comes before the first read
    static __device__ __forceinline__ int signed_bytes(u32 selectors) {
        u32 v;
        asm("prmt.b32 %0, %1, %2, %3;" : "=r"(v) : "r"(PALETTE_POS), "r"(PALETTE_NEG), "r"(selectors));
        return (int)v;
    }
    static __device__ __forceinline__ float dot(const u8* b, int g, const int (&q)[8], float dx, float, float,
                                                const u8* table) {
        const u8* p = b + 2 + 8 * g;
        const u32 grid_idx = u32_at2(p), aux = u32_at2(p + 4);
        const u32* codes = reinterpret_cast<const u32*>(table);
        const u32* signs = codes + CODES;
        int sum = 0;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const u32 sel = codes[(grid_idx >> (8 * k)) & 0xFF] | signs[(aux >> (7 * k)) & 127];
            sum = __dp4a(signed_bytes(sel), q[2 * k], sum);
            sum = __dp4a(signed_bytes(sel >> 16), q[2 * k + 1], sum);
        }
        // value = d (0.5 + scale) / 4 * magnitude * sign = d (2 scale + 1) / 8 * ...
        return half_at2(b) * dx * 0.125f * (float)(sum * (int)(2 * (aux >> 28) + 1));
    }
};

// Group g is sub-block g, elements 32g .. 32g + 31: the low (g even) or high (g odd) nibbles of qs[32 (g / 2) + l],
// with its 6-bit scale and min. As in Q2_K the codes are masked in place: a high nibble's byte is 16 times its code
// (at most 240, taken unsigned by dp4a), and the integer sum, below 2^24, becomes the same float times 1/16.
template <>
struct I8<Q4_K> : Q4_K {
    static constexpr int CHUNK = 4, TABLE = 0;
    static __device__ __forceinline__ void fill(u8*) {}
    static __device__ __forceinline__ float dot(const u8* b, int g, const int (&q)[8], float dx, float s0, float s1,
                                                const u8*) {
        const u32* qs = reinterpret_cast<const u32*>(b + 16 + 32 * (g >> 1));
        const u32 mask = g & 1 ? 0xF0F0F0F0u : 0x0F0F0F0Fu;
        int sum = 0;
#pragma unroll
        for (int i = 0; i < 8; i++) sum = I8<Q2_K>::dp4a_unsigned(qs[i] & mask, q[i], sum);
        int sc, m;
        scale_min(b + 4, g, sc, m);
        const float down = g & 1 ? 0.0625f : 1.0f;
        return half_at(b) * (float)sc * dx * ((float)sum * down) - half_at(b + 2) * (float)m * (s0 + s1);
    }
};

// A block is one group: code byte j holds element j (low nibble) and element 16 + j (high nibble). Twice an E2M1
// magnitude is an integer (0, 1, 2, 3, 4, 6, 8, 12), so four of them are one prmt whose selector nibbles are the
// codes. A code with its sign bit set makes prmt give the sign of the byte it picks instead, 0 as every table byte
// is positive: the same selectors pick the positive weights, and with their sign bits flipped the negative ones, and
// the difference of the two dp4as is the signed sum (the block's scale 2^(e - 128) halves it back).
template <>
struct I8<MXFP4> : MXFP4 {
    static constexpr int CHUNK = 32, TABLE = 0;
    static constexpr u32 TWICE_LOW = 0x03020100u, TWICE_HIGH = 0x0C080604u;
    static __device__ __forceinline__ void fill(u8*) {}
    // The low nibbles of w's four bytes (its other bits zero) as the four selector nibbles of a prmt.
    static __device__ __forceinline__ u32 selectors(u32 w) {
        return __byte_perm(w | (w >> 4), 0, 0x0020);
    }
    static __device__ __forceinline__ int pick(u32 sel) {
        u32 v;
        asm("prmt.b32 %0, %1, %2, %3;" : "=r"(v) : "r"(TWICE_LOW), "r"(TWICE_HIGH), "r"(sel));
        return (int)v;
    }
    static __device__ __forceinline__ float dot(const u8* b, int, const int (&q)[8], float dx, float, float,
                                                const u8*) {
        const u8* c = b + 1;
        const u32 shift = 8 * (u32)(reinterpret_cast<u64>(c) & 3);
        const u32* w = reinterpret_cast<const u32*>(c - (shift >> 3));
        int pos = 0, neg = 0;
        u32 lo = w[0];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const u32 hi = w[k + 1], codes = __funnelshift_r(lo, hi, shift);
            lo = hi;
            const u32 low = selectors(codes & 0x0F0F0F0Fu), high = selectors((codes >> 4) & 0x0F0F0F0Fu);
            pos = __dp4a(pick(low), q[k], pos);
            neg = __dp4a(pick(low ^ 0x8888u), q[k], neg);
            pos = __dp4a(pick(high), q[4 + k], pos);
            neg = __dp4a(pick(high ^ 0x8888u), q[4 + k], neg);
        }
        return ldexpf(dx, (int)b[0] - 128) * (float)(pos - neg);
    }
};

// Shared lookup tables of a kernel (at least one word, so that formats without tables still declare one).
template <class Q>
struct I8Table {
    static constexpr int BYTES = I8<Q>::TABLE > 0 ? I8<Q>::TABLE : 16;
};

// One warp's dot products of R weight rows with the block's int8 activation, for ngroups groups of rows in turn:
// rows(g, row) sets group g's R row pointers and returns the column of act where its activation starts. The chunks
// ks, ks + KS, ... of group 0, then of group 1, ... are staged like WarpDot (16-byte loads into registers, the next
// chunk in flight, of this group or the next, while this one is read from shared memory); lane u takes the u-th
// 32-element group of the chunk. done(g) follows group g's last chunk, with this lane's sums in acc (then zeroed by
// done). The first chunk's loads are issued before prepare(), which every thread of the block calls once (it
// quantizes the activation). Without PASSES, ngroups is 0 or 1 (the rows stay put, and so do their registers).
template <class Q, int R, bool PASSES, class Rows, class Prepare, class Done>
__device__ __forceinline__ void warp_dot_i8(Rows rows, int ngroups, int ncols, Prepare prepare, int ks, int KS,
                                            uint4* stage, const u8* table, float (&acc)[R], Done done) {
    using F = I8<Q>;
    using D = WarpDot<F, R, 1>;
    constexpr int GROUPS = Q::QK / 32;
    const int lane = threadIdx.x & 31, nblocks = ncols / Q::QK, nchunks = (nblocks + F::CHUNK - 1) / F::CHUNK;
    const int per = ks < nchunks ? (nchunks - ks + KS - 1) / KS : 0, total = ngroups * per;
    const u8* row[R];
    int col = 0;
    uint4 buf[D::LOADS];
    if (total > 0) {
        col = rows(0, row);
        D::fetch(row, ks, nblocks, lane, buf);
    }
    const I8Act act = prepare();
    if (per == 0)
        for (int g = 0; g < ngroups; g++) done(g);
    for (int i = 0, g = 0, c = ks; i < total; i++) {
        __syncwarp();
#pragma unroll
        for (int k = 0; k < D::LOADS; k++) {
            int slot = lane + 32 * k;
            if (slot < D::SLOTS) stage[slot] = buf[k];
        }
        __syncwarp();
        const int b0 = c * F::CHUNK, nb = min(F::CHUNK, nblocks - b0), at = col;
        int skew[R];
#pragma unroll
        for (int j = 0; j < R; j++) skew[j] = (int)(reinterpret_cast<u64>(row[j] + (long long)b0 * Q::BYTES) & 15);
        int gn = g, cn = c + KS;
        if (cn >= nchunks) {
            gn = g + 1;
            cn = ks;
            if constexpr (PASSES)
                if (gn < ngroups) col = rows(gn, row);
        }
        if (i + 1 < total) D::fetch(row, cn, nblocks, lane, buf);
        const u8* base = reinterpret_cast<const u8*>(stage);
        for (int u = lane; u < nb * GROUPS; u += 32) {
            const int blk = u / GROUPS, k = u % GROUPS;
            const int grp = at / 32 + b0 * GROUPS + u;  // 32-column group of the activation
            const int4* xv = reinterpret_cast<const int4*>(act.q + 32 * grp);
            const int4 qa = xv[0], qb = xv[1];
            const int q[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
            const float dx = act.d[grp];
            const float2 s = act.s[grp];
#pragma unroll
            for (int j = 0; j < R; j++)
                acc[j] += F::dot(base + j * D::SEGS * 16 + skew[j] + blk * Q::BYTES, k, q, dx, s.x, s.y, table);
        }
        if (gn != g) done(g);
        g = gn;
        c = cn;
    }
}

// The int8 activation of a block: `groups` activations of ncols columns from x, after __syncthreads. With `norm`
// (one group), the activation is RMSNorm(x) * norm: x * norm is quantized and the scale rsqrt(mean(x^2) + eps), from
// the block's sum of squares, rides on every dot product (they are linear in the activation).
__device__ __forceinline__ I8Act block_activation(const float* __restrict__ x, int ncols, int groups,
                                                  const float* __restrict__ norm = nullptr, float eps = 0.f) {
    extern __shared__ __align__(16) u8 act_smem[];
    __shared__ float warp_ss[32];
    grid_wait();  // gemv_i8's first weight loads are in flight (pdl.cuh); x is the previous kernel's output
    float ss = 0.f;
    I8Act act = quantize_shared(x, groups * ncols, act_smem, norm, ss);
    if (norm) {
        ss = warp_sum(ss);
        if ((threadIdx.x & 31) == 0) warp_ss[threadIdx.x / 32] = ss;
    }
    __syncthreads();
    if (norm) {
        float total = 0.f;
        for (int w = 0; w < (int)(blockDim.x / 32); ++w) total += warp_ss[w];
        act.scale = rsqrtf(total / (float)ncols + eps);
    }
    return act;
}

// A hyper-connection's split left to this launch (split_hosting.py): with split_row not null, the launch has one
// block more than its work needs, the last in x (for every y), and the one of them with blockIdx.y 0 waits for the
// launch's predecessor, as every block does before it reads, and runs hc_split4_lane on the mix row; true for those
// extra blocks, which leave before the launch's own work.
#define HC_HOSTED_SPLIT_PARAMS                                                                                        \
    const float *__restrict__ split_row, const float *__restrict__ split_scale,                                       \
            const float *__restrict__ split_base, int split_iters, float split_eps, float *__restrict__ split_pre,     \
            float *__restrict__ split_post, float *__restrict__ split_comb
#define HC_HOSTED_SPLIT_ARGS \
    split_row, split_scale, split_base, split_iters, split_eps, split_pre, split_post, split_comb
__device__ __forceinline__ bool hosted_split(HC_HOSTED_SPLIT_PARAMS) {
    if (!split_row || blockIdx.x != gridDim.x - 1) return false;
    grid_wait();
    if (blockIdx.y == 0 && threadIdx.x < 32)
        hc_split4_lane(split_row, split_scale, split_base, split_iters, split_eps, split_pre, split_post, split_comb);
    return true;
}

// y[r] = sum_c W[r, c] x[g(r), c] for one token, x[g] = x + g * ncols, g(r) = r / group_rows. A block is
// GEMV_WARPS warps: GEMV_WARPS / KS groups of GEMV_ROWS rows, each row group split over KS warps by chunks and summed
// in a fixed order; with KS = 1 the block makes P passes, each warp streaming its P row groups back to back (P = 1
// when KS > 1). Dynamic shared memory: the I8Act of the activations of the x groups a block's rows touch. W's rows as
// row_at finds them. act_in (not null; no norm): the I8Act of all x groups, one after the other, in global memory
// instead, as an earlier kernel wrote it (act.cuh; no shared memory then). act_out (not null; KS = 1, nrows a
// multiple of 32): y is also written there quantized, as the I8Act of nrows columns, each block its 32-row passes
// (write_group).
template <class Q>
__global__ void __launch_bounds__(32 * GEMV_WARPS) gemv_i8(
        const u8* __restrict__ w, long long row_bytes, int nrows, int ncols, const float* __restrict__ x,
        int group_rows, float* __restrict__ y, int KS, int P, const long long* __restrict__ segs, int nsegs,
        const float* __restrict__ norm, float eps, const u8* __restrict__ act_in, u8* __restrict__ act_out,
        HC_HOSTED_SPLIT_PARAMS) {
    if (hosted_split(HC_HOSTED_SPLIT_ARGS)) return;
    using D = WarpDot<I8<Q>, GEMV_ROWS, 1>;
    __shared__ uint4 stage[GEMV_WARPS][D::SLOTS];
    __shared__ float partial[GEMV_WARPS][GEMV_ROWS];
    __shared__ __align__(16) u8 table[I8Table<Q>::BYTES];
    I8<Q>::fill(table);
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    const int groups = GEMV_WARPS / KS, rg = warp / KS, ks = warp % KS, span = groups * GEMV_ROWS;
    const int first = blockIdx.x * P * span, g0 = first / group_rows;
    const int g1 = (min(first + P * span, nrows) - 1) / group_rows;
    auto row0 = [&](int g) { return first + g * span + rg * GEMV_ROWS; };
    int ngroups = 0;
    while (ngroups < P && row0(ngroups) < nrows) ngroups++;
    float acc[GEMV_ROWS] = {}, scale = 1.f;
    warp_dot_i8<Q, GEMV_ROWS, true>(
        [&](int g, const u8* (&row)[GEMV_ROWS]) {
            const int r0 = row0(g);
#pragma unroll
            for (int j = 0; j < GEMV_ROWS; j++) row[j] = row_at(w, segs, nsegs, min(r0 + j, nrows - 1), row_bytes);
            return (r0 / group_rows - g0) * ncols;
        },
        ngroups, ncols,
        [&] {
            if (act_in) return global_activation(act_in, (nrows + group_rows - 1) / group_rows * ncols, g0 * ncols);
            const I8Act act = block_activation(x + (long long)g0 * ncols, ncols, g1 - g0 + 1, norm, eps);
            scale = act.scale;
            return act;
        },
        ks, KS, stage[warp], table, acc,
        [&](int g) {
            const int r0 = row0(g);
#pragma unroll
            for (int j = 0; j < GEMV_ROWS; j++) {
                const float s = warp_sum(acc[j]);
                acc[j] = 0.f;
                if (lane == j) {
                    if (KS > 1) partial[warp][j] = s;
                    else if (r0 + j < nrows) y[r0 + j] = s * scale;
                }
            }
        });
    if (KS > 1) {
        __syncthreads();
        const int r0 = row0(0);
        if (ks == 0 && lane < GEMV_ROWS) {
            float s = 0.f;
            for (int i = 0; i < KS; i++) s += partial[warp + i][lane];
            if (r0 + lane < nrows) y[r0 + lane] = s * scale;
        }
    }
    if (!act_out) return;
    __syncthreads();  // the block's rows of y are written and visible to its threads
    const int end = min(first + P * span, nrows);
    for (int r = first + 32 * warp; r < end; r += 32 * GEMV_WARPS) write_group(y[r + lane], r, nrows, act_out);
}

// Routed-expert GEMV on int8 activations: y[p, r] = sum_c W_{idx[p]}[r, c] x[p / x_div, c]; a negative id
// gives zeros. grid = (row blocks, P), GEMV_WARPS row groups of GEMV_ROWS rows; dynamic shared memory:
// the I8Act of ncols columns.
template <class Q>
__global__ void __launch_bounds__(32 * GEMV_WARPS) moe_gemv_i8(
        const u8* __restrict__ w, long long expert_bytes, long long row_bytes, int nrows, int ncols,
        const int* __restrict__ idx, const float* __restrict__ x, int x_div, float* __restrict__ y) {
    using D = WarpDot<I8<Q>, GEMV_ROWS, 1>;
    __shared__ uint4 stage[GEMV_WARPS][D::SLOTS];
    __shared__ __align__(16) u8 table[I8Table<Q>::BYTES];
    I8<Q>::fill(table);  // constant data: before the wait, beside the previous kernel's tail
    grid_wait();
    int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    int p = blockIdx.y, e = idx[p];
    int r0 = (blockIdx.x * GEMV_WARPS + warp) * GEMV_ROWS;
    float acc[GEMV_ROWS] = {};
    const u8* row[GEMV_ROWS];
#pragma unroll
    for (int j = 0; j < GEMV_ROWS; j++)
        row[j] = w + (long long)max(e, 0) * expert_bytes + (long long)min(r0 + j, nrows - 1) * row_bytes;
    warp_dot_i8<Q, GEMV_ROWS, false>(
        [&](int, const u8* (&r)[GEMV_ROWS]) {
#pragma unroll
            for (int j = 0; j < GEMV_ROWS; j++) r[j] = row[j];
            return 0;
        },
        e >= 0 && r0 < nrows, ncols, [&] { return block_activation(x + (long long)(p / x_div) * ncols, ncols, 1); },
        0, 1, stage[warp], table, acc, [](int) {});
#pragma unroll
    for (int j = 0; j < GEMV_ROWS; j++) {
        float s = warp_sum(acc[j]);
        if (lane == 0 && r0 + j < nrows) y[(long long)p * nrows + r0 + j] = s;
    }
}

// Fused routed gate/up/SwiGLU on int8 activations (as moe_gate_up): GEMV_ROWS gate rows and the same up rows of
// expert idx[p] against x[p / x_div], split over KS warps by chunks (GateUp<Q>::WARPS / KS row groups a block) and
// summed in a fixed order; a negative id gives zeros, a null idx expert 0 for every pair. Dynamic shared memory as
// moe_gemv_i8; with act_in (x one row), none: x's I8Act in global memory, read in place. act_out (not null; KS = 1,
// a block's rows a group of 32, nrows a multiple of 32): h is also written there quantized, as the I8Act of all
// P · nrows values one pair after the other, which moe_down_sum_i8 reads in place.
// GateUp<Q>: warps a block and blocks a multiprocessor each format's kernel is bounded to. Q8_0 (the shared expert,
// 167 registers) four warps, three blocks; the others eight warps, a block's 32 rows one group of act_out: Q2_K,
// Q4_K and MXFP4 two blocks (Q2_K 126 registers); IQ2_XXS three (80 registers), so that a decode step's 6 routed experts take one
// wave of 384 blocks beside the shared expert's launch (with blocks of four warps bounded to six a multiprocessor,
// against 1.45 waves unbounded: in 12-layer Flash decode steps 566 against 554 t/s; as eight warps 22.5 -> 20.0 µs
// alone, no longer spilling). Four blocks (64 registers) ran at 28.4 µs.
template <class Q>
struct GateUp {
    static constexpr int WARPS = 8, MIN = 2;
};
template <>
struct GateUp<Q8_0> {
    static constexpr int WARPS = 4, MIN = 3;
};
template <>
struct GateUp<IQ2_XXS> {
    static constexpr int WARPS = 8, MIN = 3;
};
template <class Q>
__global__ void __launch_bounds__(32 * GateUp<Q>::WARPS, GateUp<Q>::MIN) moe_gate_up_i8(
        const u8* __restrict__ wg, const u8* __restrict__ wu, long long expert_bytes, long long row_bytes,
        int nrows, int ncols, const int* __restrict__ idx, const float* __restrict__ x, int x_div, float limit,
        float* __restrict__ h, int KS, const u8* __restrict__ act_in, u8* __restrict__ act_out,
        HC_HOSTED_SPLIT_PARAMS) {
    if (hosted_split(HC_HOSTED_SPLIT_ARGS)) return;
    constexpr int WARPS = GateUp<Q>::WARPS;
    using D = WarpDot<I8<Q>, 2 * GEMV_ROWS, 1>;
    __shared__ uint4 stage[WARPS][D::SLOTS];
    __shared__ float partial[WARPS][2 * GEMV_ROWS];
    __shared__ __align__(16) u8 table[I8Table<Q>::BYTES];
    I8<Q>::fill(table);  // constant data: before the wait, beside the previous kernel's tail
    grid_wait();
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, rg = warp / KS, ks = warp % KS;
    const int p = blockIdx.y, e = idx ? idx[p] : 0, r0 = (blockIdx.x * (WARPS / KS) + rg) * GEMV_ROWS;
    float acc[2 * GEMV_ROWS] = {};
    const u8* row[2 * GEMV_ROWS];
#pragma unroll
    for (int j = 0; j < GEMV_ROWS; j++) {
        long long off = (long long)max(e, 0) * expert_bytes + (long long)min(r0 + j, nrows - 1) * row_bytes;
        row[j] = wg + off;
        row[GEMV_ROWS + j] = wu + off;
    }
    warp_dot_i8<Q, 2 * GEMV_ROWS, false>(
        [&](int, const u8* (&r)[2 * GEMV_ROWS]) {
#pragma unroll
            for (int j = 0; j < 2 * GEMV_ROWS; j++) r[j] = row[j];
            return 0;
        },
        e >= 0 && r0 < nrows, ncols,
        [&] {
            return act_in ? global_activation(act_in, ncols, 0)
                          : block_activation(x + (long long)(p / x_div) * ncols, ncols, 1);
        },
        ks, KS, stage[warp], table, acc, [](int) {});
    float g = 0.f, u = 0.f;  // lane j < GEMV_ROWS: row r0 + j's
#pragma unroll
    for (int j = 0; j < GEMV_ROWS; j++) {
        const float gj = warp_sum(acc[j]), uj = warp_sum(acc[GEMV_ROWS + j]);
        if (lane == j) {
            g = gj;
            u = uj;
        }
    }
    if (KS > 1) {
        if (lane < GEMV_ROWS) {
            partial[warp][lane] = g;
            partial[warp][GEMV_ROWS + lane] = u;
        }
        __syncthreads();
        if (ks == 0 && lane < GEMV_ROWS) {
            g = u = 0.f;
            for (int i = 0; i < KS; i++) {
                g += partial[warp + i][lane];
                u += partial[warp + i][GEMV_ROWS + lane];
            }
        }
    }
    if (limit > 0) {
        g = fminf(g, limit);
        u = fminf(fmaxf(u, -limit), limit);
    }
    if (ks == 0 && lane < GEMV_ROWS && r0 + lane < nrows)
        h[(long long)p * nrows + r0 + lane] = e >= 0 ? g / (1.0f + expf(-g)) * u : 0.f;
    if constexpr (WARPS * GEMV_ROWS == 32) {
        if (!act_out) return;
        __syncthreads();  // the block's rows of h are written and visible to its threads
        const int first = p * nrows + blockIdx.x * 32;
        if (warp == 0) write_group(h[first + lane], first, gridDim.y * nrows, act_out);
    }
}

// The routed experts' down projections of a token and their weighted sum, on int8 activations: out[t, r] =
// sum_j wts[t, j] · (W_{idx[t, j]} h[t, j])[r] for j < k <= GEMV_WARPS; a negative id adds a zero row, as in
// moe_gemv_i8. A block is k warps, warp j pair (t, j) over GEMV_ROWS rows; the warps' sums meet in shared memory and
// are weighed in pair order, as hc_collapse weighs moe_gemv_i8's rows (the same bits), so the pairs' rows and the
// launch that summed them are gone. h: T · k rows of ncols; act_in (not null): their I8Act, one pair after the
// other, as moe_gate_up_i8's act_out wrote it, read in place; else each block quantizes its token's k rows into
// dynamic shared memory (act_bytes(k · ncols)). grid (ceil(nrows / GEMV_ROWS), T). Bounded to 80 registers: the
// Q2_K kernel took 122 unbounded, which left a decode step's blocks of six warps two a multiprocessor instead of four.
template <class Q>
__global__ void __launch_bounds__(32 * GEMV_WARPS, 3) moe_down_sum_i8(
        const u8* __restrict__ w, long long expert_bytes, long long row_bytes, int nrows, int ncols,
        const int* __restrict__ idx, int k, const float* __restrict__ h, const float* __restrict__ wts,
        float* __restrict__ out, const u8* __restrict__ act_in) {
    using D = WarpDot<I8<Q>, GEMV_ROWS, 1>;
    __shared__ uint4 stage[GEMV_WARPS][D::SLOTS];
    __shared__ float sums[GEMV_WARPS][GEMV_ROWS];
    __shared__ __align__(16) u8 table[I8Table<Q>::BYTES];
    I8<Q>::fill(table);  // constant data: before the wait, beside the previous kernel's tail
    grid_wait();
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, t = blockIdx.y, e = idx[t * k + warp];
    const int r0 = blockIdx.x * GEMV_ROWS;
    float acc[GEMV_ROWS] = {};
    warp_dot_i8<Q, GEMV_ROWS, false>(
        [&](int, const u8* (&r)[GEMV_ROWS]) {
#pragma unroll
            for (int j = 0; j < GEMV_ROWS; j++)
                r[j] = w + (long long)max(e, 0) * expert_bytes + (long long)min(r0 + j, nrows - 1) * row_bytes;
            return warp * ncols;
        },
        e >= 0, ncols,
        [&] {
            return act_in ? global_activation(act_in, gridDim.y * k * ncols, t * k * ncols)
                          : block_activation(h + (long long)t * k * ncols, ncols, k);
        },
        0, 1, stage[warp], table, acc, [](int) {});
#pragma unroll
    for (int j = 0; j < GEMV_ROWS; j++) {
        const float s = warp_sum(acc[j]);
        if (lane == j) sums[warp][j] = s;
    }
    __syncthreads();
    if (threadIdx.x < GEMV_ROWS && r0 + (int)threadIdx.x < nrows) {
        float y = 0.f;
        for (int j = 0; j < k; ++j) y = fmaf(wts[t * k + j], sums[j][threadIdx.x], y);
        out[(long long)t * nrows + r0 + threadIdx.x] = y;
    }
}
