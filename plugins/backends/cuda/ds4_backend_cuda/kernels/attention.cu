// Sparse multi-query attention of a few query tokens in two launches: the scores of the listed rows, then the
// masked softmax with sinks and the weighted sum. As array code this was about fifteen launches per layer. The
// rows are shared by all heads, so after the first head reads them they come from L2.
//
// q [T, H, d], kv [N, d] (keys = values), idx [T, K] rows per query (-1 = none), sinks [H] or null -> out [T, H, d].

#define NEG_INF __int_as_float(0xff800000)  // NVRTC has no math.h, so no INFINITY

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

// Reduce v over the block (max when is_max, else sum); every thread gets the result. red: 32 floats.
__device__ float block_reduce(float v, bool is_max, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        const float u = __shfl_xor_sync(0xffffffffu, v, o);
        v = is_max ? fmaxf(v, u) : v + u;
    }
    __syncthreads();  // red may still be read by an earlier reduction
    if (lane == 0) red[warp] = v;
    __syncthreads();
    v = lane < warps ? red[lane] : (is_max ? NEG_INF : 0.f);
    for (int o = 16; o > 0; o >>= 1) {
        const float u = __shfl_xor_sync(0xffffffffu, v, o);
        v = is_max ? fmaxf(v, u) : v + u;
    }
    return v;
}

// out[t, h, c] = sum_j softmax(logits[t, h] with the sink)[j] · kv[idx[t, j], c]. Each block redoes the softmax of
// its (t, h) into shared memory (K floats after 32 for the reductions), then each thread sums one channel over the
// rows, eight loads in flight. grid (ceil(d / blockDim.x), H, T).
#define MIX_UNROLL 8
extern "C" __global__ void attend_mix(const float* __restrict__ logits, const float* __restrict__ kv,
                                      const int* __restrict__ idx, const float* __restrict__ sinks, int H, int K,
                                      int d, float* __restrict__ out) {
    extern __shared__ float shared[];
    float* red = shared;
    float* p = shared + 32;
    const int h = blockIdx.y;
    const size_t th = (size_t)blockIdx.z * H + h;
    const float* l = logits + th * K;
    const int* rows = idx + (size_t)blockIdx.z * K;
    float peak = NEG_INF;
    for (int j = threadIdx.x; j < K; j += blockDim.x) peak = fmaxf(peak, l[j]);
    peak = block_reduce(peak, true, red);
    if (sinks) peak = fmaxf(peak, sinks[h]);
    else if (peak == NEG_INF) peak = 0.f;
    float sum = 0.f;
    for (int j = threadIdx.x; j < K; j += blockDim.x) {
        const float e = expf(l[j] - peak);
        p[j] = e;
        sum += e;
    }
    sum = block_reduce(sum, false, red);
    if (sinks) sum += expf(sinks[h] - peak);
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    float* o = out + th * d;
    if (sum == 0.f) {  // nothing to attend to and no sink: 0 / 0, as the array form gives
        if (c < d) o[c] = __int_as_float(0x7fc00000);
        return;
    }
    for (int j = threadIdx.x; j < K; j += blockDim.x) p[j] /= sum;
    __syncthreads();
    if (c >= d) return;
    float acc[MIX_UNROLL] = {};
    int j = 0;
    for (; j + MIX_UNROLL <= K; j += MIX_UNROLL) {
#pragma unroll
        for (int u = 0; u < MIX_UNROLL; ++u) {  // a masked row has p = 0: read row 0 instead of branching
            acc[u] = fmaf(p[j + u], kv[(size_t)max(rows[j + u], 0) * d + c], acc[u]);
        }
    }
    for (; j < K; ++j) acc[0] = fmaf(p[j], kv[(size_t)max(rows[j], 0) * d + c], acc[0]);
    float s = 0.f;
#pragma unroll
    for (int u = 0; u < MIX_UNROLL; ++u) s += acc[u];
    o[c] = s;
}
