// Integer decode path: compiled after quant.cu in one NVRTC module (it uses that file's format structs,
// WarpDot staging and helpers).
//
// Activations are quantized once per launch into blocks of 32 int8 values q with a float scale d = max|x| / 127
// (x ~ q d, |x - q d| <= d / 2) and the float sums of each 16-element half of the block (for formats with a min
// term). A lane then dots one 32-element group of a weight row with __dp4a (four int8 products per instruction,
// exact integer sums) and applies the weight and activation scales once per group: for the 2-bit formats about
// 1.5-2 instructions per weight instead of 5 on the float path.

// q[t, c], d[t, c / 32], sums[t, c / 16] of x[t * x_stride + c] for c < span (a multiple of 32), t < ntok.
// One warp per block of 32; the reductions run in a fixed order (deterministic, graph replay bit-equal).
extern "C" __global__ void quantize_q8_1(const float* __restrict__ x, long long x_stride, int span, int ntok,
                                         signed char* __restrict__ q, float* __restrict__ d,
                                         float* __restrict__ sums) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)ntok * span) return;  // whole warps: ntok * span is a multiple of 32
    long long t = i / span;
    float v = x[t * x_stride + (i - t * span)];
    float amax = fabsf(v);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
    float inv = amax > 0.f ? 127.0f / amax : 0.f;
    q[i] = (signed char)__float2int_rn(v * inv);
    float s = v;
#pragma unroll
    for (int off = 8; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    int lane = threadIdx.x & 31;
    if ((lane & 15) == 0) sums[i / 16] = s;
    if (lane == 0) d[i / 32] = amax / 127.0f;
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
// (l < 16) and 2g + 1 (l >= 16), low nibble scale, high nibble min.
template <>
struct I8<Q2_K> : Q2_K {
    static constexpr int CHUNK = 4, TABLE = 0;
    static __device__ __forceinline__ void fill(u8*) {}
    static __device__ __forceinline__ float dot(const u8* b, int g, const int (&q)[8], float dx, float s0,
                                                float s1, const u8*) {
        const u32* qs = reinterpret_cast<const u32*>(b + 16 + 32 * (g >> 2));
        int shift = 2 * (g & 3);
        int lo = 0, hi = 0;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            lo = __dp4a((int)((qs[i] >> shift) & 0x03030303u), q[i], lo);
            hi = __dp4a((int)((qs[4 + i] >> shift) & 0x03030303u), q[4 + i], hi);
        }
        u32 sc = u16_at(b + 2 * g);
        u32 dd = u32_at(b + 80);
        float d = __half2float(__ushort_as_half((u16)(dd & 0xFFFF)));
        float dmin = __half2float(__ushort_as_half((u16)(dd >> 16)));
        int isum = (int)(sc & 0xF) * lo + (int)((sc >> 8) & 0xF) * hi;
        return d * dx * (float)isum - dmin * ((float)((sc >> 4) & 0xF) * s0 + (float)(sc >> 12) * s1);
    }
};

// Group g: 4 grid indices (bytes) and aux (four 7-bit sign indices, 4-bit scale) at b + 2 + 8g. Table: the grid
// (256 x 8 magnitudes) then 128 sign masks (byte i = 0xFF when element i is negative; the eighth sign is the
// parity of the seven stored). With mask s, dp4a(m ^ s, q) - dp4a(s, q) is the signed dot: m ^ 0xFF reads as
// -m - 1 and dp4a(s, q) is minus the sum of the negated activations.
template <>
struct I8<IQ2_XXS> : IQ2_XXS {
    static constexpr int CHUNK = 4, TABLE = 256 * 8 + 128 * 8;
    static __device__ __forceinline__ void fill(u8* table) {  // by all threads of the block
        for (int i = threadIdx.x; i < 256 * 8 / 16; i += blockDim.x)
            reinterpret_cast<uint4*>(table)[i] = reinterpret_cast<const uint4*>(iq2xxs_grid)[i];
        for (int i = threadIdx.x; i < 128; i += blockDim.x) {
            u32 bits = (u32)i | ((__popc(i) & 1) << 7);
            u32 lo = 0, hi = 0;
#pragma unroll
            for (int k = 0; k < 4; k++) {
                lo |= ((bits >> k) & 1) * (0xFFu << (8 * k));
                hi |= ((bits >> (4 + k)) & 1) * (0xFFu << (8 * k));
            }
            reinterpret_cast<uint2*>(table + 256 * 8)[i] = make_uint2(lo, hi);
        }
    }
    static __device__ __forceinline__ float dot(const u8* b, int g, const int (&q)[8], float dx, float, float,
                                                const u8* table) {
        const u8* p = b + 2 + 8 * g;
        u32 grid_idx = u32_at2(p), aux = u32_at2(p + 4);
        const uint2* grid = reinterpret_cast<const uint2*>(table);
        const uint2* sign = grid + 256;
        int pos = 0, neg = 0;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            uint2 m = grid[(grid_idx >> (8 * k)) & 0xFF];
            uint2 s = sign[(aux >> (7 * k)) & 127];
            pos = __dp4a((int)(m.x ^ s.x), q[2 * k], pos);
            pos = __dp4a((int)(m.y ^ s.y), q[2 * k + 1], pos);
            neg = __dp4a((int)s.x, q[2 * k], neg);
            neg = __dp4a((int)s.y, q[2 * k + 1], neg);
        }
        // value = d (0.5 + scale) / 4 * magnitude * sign = d (2 scale + 1) / 8 * ...
        return half_at2(b) * dx * 0.125f * (float)((pos - neg) * (int)(2 * (aux >> 28) + 1));
    }
};

