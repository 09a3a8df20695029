// Hyper-connection pieces shared by the glue module's kernels (hc.cu) and the quant modules' hc_expand_mix_norm
// (quant.cu, which also needs a weight format): the split of a token's mix row into its gates and the Sinkhorn, and
// the collapse of the streams with its RMSNorm.

__device__ __forceinline__ float hc_sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

// The Sinkhorn iterations divide by a row's or column's sum as a product with its approximate reciprocal (one MUFU
// instruction, within 1 ulp; the product within 2): an IEEE division is a dozen dependent instructions, 41 of them
// in a row. Products and the first step's + eps are rounded explicitly, so both forms below give the same bits.
__device__ __forceinline__ float hc_rcp(float x) {
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

// hc_split_warp<4> with the Sinkhorn iterations in one lane: the 4 × 4 matrix in its registers, rows and columns
// summed in the order of the butterflies (pairs, then the pairs' sums), so every result has the same bits, but
// without a shuffle in the 41 dependent steps (a step is four sums, four reciprocals and 16 products, side by
// side). Lanes 0-3 write pre and post, lane 0 comb; alone: the calling thread writes them all.
__device__ __forceinline__ void hc_split4_lane(const float* m, const float* __restrict__ scale,
                                               const float* __restrict__ base, int iters, float eps,
                                               float* __restrict__ pre, float* __restrict__ post,
                                               float* __restrict__ comb, bool alone = false) {
    const int lane = threadIdx.x & 31;
    if (alone) {
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            pre[i] = hc_sigmoid(m[i] * scale[0] + base[i]) + eps;
            post[i] = 2.f * hc_sigmoid(m[4 + i] * scale[1] + base[4 + i]);
        }
    } else if (lane < 4) {
        pre[lane] = hc_sigmoid(m[lane] * scale[0] + base[lane]) + eps;
        post[lane] = 2.f * hc_sigmoid(m[4 + lane] * scale[1] + base[4 + lane]);
    }
    if (!alone && lane != 0) return;
    float c[16], sum[4];
#pragma unroll
    for (int e = 0; e < 16; ++e) c[e] = m[8 + e] * scale[2] + base[8 + e];
    auto row_sums = [&]() {
#pragma unroll
        for (int r = 0; r < 4; ++r) sum[r] = (c[4 * r] + c[4 * r + 1]) + (c[4 * r + 2] + c[4 * r + 3]);
    };
    auto column_sums = [&]() {
#pragma unroll
        for (int k = 0; k < 4; ++k) sum[k] = (c[k] + c[k + 4]) + (c[k + 8] + c[k + 12]);
    };
#pragma unroll
    for (int r = 0; r < 4; ++r) {  // row softmax, then + eps: the first iteration's row step
        const float peak = fmaxf(fmaxf(c[4 * r], c[4 * r + 1]), fmaxf(c[4 * r + 2], c[4 * r + 3]));
#pragma unroll
        for (int k = 0; k < 4; ++k) c[4 * r + k] = expf(c[4 * r + k] - peak);
    }
    float inv[4];
    row_sums();
#pragma unroll
    for (int r = 0; r < 4; ++r) inv[r] = hc_rcp(sum[r]);
#pragma unroll
    for (int e = 0; e < 16; ++e) c[e] = __fmaf_rn(c[e], inv[e / 4], eps);
    for (int it = 0; it < iters; ++it) {
        if (it > 0) {
            row_sums();
#pragma unroll
            for (int r = 0; r < 4; ++r) inv[r] = hc_rcp(sum[r] + eps);
#pragma unroll
            for (int e = 0; e < 16; ++e) c[e] = __fmul_rn(c[e], inv[e / 4]);
        }
        column_sums();
#pragma unroll
        for (int k = 0; k < 4; ++k) inv[k] = hc_rcp(sum[k] + eps);
#pragma unroll
        for (int e = 0; e < 16; ++e) c[e] = __fmul_rn(c[e], inv[e % 4]);
    }
    float4* out = reinterpret_cast<float4*>(comb);  // comb is 16-byte aligned (a token's 16 floats)
#pragma unroll
    for (int r = 0; r < 4; ++r) out[r] = make_float4(c[4 * r], c[4 * r + 1], c[4 * r + 2], c[4 * r + 3]);
}

