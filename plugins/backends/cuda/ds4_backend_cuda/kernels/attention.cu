// Sparse multi-query attention of a few query tokens in two launches, split over the rows as flash-decoding does:
// attend_rows takes ATTEND_ROWS listed rows of one query for ATTEND_HEADS heads (scores, the softmax numerator
// against the tile's own peak, the unnormalised weighted sum), and attend_merge rescales the tiles to the common
// peak, adds the sink and divides. Each block reads its rows once for all its heads, and K / ATTEND_ROWS ×
// H / ATTEND_HEADS blocks fill the GPU at the few hundred rows a decode step lists. (A block per 32 channels that
// walked every row in turn, after a launch of scores that read each row once per head, took 29 µs for a Flash CSA
// layer's 640 rows.)
//
// q [T, H, d], kv [N, d] (keys = values), idx [T, K] rows per query (-1 = none), sinks [H] or null -> out [T, H, d].

#include <cuda_fp16.h>

#define NEG_INF __int_as_float(0xff800000)  // NVRTC has no math.h, so no INFINITY
#define ATTEND_HEADS 4                      // heads of a block: one warp each in the softmax (4 rather than 8:
                                           // twice the blocks over a decode step's few hundred rows)
#define ATTEND_ROWS 32                      // rows of a block: ROWS_PER_WARP per warp in the scores
#define ROWS_PER_WARP (ATTEND_ROWS / ATTEND_HEADS)
#define MIX_STEP 8                          // rows of a step of the weighted sum
static_assert(ROWS_PER_WARP * ATTEND_HEADS == 32, "the scores' transposed sum gives each lane one (row, head)");

// v[i] summed over the warp, returned to lane i: five butterfly rounds that halve the values each lane carries
// (31 shuffles where 32 separate sums take 160).
template <int O>
__device__ __forceinline__ void transposed_round(float (&v)[32]) {
    const bool upper = threadIdx.x & O;
#pragma unroll
    for (int i = 0; i < O; ++i) {
        const float send = upper ? v[i] : v[i + O];
        v[i] = (upper ? v[i + O] : v[i]) + __shfl_xor_sync(0xffffffffu, send, O);
    }
}

__device__ __forceinline__ float warp_transposed_sum(float (&v)[32]) {
    transposed_round<16>(v);
    transposed_round<8>(v);
    transposed_round<4>(v);
    transposed_round<2>(v);
    transposed_round<1>(v);
    return v[0];
}

__device__ __forceinline__ float dot4(float4 a, float4 b, float s) {
    return fmaf(a.x, b.x, fmaf(a.y, b.y, fmaf(a.z, b.z, fmaf(a.w, b.w, s))));
}

// One query head of d channels (d / 4 float4s in shared memory) RMSNormed and its trailing 2·half channels rotated
// by rot[i] = (cos, sin) of pair i, in place, by one warp.
__device__ void norm_rope_head(float4* h, int d, float eps, const float2* rot, int half) {
    const int lane = threadIdx.x & 31, d4 = d / 4, first = d - 2 * half;
    float ss = 0.f;
    for (int c = lane; c < d4; c += 32) ss = dot4(h[c], h[c], ss);
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float inv = 1.f / sqrtf(ss / (float)d + eps);
    for (int c = lane; c < d4; c += 32) {
        const float4 v = h[c];
        float x[4] = {v.x * inv, v.y * inv, v.z * inv, v.w * inv};
#pragma unroll
        for (int k = 0; k < 4; k += 2) {  // pairs (4c + k, 4c + k + 1); first is even, so pairs do not straddle it
            const int j = 4 * c + k - first;
            if (j >= 0) {
                const float2 r = rot[j >> 1];
                const float a = x[k], b = x[k + 1];
                x[k] = a * r.x - b * r.y;
                x[k + 1] = a * r.y + b * r.x;
            }
        }
        h[c] = make_float4(x[0], x[1], x[2], x[3]);
    }
}

