// A prefill's lightning-indexer scores and sparse attention on tensor cores: mma.sync m16n8k16 on fp16 operands
// (to16's bits, whose scales' inverses aq and ak ride on the results), fp32 accumulators. Compiled after
// moe_tile.cu (ldmatrix_x4, mma16816). Neither writes a per-head intermediate: the indexer's products of every head
// and the attention's gathered rows, which cuBLAS needed in memory (gigabytes at 16K tokens), stay on chip.

// Four 8x8 16-bit matrices from shared memory, each transposed; lane l gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const void* row) {
    u32 addr = (u32)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ float quad_sum(float v) {  // over the four lanes of one fragment row
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    return v + __shfl_xor_sync(0xffffffffu, v, 2);
}

__device__ __forceinline__ float quad_max(float v) {
    v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
    return fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
}

// Rows of 16-bit values into shared memory (row stride `stride` values) by all threads: row i of the `rows` is
// src + at(i) * n (n % 8 == 0), zeros where at(i) < 0.
template <class At>
__device__ __forceinline__ void load_rows16(u16* dst, int stride, const u16* __restrict__ src, int rows, int n, At at) {
    const int vecs = n / 8;
    for (int i = threadIdx.x; i < rows * vecs; i += blockDim.x) {
        const int r = i / vecs, v = i % vecs;
        const long long row = at(r);
        uint4 x = make_uint4(0u, 0u, 0u, 0u);
        if (row >= 0) x = reinterpret_cast<const uint4*>(src + row * n)[v];
        *reinterpret_cast<uint4*>(dst + r * stride + 8 * v) = x;
    }
}

constexpr int IDX_WARPS = 16, IDX_KEYS = 64, IDX_MAX_D = 128, IDX_ROW = IDX_MAX_D + 8;

// s[t, r] = scale · aq · ak · Σ_h w[t, h] · ReLU(q[t, h] · keys[r]) for fp16 q [T, H, D] and keys [R, D], H a
// multiple of 16 up to 16 · IDX_WARPS, D a multiple of 32 up to IDX_MAX_D. A block takes IDX_WARPS / (H / 16)
// tokens and a warp 16 heads of one, whose A fragments stay in registers while the keys pass through shared memory
// IDX_KEYS at a time (rows padded by 8 values: ldmatrix's eight rows then fall in distinct banks). A warp weighs the
// ReLU of its accumulators by its heads' weights and sums its 16 heads by shuffles; the block adds a token's warps.
extern "C" __global__ void __launch_bounds__(32 * IDX_WARPS) index_scores16(
        const u16* __restrict__ q, const u16* __restrict__ keys, const float* __restrict__ w, int T, int H, int R,
        int D, float scale, const float* __restrict__ aq, const float* __restrict__ ak, float* __restrict__ s) {
    __shared__ __align__(16) u16 tile[IDX_KEYS * IDX_ROW];
    __shared__ float part[IDX_WARPS][IDX_KEYS];
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const int mt = H / 16, per = IDX_WARPS / mt, tl = warp / mt, h0 = 16 * (warp % mt);
    const int t = blockIdx.x * per + tl;
    const bool live = tl < per && t < T;
    u32 a[IDX_MAX_D / 16][4];
    const u32* lo = reinterpret_cast<const u32*>(q + ((long long)(live ? t : 0) * H + h0 + g) * D) + c;
#pragma unroll
    for (int k = 0; k < IDX_MAX_D / 16; k++) {  // rows g and g + 8 (4D words on), columns 2c and 2c + 8 of step k
        const bool in = live && 16 * k < D;
        a[k][0] = in ? lo[8 * k] : 0u;
        a[k][1] = in ? lo[8 * k + 4 * D] : 0u;
        a[k][2] = in ? lo[8 * k + 4] : 0u;
        a[k][3] = in ? lo[8 * k + 4 * D + 4] : 0u;
    }
    const float w0 = live ? w[(long long)t * H + h0 + g] : 0.f, w8 = live ? w[(long long)t * H + h0 + g + 8] : 0.f;
    const float sc = scale * aq[0] * ak[0];
    for (int r0 = 0; r0 < R; r0 += IDX_KEYS) {
        __syncthreads();  // the previous tile's products and sums are read
        load_rows16(tile, IDX_ROW, keys, IDX_KEYS, D, [&](int r) { return r0 + r < R ? r0 + r : -1; });
        __syncthreads();
        if (tl < per) {
#pragma unroll
            for (int j = 0; j < IDX_KEYS / 8; j++) {
                float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
                for (int k = 0; k < IDX_MAX_D / 16; k += 2) {
                    if (16 * k < D) {  // B of steps k and k + 1: keys 8j .. 8j + 7, columns 16k .. 16k + 31
                        u32 b[4];
                        ldmatrix_x4(b, tile + (8 * j + (lane & 7)) * IDX_ROW + 16 * k + 8 * (lane >> 3));
                        mma16816<Half>(acc, a[k], b[0], b[1]);
                        mma16816<Half>(acc, a[k + 1], b[2], b[3]);
                    }
                }
                float p0 = w0 * fmaxf(acc[0], 0.f) + w8 * fmaxf(acc[2], 0.f);  // key 8j + 2c
                float p1 = w0 * fmaxf(acc[1], 0.f) + w8 * fmaxf(acc[3], 0.f);  // key 8j + 2c + 1
#pragma unroll
                for (int o = 4; o < 32; o <<= 1) {  // the 8 row pairs: 16 heads
                    p0 += __shfl_xor_sync(0xffffffffu, p0, o);
                    p1 += __shfl_xor_sync(0xffffffffu, p1, o);
                }
                if (g == 0) {
                    part[warp][8 * j + 2 * c] = p0;
                    part[warp][8 * j + 2 * c + 1] = p1;
                }
            }
        }
        __syncthreads();
        for (int i = threadIdx.x; i < per * IDX_KEYS; i += blockDim.x) {
            const int u = i / IDX_KEYS, r = i % IDX_KEYS, tt = blockIdx.x * per + u;
            if (tt < T && r0 + r < R) {
                float sum = 0.f;
                for (int m = 0; m < mt; m++) sum += part[u * mt + m][r];
                s[(long long)tt * R + r0 + r] = sum * sc;
            }
        }
    }
}