// The mix row's pieces. part [M + 1, slices] holds the column slices' products of mix_slices (quant.cu) and, in row M,
// their sums of squares, over K columns; another block of the same launch may have written them, so they are read
// through L2. A row is summed by one warp: lane l adds slices l, l + 32, ... in order, and the lanes' sums meet in a
// butterfly, so a row has the same bits whichever warp of whichever kernel sums it.
__device__ __forceinline__ float hc_lanes_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// Rows first .. last of part summed by one warp, four rows' loads in flight at once; store(r, sum) by every lane.
template <class Store>
__device__ __forceinline__ void hc_slice_rows(const float* __restrict__ part, int first, int last, int slices,
                                              Store store) {
    for (int r0 = first; r0 <= last; r0 += 4) {
        float v[4] = {0.f, 0.f, 0.f, 0.f};
        for (int s = threadIdx.x & 31; s < slices; s += 32) {
#pragma unroll
            for (int i = 0; i < 4; ++i)
                if (r0 + i <= last) v[i] += __ldcg(part + (size_t)(r0 + i) * slices + s);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float sum = hc_lanes_sum(v[i]);
            if (r0 + i <= last) store(r0 + i, sum);
        }
    }
}

// The sums of part's rows by the first eight warps of a block (a decode step's mix row is 25 rows of 64 slices: one
// warp took ~2 µs over them, eight ~0.7), in two halves so that other loads can fly beside these: load() issues warp
// w's loads of rows w, w + 8, w + 16, w + 24 <= M, two slices a lane (M < 32, slices <= 64), and store() sums them
// into sums [M + 1] in shared memory, with hc_slice_rows' bits.
struct HcMixSums {
    float v[4][2];

    __device__ __forceinline__ void load(const float* __restrict__ part, int M, int slices, int w) {
        const int lane = threadIdx.x & 31;
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
            for (int k = 0; k < 2; ++k) {
                const int r = w + 8 * i, s = lane + 32 * k;
                v[i][k] = r <= M && s < slices ? __ldcg(part + (size_t)r * slices + s) : 0.f;
            }
    }

    __device__ __forceinline__ void store(int M, int slices, int w, float* sums) const {
        const int lane = threadIdx.x & 31;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            float sum = 0.f;  // hc_slice_rows' lane order
            if (lane < slices) sum += v[i][0];
            if (lane + 32 < slices) sum += v[i][1];
            sum = hc_lanes_sum(sum);
            if (lane == 0 && w + 8 * i <= M) sums[w + 8 * i] = sum;
        }
    }
};

// m [M] from HcMixSums' sums, by one warp: the products over the RMS of the K columns.
__device__ __forceinline__ void hc_mix_divide(float* m, const float* sums, int M, int K, float norm_eps) {
    const float root = sqrtf(sums[M] / (float)K + norm_eps);
    for (int r = threadIdx.x & 31; r < M; r += 32) m[r] = sums[r] / root;
    __syncwarp();  // the row is read back by other lanes of this warp
}

// Token t's mix row m [M] from part by one warp (slices 1: the whole rows' products and sum of squares, as a
// prefill's GEMM and row_squares make them): the squares' row first, then each row divided as it is summed, the
// bits of HcMixSums and hc_mix_divide. The row is in m when it returns.
__device__ void hc_mix_row(float* __restrict__ m, const float* __restrict__ part, int M, int slices, int K,
                           float norm_eps) {
    if (slices == 1) {
        const float root = sqrtf(__ldcg(part + M) / (float)K + norm_eps);
        for (int r = threadIdx.x & 31; r < M; r += 32) m[r] = __ldcg(part + r) / root;
        __syncwarp();
        return;
    }
    float squares = 0.f;
    hc_slice_rows(part, M, M, slices, [&](int, float sum) { squares = sum; });
    const float root = sqrtf(squares / (float)K + norm_eps);
    hc_slice_rows(part, 0, M - 1, slices, [&](int r, float sum) {
        if ((threadIdx.x & 31) == 0) m[r] = sum / root;
    });
    __syncwarp();  // the row is read back by other lanes of this warp
}

