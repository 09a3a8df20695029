// Sparse multi-query attention of a few query tokens in two launches: the scores of the listed rows, then the
// masked softmax with sinks and the weighted sum. As array code this was about fifteen launches per layer. All heads
// share the rows (one K=V table), so the scores read them from L2 after the first head, and the weighted sum reads
// each row once for a group of heads.
//
// q [T, H, d], kv [N, d] (keys = values), idx [T, K] rows per query (-1 = none), sinks [H] or null -> out [T, H, d].

#define NEG_INF __int_as_float(0xff800000)  // NVRTC has no math.h, so no INFINITY

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

// logits[t, h, j] = (q[t, h] . kv[idx[t, j]]) · scale, or -inf where idx < 0; one warp per (t, h, j),
// grid (ceil(K / warps per block), H, T).
extern "C" __global__ void attend_scores(const float* __restrict__ q, const float* __restrict__ kv,
                                         const int* __restrict__ idx, int H, int K, int d, float scale,
                                         float* __restrict__ logits) {
    const int lane = threadIdx.x & 31;
    const int j = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (j >= K) return;  // whole warps leave together
    const size_t th = (size_t)blockIdx.z * H + blockIdx.y;
    const int r = idx[(size_t)blockIdx.z * K + j];
    float s = 0.f;
    if (r >= 0) {
        const float* qr = q + th * d;
        const float* kr = kv + (size_t)r * d;
        for (int c = lane; c < d; c += 32) s = fmaf(qr[c], kr[c], s);
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    }
    if (lane == 0) logits[th * K + j] = r >= 0 ? s * scale : NEG_INF;
}

// out[t, h, c] = sum_j softmax(logits[t, h] with the sink)[j] · kv[idx[t, j], c]. A block takes 32 channels of
// ATTEND_HEADS heads: warp w first finds head w's softmax peak and sum, then the rows go by in tiles of ATTEND_TILE,
// each row read once for all the block's heads (lane = channel, warp = every eighth row of the tile), and the warps'
// partial sums are added in a fixed order. grid (ceil(d / 32), ceil(H / ATTEND_HEADS), T), ATTEND_HEADS warps.
#define ATTEND_HEADS 8
#define ATTEND_TILE 256
extern "C" __global__ void __launch_bounds__(32 * ATTEND_HEADS) attend_mix(
        const float* __restrict__ logits, const float* __restrict__ kv, const int* __restrict__ idx,
        const float* __restrict__ sinks, int H, int K, int d, float* __restrict__ out) {
    __shared__ float p[ATTEND_HEADS][ATTEND_TILE];
    __shared__ int tile_rows[ATTEND_TILE];
    __shared__ float peak_of[ATTEND_HEADS], sum_of[ATTEND_HEADS];
    __shared__ float partial[ATTEND_HEADS][ATTEND_HEADS][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int t = blockIdx.z, c = blockIdx.x * 32 + lane;
    const int* rows = idx + (size_t)t * K;
    {  // warp w: softmax statistics of head h0 + w
        const int h = blockIdx.y * ATTEND_HEADS + warp;
        float peak = NEG_INF, sum = 0.f;
        if (h < H) {
            const float* l = logits + ((size_t)t * H + h) * K;
            for (int j = lane; j < K; j += 32) peak = fmaxf(peak, l[j]);
            warp_softmax_stats(l, K, sinks, h, peak, peak, sum);
        }
        if (lane == 0) {
            peak_of[warp] = peak;
            sum_of[warp] = sum;
        }
    }
    float acc[ATTEND_HEADS] = {};
    for (int j0 = 0; j0 < K; j0 += ATTEND_TILE) {
        const int n = min(ATTEND_TILE, K - j0);
        __syncthreads();  // the statistics are written; the last tile is consumed
        for (int e = threadIdx.x; e < ATTEND_HEADS * ATTEND_TILE; e += blockDim.x) {
            const int hh = e / ATTEND_TILE, j = e % ATTEND_TILE, h = blockIdx.y * ATTEND_HEADS + hh;
            float v = 0.f;  // a masked row has weight exp(-inf) = 0
            if (j < n && h < H)
                v = expf(logits[((size_t)t * H + h) * K + j0 + j] - peak_of[hh]) / sum_of[hh];
            p[hh][j] = v;
            if (hh == 0 && j < n) tile_rows[j] = max(rows[j0 + j], 0);  // row 0 stands in for masked rows
        }
        __syncthreads();
        if (c < d) {
#pragma unroll 8
            for (int j = warp; j < n; j += ATTEND_HEADS) {
                const float v = kv[(size_t)tile_rows[j] * d + c];
#pragma unroll
                for (int hh = 0; hh < ATTEND_HEADS; ++hh) acc[hh] = fmaf(p[hh][j], v, acc[hh]);
            }
        }
    }
#pragma unroll
    for (int hh = 0; hh < ATTEND_HEADS; ++hh) partial[warp][hh][lane] = acc[hh];
    __syncthreads();
    const int h = blockIdx.y * ATTEND_HEADS + warp;  // warp w adds up head w over the warps
    if (h < H && c < d) {
        float s = 0.f;
#pragma unroll
        for (int w = 0; w < ATTEND_HEADS; ++w) s += partial[w][warp][lane];
        out[((size_t)t * H + h) * d + c] = s;
    }
}

// Prefill's softmax between its two batched products: p[t, h, j] = softmax_j(dots[t, h, j] · scale, or -inf where
// idx[t, j] < 0) with the sink in the denominator, in place over dots [T, H, K]; the statistics of attend_mix
// (warp_softmax_stats). One warp per (t, h) row, rows = T * H.
extern "C" __global__ void attend_softmax(float* __restrict__ dots, const int* __restrict__ idx,
                                          const float* __restrict__ sinks, int H, int K, long long rows,
                                          float scale) {
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