#define NEG_INF __int_as_float(0xff800000)  // NVRTC has no math.h, so no INFINITY
constexpr int ATT_WARPS = 16, ATT_ROWS = 64, ATT_MAX_H = 64, ATT_MAX_D = 512;
constexpr int ATT_QROW = ATT_MAX_D + 8, ATT_PROW = ATT_ROWS + 8;
// attend16's dynamic shared memory (prefill.py's _ATT_SHARED): the queries, two tiles of rows and a tile's
// probabilities, 16-bit rows of ATT_QROW, ATT_QROW and ATT_PROW values; then 8 floats a head and 2 ints a tile row.

// out[t, h] = Σ_j p[t, h, j] kv[idx[t, j]], p the softmax over j of scale · q[t, h] · kv[idx[t, j]] (rows idx < 0
// masked; with sinks, sinks[h] a logit in the denominator without a value), for fp16 q [T, H, d] and kv [N, d], H a
// multiple of 16 up to ATT_MAX_H, d of 256 up to ATT_MAX_D; idx [T, K]. A block per query: its heads' rows in
// shared memory, then its K rows ATT_ROWS at a time, the next tile's copied by cp.async while this one is
// multiplied, with flash attention's running maximum and sum (base 2): the scores of a tile by pairs of (16 heads,
// 16 rows) a warp, their probabilities in 16 bits, then each warp adds their product with the tile into its d / 16
// columns of the output, kept in registers to the end. With pos not null, the output's trailing 2 · half channels
// are turned back by pos[t] · inv_freq as rope_rows does (the same arithmetic, so the same bits): a fragment's two
// neighbouring columns are a pair.
extern "C" __global__ void __launch_bounds__(32 * ATT_WARPS) attend16(
        const u16* __restrict__ q, const u16* __restrict__ kv, const int* __restrict__ idx, int H, int K, int d,
        const float* __restrict__ sinks, float scale, const float* __restrict__ aq, const float* __restrict__ ak,
        const int* __restrict__ pos, const float* __restrict__ inv_freq, int half, float* __restrict__ out) {
    extern __shared__ __align__(16) u8 att_smem[];
    u16* qs = reinterpret_cast<u16*>(att_smem);
    u16* tiles = qs + ATT_MAX_H * ATT_QROW;
    u16* ps = tiles + 2 * ATT_ROWS * ATT_QROW;
    float* red = reinterpret_cast<float*>(ps + ATT_MAX_H * ATT_PROW);  // [4][ATT_MAX_H]: a tile's maxima, then sums
    float* run = red + 4 * ATT_MAX_H;  // per head: running maximum, sum, the last tile's correction, ak / sum
    int* ids = reinterpret_cast<int*>(run + 4 * ATT_MAX_H);  // [2][ATT_ROWS]: each tile's rows of kv, -1 masked
    const int warp = threadIdx.x / 32, lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
    const long long t = blockIdx.x;
    const int mt = H / 16, dw = d / ATT_WARPS, col0 = warp * dw;
    constexpr float LOG2E = 1.4426950408889634f;
    const float sc = scale * aq[0] * ak[0] * LOG2E;
    load_rows16(qs, ATT_QROW, q + t * H * d, H, d, [](int r) { return (long long)r; });
    if (threadIdx.x < H) {  // with a sink, it starts the sums: the maximum at its logit, the sum at 1
        run[threadIdx.x] = sinks ? sinks[threadIdx.x] * LOG2E : NEG_INF;
        run[ATT_MAX_H + threadIdx.x] = sinks ? 1.f : 0.f;
    }
    auto fetch = [&](int j0, int b) {  // tile j0's rows into buffer b by cp.async (masked rows zeroed), ids[b]
        u16* dst = tiles + b * ATT_ROWS * ATT_QROW;
        const int vecs = d / 8;
        for (int i = threadIdx.x; i < ATT_ROWS * vecs; i += blockDim.x) {
            const int r = i / vecs, v = i % vecs, j = j0 + r;
            const int row = j < K ? idx[t * K + j] : -1;
            u16* to = dst + r * ATT_QROW + 8 * v;
            if (row >= 0)
                cp_async<16>(to, kv + (long long)row * d + 8 * v);
            else
                *reinterpret_cast<uint4*>(to) = make_uint4(0u, 0u, 0u, 0u);
        }
        if (threadIdx.x < ATT_ROWS) {
            const int j = j0 + threadIdx.x;
            ids[b * ATT_ROWS + threadIdx.x] = j < K ? idx[t * K + j] : -1;
        }
        cp_async_commit();
    };
    float o[ATT_MAX_H / 16][ATT_MAX_D / ATT_WARPS / 8][4] = {};
    const int sm = warp / 4, sn = warp % 4;  // the scores' 16 heads and 16 rows of this warp
    fetch(0, 0);
    for (int j0 = 0, b = 0; j0 < K; j0 += ATT_ROWS, b ^= 1) {
        __syncthreads();  // the previous tile is read, so its buffer is free (and the queries and sums are in place)
        if (j0 + ATT_ROWS < K)
            fetch(j0 + ATT_ROWS, b ^ 1);
        else
            cp_async_commit();  // an empty group: the wait below still finds this tile's group second to last
        cp_async_wait<1>();
        __syncthreads();  // every thread's copies of this tile have landed
        const u16* vs = tiles + b * ATT_ROWS * ATT_QROW;
        const int* valid = ids + b * ATT_ROWS;
        float s[2][4] = {};
        const bool scoring = sm < mt;
        if (scoring) {
            for (int k = 0; k < d / 16; k++) {
                u32 a[4], b[4];
                ldmatrix_x4(a, qs + (16 * sm + (lane & 15)) * ATT_QROW + 16 * k + 8 * (lane >> 4));
                ldmatrix_x4(b, vs + (16 * sn + (lane & 7) + 8 * (lane >> 4)) * ATT_QROW + 16 * k + 8 * ((lane >> 3) & 1));
                mma16816<Half>(s[0], a, b[0], b[1]);
                mma16816<Half>(s[1], a, b[2], b[3]);
            }
#pragma unroll
            for (int n = 0; n < 2; n++)
#pragma unroll
                for (int i = 0; i < 4; i++)
                    s[n][i] = valid[16 * sn + 8 * n + 2 * c + (i & 1)] >= 0 ? s[n][i] * sc : NEG_INF;
            const float m0 = quad_max(fmaxf(fmaxf(s[0][0], s[0][1]), fmaxf(s[1][0], s[1][1])));
            const float m8 = quad_max(fmaxf(fmaxf(s[0][2], s[0][3]), fmaxf(s[1][2], s[1][3])));
            if (c == 0) {
                red[sn * ATT_MAX_H + 16 * sm + g] = m0;
                red[sn * ATT_MAX_H + 16 * sm + g + 8] = m8;
            }
        }
        __syncthreads();
        if (threadIdx.x < H) {
            const int h = threadIdx.x;
            float m = run[h];
            for (int i = 0; i < 4; i++) m = fmaxf(m, red[i * ATT_MAX_H + h]);
            run[2 * ATT_MAX_H + h] = m == NEG_INF ? 1.f : exp2f(run[h] - m);
            run[h] = m;
        }
        __syncthreads();
        if (scoring) {
            const int h = 16 * sm + g;
            const float m0 = run[h] == NEG_INF ? 0.f : run[h], m8 = run[h + 8] == NEG_INF ? 0.f : run[h + 8];
            float l0 = 0.f, l8 = 0.f;
#pragma unroll
            for (int n = 0; n < 2; n++) {
                const float p0 = exp2f(s[n][0] - m0), p1 = exp2f(s[n][1] - m0);
                const float p2 = exp2f(s[n][2] - m8), p3 = exp2f(s[n][3] - m8);
                l0 += p0 + p1;
                l8 += p2 + p3;
                const int col = 16 * sn + 8 * n + 2 * c;
                *reinterpret_cast<__half2*>(ps + h * ATT_PROW + col) = __floats2half2_rn(p0, p1);
                *reinterpret_cast<__half2*>(ps + (h + 8) * ATT_PROW + col) = __floats2half2_rn(p2, p3);
            }
            l0 = quad_sum(l0);
            l8 = quad_sum(l8);
            if (c == 0) {
                red[sn * ATT_MAX_H + h] = l0;
                red[sn * ATT_MAX_H + h + 8] = l8;
            }
        }
        __syncthreads();
        if (threadIdx.x < H) {
            const int h = threadIdx.x;
            run[ATT_MAX_H + h] = run[ATT_MAX_H + h] * run[2 * ATT_MAX_H + h] + red[h] + red[ATT_MAX_H + h] +
                                 red[2 * ATT_MAX_H + h] + red[3 * ATT_MAX_H + h];
        }
#pragma unroll
        for (int mi = 0; mi < ATT_MAX_H / 16; mi++) {
            if (mi < mt) {
                const float c0 = run[2 * ATT_MAX_H + 16 * mi + g], c8 = run[2 * ATT_MAX_H + 16 * mi + g + 8];
#pragma unroll
                for (int n = 0; n < ATT_MAX_D / ATT_WARPS / 8; n++) {
                    o[mi][n][0] *= c0;
                    o[mi][n][1] *= c0;
                    o[mi][n][2] *= c8;
                    o[mi][n][3] *= c8;
                }
            }
        }
#pragma unroll
        for (int k = 0; k < ATT_ROWS / 16; k++) {
#pragma unroll
            for (int n2 = 0; n2 < ATT_MAX_D / ATT_WARPS / 16; n2++) {
                if (16 * n2 < dw) {  // B of column tiles 2n2 and 2n2 + 1: rows 16k .. 16k + 15 of the tile
                    u32 b[4];
                    ldmatrix_x4_trans(b, vs + (16 * k + (lane & 7) + 8 * ((lane >> 3) & 1)) * ATT_QROW + col0 +
                                                 16 * n2 + 8 * (lane >> 4));
#pragma unroll
                    for (int mi = 0; mi < ATT_MAX_H / 16; mi++) {
                        if (mi < mt) {
                            u32 a[4];
                            ldmatrix_x4(a, ps + (16 * mi + (lane & 15)) * ATT_PROW + 16 * k + 8 * (lane >> 4));
                            mma16816<Half>(o[mi][2 * n2], a, b[0], b[1]);
                            mma16816<Half>(o[mi][2 * n2 + 1], a, b[2], b[3]);
                        }
                    }
                }
            }
        }
    }
    __syncthreads();  // the last tile's sums are in place
    if (threadIdx.x < H) run[3 * ATT_MAX_H + threadIdx.x] = ak[0] / run[ATT_MAX_H + threadIdx.x];
    __syncthreads();
#pragma unroll
    for (int mi = 0; mi < ATT_MAX_H / 16; mi++) {
        if (mi < mt) {
            const int h = 16 * mi + g;
            const float i0 = run[3 * ATT_MAX_H + h], i8 = run[3 * ATT_MAX_H + h + 8];
#pragma unroll
            for (int n = 0; n < ATT_MAX_D / ATT_WARPS / 8; n++) {
                if (8 * n < dw) {
                    const int col = col0 + 8 * n + 2 * c, j = col - (d - 2 * half);
                    float2 y0 = make_float2(o[mi][n][0] * i0, o[mi][n][1] * i0);
                    float2 y8 = make_float2(o[mi][n][2] * i8, o[mi][n][3] * i8);
                    if (pos && j >= 0) {
                        float sn, co;
                        sincosf((float)pos[t] * inv_freq[j >> 1], &sn, &co);
                        sn = -sn;
                        y0 = make_float2(y0.x * co - y0.y * sn, y0.x * sn + y0.y * co);
                        y8 = make_float2(y8.x * co - y8.y * sn, y8.x * sn + y8.y * co);
                    }
                    const long long at = (t * H + h) * d + col;
                    *reinterpret_cast<float2*>(out + at) = y0;
                    *reinterpret_cast<float2*>(out + at + 8 * d) = y8;
                }
            }
        }
    }
}