// The collapse c = sum_i weight_i · S_i of one token's HC_NORM_STREAMS streams S [N, D] and its RMSNorm with weight w
// -> out [D] (and act, when not null: the int8 activation of out, as the GEMVs after it would quantize it), by the
// block's first HC_NORM_THREADS threads, D a multiple of 4 up to 4 · HC_QUADS · HC_NORM_THREADS. Every thread loads
// its column quads of all streams at once (one memory round trip; a loop over streams and columns waited for each
// load in turn), then calls ready(), the barrier after which the shared weight [N] holds the weights. S is read
// through L2: another block of the same launch may have written it. The threads' sums of squares meet at named
// barrier 1, which threads past the first HC_NORM_THREADS do not join.
#define HC_QUADS 4
#define HC_NORM_THREADS 256
static_assert(HC_NORM_THREADS == 8 * 32, "HcMixSums takes the first eight warps");
#define HC_NORM_STREAMS 4  // hc_split4_lane's
template <class Ready>
__device__ __forceinline__ void hc_norm_token(const float* __restrict__ S, int D, const float* __restrict__ w,
                                              float norm_eps, float* __restrict__ out, unsigned char* __restrict__ act,
                                              const float* weight, Ready ready) {
    constexpr int N = HC_NORM_STREAMS;
    __shared__ float partial[HC_NORM_THREADS / 32];
    const float4* s = reinterpret_cast<const float4*>(S);
    const float4* w4 = reinterpret_cast<const float4*>(w);
    const int D4 = D / 4, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float4 v[HC_QUADS][N], g[HC_QUADS];
#pragma unroll
    for (int k = 0; k < HC_QUADS; ++k) {  // loads before the barrier: they do not need the weights
        const int d = threadIdx.x + k * HC_NORM_THREADS;
#pragma unroll
        for (int i = 0; i < N; ++i) v[k][i] = d < D4 ? __ldcg(s + (size_t)i * D4 + d) : make_float4(0.f, 0.f, 0.f, 0.f);
        g[k] = d < D4 ? w4[d] : make_float4(0.f, 0.f, 0.f, 0.f);
    }
    ready();
    float4 c[HC_QUADS];
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < HC_QUADS; ++k) {
        c[k] = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int i = 0; i < N; ++i) {
            c[k].x = fmaf(weight[i], v[k][i].x, c[k].x);
            c[k].y = fmaf(weight[i], v[k][i].y, c[k].y);
            c[k].z = fmaf(weight[i], v[k][i].z, c[k].z);
            c[k].w = fmaf(weight[i], v[k][i].w, c[k].w);
        }
        ss = fmaf(c[k].x, c[k].x, fmaf(c[k].y, c[k].y, fmaf(c[k].z, c[k].z, fmaf(c[k].w, c[k].w, ss))));
    }
    // block_sum's order (reduce.cuh) over the first HC_NORM_THREADS threads
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (lane == 0) partial[warp] = ss;
    asm volatile("bar.sync 1, %0;" ::"n"(HC_NORM_THREADS) : "memory");
    float total = lane < HC_NORM_THREADS / 32 ? partial[lane] : 0.f;
    for (int o = 16; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffffu, total, o);
    // one division a thread, then products: a division a value (sixteen a thread) lengthened the launch's tail,
    // which one block runs alone
    const float inv = 1.f / sqrtf(total / (float)D + norm_eps);
    float4* o = reinterpret_cast<float4*>(out);
#pragma unroll
    for (int k = 0; k < HC_QUADS; ++k) {
        const int d = threadIdx.x + k * HC_NORM_THREADS;
        const float4 y = make_float4(c[k].x * inv * g[k].x, c[k].y * inv * g[k].y, c[k].z * inv * g[k].z,
                                     c[k].w * inv * g[k].w);
        if (d < D4) o[d] = y;
        if (act) write_quad_group(y, d, D, act);
    }
}