// Tile blockIdx.x of query t = blockIdx.z for heads h0 = blockIdx.y · ATTEND_HEADS ..: with l_j = (q_h . kv[r_j]) ·
// scale over its rows (-inf where r_j < 0), stats[t, h, tile] = (peak = max_j l_j, sum_j exp(l_j - peak)) and
// part[t, h, tile] = sum_j exp(l_j - peak) · kv[r_j] (zero for a tile of masked rows). d a multiple of 4;
// 32 · ATTEND_HEADS threads, dynamic shared memory ATTEND_HEADS · d floats. So few blocks run that each is a chain
// of memory round trips: every phase issues all of its loads before it uses one (q, then a warp's rows, then a
// thread's column pairs of all the tile's rows). With pos not null, each head of q is first RMSNormed (no weight,
// eps q_eps) and its trailing 2·half channels rotated by pos[t] · inv_freq, as rms_norm_rows does with pos (the
// sum of squares in another order, times the root's reciprocal): the queries' norm_rope costs no launch of its
// own. The block's first half threads (half <= its threads) make the rotations, after the queries in dynamic shared
// memory, while q loads.
extern "C" __global__ void __launch_bounds__(32 * ATTEND_HEADS) attend_rows(
        const float* __restrict__ q, const float* __restrict__ kv, const int* __restrict__ idx, int H, int K, int d,
        float scale, float* __restrict__ part, float2* __restrict__ stats, const int* __restrict__ pos,
        const float* __restrict__ inv_freq, int half, float q_eps) {
    grid_wait();
    extern __shared__ float4 q_heads[];  // [ATTEND_HEADS][d / 4], then (pos) rot [half] float2
    __shared__ __align__(16) float p[ATTEND_ROWS][ATTEND_HEADS];
    __shared__ int rows[ATTEND_ROWS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, d4 = d / 4;
    const int t = blockIdx.z, h0 = blockIdx.y * ATTEND_HEADS, j0 = blockIdx.x * ATTEND_ROWS, tiles = gridDim.x;
    const int heads = min(ATTEND_HEADS, H - h0);
    const float4* qt = reinterpret_cast<const float4*>(q + ((size_t)t * H + h0) * d);
#pragma unroll 4
    for (int e = threadIdx.x; e < ATTEND_HEADS * d4; e += blockDim.x)
        q_heads[e] = e < heads * d4 ? qt[e] : make_float4(0.f, 0.f, 0.f, 0.f);
    if (threadIdx.x < ATTEND_ROWS) {
        const int j = j0 + threadIdx.x;
        rows[threadIdx.x] = j < K ? idx[(size_t)t * K + j] : -1;
    }
    float2* rot = reinterpret_cast<float2*>(q_heads + ATTEND_HEADS * d4);
    if (pos && (int)threadIdx.x < half) {
        float s, co;
        sincosf((float)pos[t] * inv_freq[threadIdx.x], &s, &co);
        rot[threadIdx.x] = make_float2(co, s);
    }
    __syncthreads();
    if (pos) {
        if (warp < heads) norm_rope_head(q_heads + warp * d4, d, q_eps, rot, half);
        __syncthreads();
    }

    const float4* row[ROWS_PER_WARP];  // warp w scores rows w, w + 8, ..; row 0 stands in for masked rows
#pragma unroll
    for (int i = 0; i < ROWS_PER_WARP; ++i)
        row[i] = reinterpret_cast<const float4*>(kv + (size_t)max(rows[warp + ATTEND_HEADS * i], 0) * d);
    float s[32] = {};  // s[i · ATTEND_HEADS + hh]: this lane's columns of row i . head hh
#pragma unroll 4
    for (int c = lane; c < d4; c += 32) {
        float4 k[ROWS_PER_WARP];
#pragma unroll
        for (int i = 0; i < ROWS_PER_WARP; ++i) k[i] = row[i][c];
#pragma unroll
        for (int hh = 0; hh < ATTEND_HEADS; ++hh) {
            const float4 qv = q_heads[hh * d4 + c];
#pragma unroll
            for (int i = 0; i < ROWS_PER_WARP; ++i) s[i * ATTEND_HEADS + hh] = dot4(qv, k[i], s[i * ATTEND_HEADS + hh]);
        }
    }
    {
        const float dot = warp_transposed_sum(s);
        const int j = warp + ATTEND_HEADS * (lane / ATTEND_HEADS), hh = lane % ATTEND_HEADS;
        p[j][hh] = rows[j] >= 0 ? dot * scale : NEG_INF;
    }
    __syncthreads();
    {  // warp w: head w's numerators over the tile, lane = row
        const float l = p[lane][warp];
        float peak = l;
        for (int o = 16; o > 0; o >>= 1) peak = fmaxf(peak, __shfl_xor_sync(0xffffffffu, peak, o));
        const float e = peak == NEG_INF ? 0.f : expf(l - peak);
        float sum = e;
        for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        p[lane][warp] = e;
        if (lane == 0 && warp < heads) stats[((size_t)t * H + h0 + warp) * tiles + blockIdx.x] = make_float2(peak, sum);
    }
    __syncthreads();
    // Column pairs, rows in steps of MIX_STEP with the next step's loads in flight (a masked row's weight is 0).
    const float2* kv2 = reinterpret_cast<const float2*>(kv);
    for (int c = threadIdx.x; c < d / 2; c += blockDim.x) {
        float2 acc[ATTEND_HEADS] = {}, v[MIX_STEP], next[MIX_STEP];
#pragma unroll
        for (int j = 0; j < MIX_STEP; ++j) next[j] = kv2[max(rows[j], 0) * (d / 2) + c];
#pragma unroll 1
        for (int j0 = 0; j0 < ATTEND_ROWS; j0 += MIX_STEP) {
#pragma unroll
            for (int j = 0; j < MIX_STEP; ++j) v[j] = next[j];
            if (j0 + MIX_STEP < ATTEND_ROWS)
#pragma unroll
                for (int j = 0; j < MIX_STEP; ++j) next[j] = kv2[max(rows[j0 + MIX_STEP + j], 0) * (d / 2) + c];
#pragma unroll
            for (int j = 0; j < MIX_STEP; ++j) {
#pragma unroll
                for (int hh = 0; hh < ATTEND_HEADS; ++hh) {
                    acc[hh].x = fmaf(p[j0 + j][hh], v[j].x, acc[hh].x);
                    acc[hh].y = fmaf(p[j0 + j][hh], v[j].y, acc[hh].y);
                }
            }
        }
        float2* out = reinterpret_cast<float2*>(part + (((size_t)t * H + h0) * tiles + blockIdx.x) * d) + c;
#pragma unroll
        for (int hh = 0; hh < ATTEND_HEADS; ++hh)
            if (hh < heads) out[(size_t)hh * tiles * (d / 2)] = acc[hh];
    }
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024) by combine; every thread returns it.
template <class Combine>
__device__ __forceinline__ float block_reduce(float v, float* scratch, Combine combine) {
    for (int o = 16; o > 0; o >>= 1) v = combine(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    __syncthreads();  // scratch is free
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = scratch[0];
    for (int w = 1; w < warps; ++w) v = combine(v, scratch[w]);
    return v;
}

// out[t, h, c] = sum over tiles of exp(peak - P) · part[t, h, tile, c] / (sum of exp(peak - P) · sum, plus
// exp(sink_h - P)), with P the largest peak or sink (0 for a fully masked row without a sink, whose output is then
// 0 / 0 as in the array form). The block's threads first share out the tiles' weights (one round trip for the
// statistics instead of one per tile). With pos not null, the output's trailing 2·half channels are then rotated
// back by pos[t] · inv_freq as rope_rows does with inverse set (a pair's channels are neighbouring lanes). With act
// not null (d a multiple of 32), each token's output row of H · d values is also written there as the int8
// activation of the GEMV that reads it (act.cuh; tokens act_bytes(H · d) apart). grid (ceil(d / blockDim.x), H, T),
// blockDim.x a multiple of 32, dynamic shared memory tiles floats.
#define MERGE_AHEAD 20  // tiles of attend_merge loaded before the statistics' reductions: all of a Flash CSA layer's
extern "C" __global__ void attend_merge(const float* __restrict__ part, const float2* __restrict__ stats,
                                        const float* __restrict__ sinks, int H, int tiles, int d,
                                        float* __restrict__ out, const int* __restrict__ pos,
                                        const float* __restrict__ inv_freq, int half, unsigned char* __restrict__ act) {
    grid_wait();
    extern __shared__ float weight[];
    __shared__ float scratch[32];
    const int c = blockIdx.x * blockDim.x + threadIdx.x, h = blockIdx.y;
    const size_t th = (size_t)blockIdx.z * H + h;
    const float2* st = stats + th * tiles;
    const float* pt = part + th * tiles * d + c;
    float early[MERGE_AHEAD];  // the first tiles' sums need no statistics: loaded beside them, not after two reductions
#pragma unroll
    for (int i = 0; i < MERGE_AHEAD; ++i) early[i] = c < d && i < tiles ? pt[(size_t)i * d] : 0.f;
    float peak = sinks ? sinks[h] : NEG_INF;
    for (int i = threadIdx.x; i < tiles; i += blockDim.x) peak = fmaxf(peak, st[i].x);
    peak = block_reduce(peak, scratch, [](float a, float b) { return fmaxf(a, b); });
    if (peak == NEG_INF) peak = 0.f;
    float den = 0.f;
    for (int i = threadIdx.x; i < tiles; i += blockDim.x) {
        const float w = st[i].x == NEG_INF ? 0.f : expf(st[i].x - peak);
        weight[i] = w;
        den = fmaf(w, st[i].y, den);
    }
    den = block_reduce(den, scratch, [](float a, float b) { return a + b; }) + (sinks ? expf(sinks[h] - peak) : 0.f);
    float num = 0.f;
#pragma unroll
    for (int i = 0; i < MERGE_AHEAD; ++i)
        if (i < tiles) num = fmaf(weight[i], early[i], num);
    if (c < d) {
#pragma unroll 8
        for (int i = MERGE_AHEAD; i < tiles; ++i) num = fmaf(weight[i], pt[(size_t)i * d], num);
    }
    float o = num / den;
    const int j = c - (d - 2 * half);
    const float partner = __shfl_xor_sync(0xffffffffu, o, 1);  // every lane, before any leaves
    if (c >= d) return;  // whole warps when d is a multiple of 32
    if (pos && j >= 0) {
        float s, co;
        sincosf((float)pos[blockIdx.z] * inv_freq[j >> 1], &s, &co);
        s = -s;
        const float a = (j & 1) ? partner : o, b = (j & 1) ? o : partner;
        o = (j & 1) ? a * s + b * co : a * co - b * s;
    }
    out[th * d + c] = o;
    if (act) {
        const int n = H * d;
        write_group(o, h * d + (c & ~31), n, act + (size_t)blockIdx.z * (n + n / 4 + n / 8));
    }
}

// Softmax statistics of a row l [K] in one warp, given each lane's maximum over its elements: the peak (the row's
// maximum or the sink if larger; 0 for a fully masked row without a sink, so exp gives 0 and no NaN) and the sum of
// exp(l - peak) with the sink's term. Every lane returns both.
__device__ __forceinline__ void warp_softmax_stats(const float* __restrict__ l, int K, const float* __restrict__ sinks,
                                                   int h, float peak, float& peak_out, float& sum_out) {
    const int lane = threadIdx.x & 31;
    for (int o = 16; o > 0; o >>= 1) peak = fmaxf(peak, __shfl_xor_sync(0xffffffffu, peak, o));
    if (sinks) peak = fmaxf(peak, sinks[h]);
    else if (peak == NEG_INF) peak = 0.f;
    float sum = 0.f;
    for (int j = lane; j < K; j += 32) sum += expf(l[j] - peak);
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (sinks) sum += expf(sinks[h] - peak);
    peak_out = peak;
    sum_out = sum;
}

// Prefill's softmax between its two batched products: p[t, h, j] = softmax_j(dots[t, h, j] · scale, or -inf where
// idx[t, j] < 0) with the sink in the denominator, in place over dots [T, H, K]. One warp per (t, h) row,
// rows = T * H.
extern "C" __global__ void attend_softmax(float* __restrict__ dots, const int* __restrict__ idx,
                                          const float* __restrict__ sinks, int H, int K, long long rows,
                                          float scale) {
    grid_wait();
    const long long r = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= rows) return;  // whole warps leave together
    const int lane = threadIdx.x & 31, h = (int)(r % H);
    float* l = dots + r * K;
    const int* rows_of = idx + (r / H) * K;
    float peak = NEG_INF, sum;
    for (int j = lane; j < K; j += 32) {
        float v = rows_of[j] >= 0 ? l[j] * scale : NEG_INF;
        l[j] = v;
        peak = fmaxf(peak, v);
    }
    warp_softmax_stats(l, K, sinks, h, peak, peak, sum);
    for (int j = lane; j < K; j += 32) l[j] = expf(l[j] - peak) / sum;
}

// The prefill's window attention weights, in place (or, with p16 non-null, as fp16 into p16 of p's shape: the
// second product's operand), between norm_rope_window_attention's (ops.py) two products: p [rows, ldp]
// holds, for row (b, i, h) = (b · B + i) · H + h, query t = t0 + b · B + i's head h scores over the L >= B + W - 1
// rows of its block's band (columns 0 .. L - 1: padded window rows s0 + t0 + b · B + c) and the C compressed rows
// (columns L ..). Column c < L is the query's when i <= c < i + W and its padded row is not padding (>= pad);
// column L + w when w < limit[t] (limit null: C = 0). Each is scaled, then softmax-ed with the sink in the
// denominator; every other column becomes 0, so the second product reads the band whole. One warp per row.
extern "C" __global__ void window_softmax(float* __restrict__ p, int ldp, int B, int L, int H, int W, int C, int t0,
                                          int s0, int pad, const int* __restrict__ limit,
                                          const float* __restrict__ sinks, float scale, long long rows,
                                          __half* __restrict__ p16) {
    grid_wait();
    const long long r = (long long)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (r >= rows) return;  // whole warps leave together
    const int lane = threadIdx.x & 31, h = (int)(r % H), i = (int)(r / H % B);
    const long long block_first = r / H - i;  // b · B
    const int t = t0 + (int)block_first + i;
    const int lim = limit ? limit[t] : 0, base = s0 + t0 + (int)block_first;
    float* row = p + r * ldp;
    auto visible = [&](int c) { return c < L ? c >= i && c < i + W && base + c >= pad : c - L < lim; };
    float peak = sinks ? sinks[h] : NEG_INF;
    for (int c = lane; c < L + C; c += 32)
        if (visible(c)) peak = fmaxf(peak, row[c] * scale);
    for (int o = 16; o > 0; o >>= 1) peak = fmaxf(peak, __shfl_xor_sync(0xffffffffu, peak, o));
    if (peak == NEG_INF) peak = 0.f;
    float sum = 0.f;
    for (int c = lane; c < L + C; c += 32)
        if (visible(c)) sum += expf(row[c] * scale - peak);
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    if (sinks) sum += expf(sinks[h] - peak);
    __half* row16 = p16 ? p16 + r * ldp : nullptr;
    for (int c = lane; c < L + C; c += 32) {
        const float v = visible(c) ? expf(row[c] * scale - peak) / sum : 0.f;
        if (row16)
            row16[c] = __float2half_rn(v);
        else
            row[c] = v;
    }
}