// Shared lookup tables of a kernel (at least one word, so that formats without tables still declare one).
template <class Q>
struct I8Table {
    static constexpr int BYTES = I8<Q>::TABLE > 0 ? I8<Q>::TABLE : 16;
};

// One warp's dot products of R weight rows with one int8 activation (q, d and half sums of the row's columns):
// the chunks ks, ks + KS, ... are staged like WarpDot (16-byte loads into registers, the next chunk in flight
// while this one is read from shared memory); lane u takes the u-th 32-element group of the chunk.
template <class Q, int R>
__device__ __forceinline__ void warp_dot_i8(const u8* const (&row)[R], int ncols, const signed char* __restrict__ xq,
                                            const float* __restrict__ xd, const float2* __restrict__ xs, int ks,
                                            int KS, uint4* stage, const u8* table, float (&acc)[R]) {
    using F = I8<Q>;
    using D = WarpDot<F, R, 1>;
    constexpr int GROUPS = Q::QK / 32;
    int lane = threadIdx.x & 31;
    int nblocks = ncols / Q::QK;
    int nchunks = (nblocks + F::CHUNK - 1) / F::CHUNK;
    uint4 buf[D::LOADS];
    if (ks < nchunks) D::fetch(row, ks, nblocks, lane, buf);
    for (int c = ks; c < nchunks; c += KS) {
        __syncwarp();
#pragma unroll
        for (int i = 0; i < D::LOADS; i++) {
            int slot = lane + 32 * i;
            if (slot < D::SLOTS) stage[slot] = buf[i];
        }
        __syncwarp();
        if (c + KS < nchunks) D::fetch(row, c + KS, nblocks, lane, buf);
        int b0 = c * F::CHUNK;
        int nb = min(F::CHUNK, nblocks - b0);
        int skew[R];
#pragma unroll
        for (int j = 0; j < R; j++) skew[j] = (int)(reinterpret_cast<u64>(row[j] + (long long)b0 * Q::BYTES) & 15);
        const u8* base = reinterpret_cast<const u8*>(stage);
        for (int u = lane; u < nb * GROUPS; u += 32) {
            int blk = u / GROUPS, g = u % GROUPS;
            int grp = b0 * GROUPS + u;  // group index along the row
            const int4* xv = reinterpret_cast<const int4*>(xq + 32LL * grp);
            int4 qa = __ldg(xv), qb = __ldg(xv + 1);
            const int q[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
            float dx = __ldg(xd + grp);
            float2 s = __ldg(xs + grp);
#pragma unroll
            for (int j = 0; j < R; j++)
                acc[j] += F::dot(base + j * D::SEGS * 16 + skew[j] + blk * Q::BYTES, g, q, dx, s.x, s.y, table);
        }
    }
}

// y[r] = sum_c W[r, c] x[g(r), c] for one token, x[g] the int8 activation (xq, xd, xs) of columns g * ncols ..,
// g(r) = r / group_rows; blocks laid out like gemv (GEMV_WARPS / KS row groups, each split over KS warps).
template <class Q>
__global__ void __launch_bounds__(32 * GEMV_WARPS) gemv_i8(
        const u8* __restrict__ w, long long row_bytes, int nrows, int ncols, const signed char* __restrict__ xq,
        const float* __restrict__ xd, const float2* __restrict__ xs, int group_rows, float* __restrict__ y, int KS) {
    using D = WarpDot<I8<Q>, GEMV_ROWS, 1>;
    __shared__ uint4 stage[GEMV_WARPS][D::SLOTS];
    __shared__ float partial[GEMV_WARPS][GEMV_ROWS];
    __shared__ __align__(16) u8 table[I8Table<Q>::BYTES];
    I8<Q>::fill(table);
    __syncthreads();
    int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    int groups = GEMV_WARPS / KS, rg = warp / KS, ks = warp % KS;
    int r0 = (blockIdx.x * groups + rg) * GEMV_ROWS;
    const u8* row[GEMV_ROWS];
#pragma unroll
    for (int j = 0; j < GEMV_ROWS; j++) row[j] = w + (long long)min(r0 + j, nrows - 1) * row_bytes;
    float acc[GEMV_ROWS] = {};
    long long col = (long long)(min(r0, nrows - 1) / group_rows) * ncols;
    warp_dot_i8<Q, GEMV_ROWS>(row, ncols, xq + col, xd + col / 32, xs + col / 32, ks, KS, stage[warp], table, acc);
#pragma unroll
    for (int j = 0; j < GEMV_ROWS; j++) {
        float s = warp_sum(acc[j]);
        if (lane == 0) partial[warp][j] = s;
    }
    __syncthreads();
    if (ks == 0 && lane < GEMV_ROWS) {
        float s = 0.f;
        for (int i = 0; i < KS; i++) s += partial[warp + i][lane];
        if (r0 + lane < nrows) y[r0 + lane] = s;
    }
}

// Routed-expert GEMV on int8 activations: y[p, r] = sum_c W_{idx[p]}[r, c] x[p / x_div, c]; a negative id
// gives zeros. grid = (row blocks, P), GEMV_WARPS row groups of GEMV_ROWS rows.
template <class Q>
__global__ void __launch_bounds__(32 * GEMV_WARPS) moe_gemv_i8(
        const u8* __restrict__ w, long long expert_bytes, long long row_bytes, int nrows, int ncols,
        const int* __restrict__ idx, const signed char* __restrict__ xq, const float* __restrict__ xd,
        const float2* __restrict__ xs, int x_div, float* __restrict__ y) {
    using D = WarpDot<I8<Q>, GEMV_ROWS, 1>;
    __shared__ uint4 stage[GEMV_WARPS][D::SLOTS];
    __shared__ __align__(16) u8 table[I8Table<Q>::BYTES];
    I8<Q>::fill(table);
    __syncthreads();
    int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    int p = blockIdx.y, e = idx[p];
    int r0 = (blockIdx.x * GEMV_WARPS + warp) * GEMV_ROWS;
    if (r0 >= nrows) return;
    float acc[GEMV_ROWS] = {};
    if (e >= 0) {
        const u8* row[GEMV_ROWS];
#pragma unroll
        for (int j = 0; j < GEMV_ROWS; j++)
            row[j] = w + (long long)e * expert_bytes + (long long)min(r0 + j, nrows - 1) * row_bytes;
        long long col = (long long)(p / x_div) * ncols;
        warp_dot_i8<Q, GEMV_ROWS>(row, ncols, xq + col, xd + col / 32, xs + col / 32, 0, 1, stage[warp], table,
                                  acc);
    }
#pragma unroll
    for (int j = 0; j < GEMV_ROWS; j++) {
        float s = warp_sum(acc[j]);
        if (lane == 0 && r0 + j < nrows) y[(long long)p * nrows + r0 + j] = s;
    }
}

// Fused routed gate/up/SwiGLU on int8 activations (as moe_gate_up): each warp reads GEMV_ROWS gate rows and the
// same up rows of expert idx[p] against x[p / x_div]; a negative id gives zeros.
template <class Q>
__global__ void __launch_bounds__(32 * GEMV_WARPS / 2) moe_gate_up_i8(
        const u8* __restrict__ wg, const u8* __restrict__ wu, long long expert_bytes, long long row_bytes,
        int nrows, int ncols, const int* __restrict__ idx, const signed char* __restrict__ xq,
        const float* __restrict__ xd, const float2* __restrict__ xs, int x_div, float limit, float* __restrict__ h) {
    constexpr int WARPS = GEMV_WARPS / 2;
    using D = WarpDot<I8<Q>, 2 * GEMV_ROWS, 1>;
    __shared__ uint4 stage[WARPS][D::SLOTS];
    __shared__ __align__(16) u8 table[I8Table<Q>::BYTES];
    I8<Q>::fill(table);
    __syncthreads();
    int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
    int p = blockIdx.y, e = idx[p];
    int r0 = (blockIdx.x * WARPS + warp) * GEMV_ROWS;
    if (r0 >= nrows) return;
    float acc[2 * GEMV_ROWS] = {};
    if (e >= 0) {
        const u8* row[2 * GEMV_ROWS];
#pragma unroll
        for (int j = 0; j < GEMV_ROWS; j++) {
            long long off = (long long)e * expert_bytes + (long long)min(r0 + j, nrows - 1) * row_bytes;
            row[j] = wg + off;
            row[GEMV_ROWS + j] = wu + off;
        }
        long long col = (long long)(p / x_div) * ncols;
        warp_dot_i8<Q, 2 * GEMV_ROWS>(row, ncols, xq + col, xd + col / 32, xs + col / 32, 0, 1, stage[warp], table,
                                      acc);
    }
#pragma unroll
    for (int j = 0; j < GEMV_ROWS; j++) {
        float g = warp_sum(acc[j]), u = warp_sum(acc[GEMV_ROWS + j]);
        if (limit > 0) {
            g = fminf(g, limit);
            u = fminf(fmaxf(u, -limit), limit);
        }
        if (lane == 0 && r0 + j < nrows) h[(long long)p * nrows + r0 + j] = e >= 0 ? g / (1.0f + expf(-g)) * u : 0.f;
    }
}
