// Hyper-connection kernels (spec §3): the split of one token's mix row into gates and the Sinkhorn-balanced n×n
// combination, and the two stream contractions around a sub-layer. As array code these are about a hundred launches
// per layer on a few dozen floats; here each is one launch, so a recorded decode step stays short.

#define HC_MAX 8
// v summed over the lanes that differ from this one in the bits FROM .. TO / 2 (powers of two).
template <int FROM, int TO>
__device__ __forceinline__ float butterfly_sum(float v) {
#pragma unroll
    for (int o = FROM; o < TO; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// One warp per token: lane r·N + k holds element (r, k) of the N×N combination (and lane + 32 the rest when
// N·N > 32); rows and columns are summed with shuffles in index order, as the array form sums, or, when N is a power
// of two with N·N <= 32 (the models' 4 streams), by butterflies: log2(N) shuffles a sum instead of N, which is most
// of the 20 iterations' time. N is a template argument so the shuffle loops unroll and overlap. (One thread per
// token with IEEE divisions kept them in one serial chain: ~25 µs per token.)
template <int N>
__device__ void hc_split_warp(const float* __restrict__ m, const float* __restrict__ scale,
                              const float* __restrict__ base, int iters, float eps, float* __restrict__ pre,
                              float* __restrict__ post, float* __restrict__ comb) {
    constexpr int H = (N * N + 31) / 32;
    const int lane = threadIdx.x & 31;
    if (lane < N) {
        pre[lane] = hc_sigmoid(m[lane] * scale[0] + base[lane]) + eps;
        post[lane] = 2.f * hc_sigmoid(m[N + lane] * scale[1] + base[N + lane]);
    }
    float c[H], sum[H];
    int r[H], k[H];
#pragma unroll
    for (int h = 0; h < H; ++h) {
        const int e = min(lane + 32 * h, N * N - 1);  // lanes past the matrix shadow its last element
        r[h] = e / N;
        k[h] = e % N;
        c[h] = m[2 * N + e] * scale[2] + base[2 * N + e];
    }
    auto at = [&](int i, int j) {  // element (i, j), from the lane that holds it
        const int e = i * N + j;
        float v = __shfl_sync(0xffffffffu, c[0], e & 31);
        if (H > 1) {
            const float hi = __shfl_sync(0xffffffffu, c[H - 1], e & 31);
            v = e < 32 ? v : hi;
        }
        return v;
    };
    constexpr bool BUTTERFLY = (N & (N - 1)) == 0 && N * N <= 32;  // rows: N aligned lanes; columns: stride N
    auto row_sums = [&]() {
        if constexpr (BUTTERFLY) {
            sum[0] = butterfly_sum<1, N>(c[0]);
        } else {
#pragma unroll
            for (int h = 0; h < H; ++h) sum[h] = 0.f;
#pragma unroll
            for (int j = 0; j < N; ++j)
#pragma unroll
                for (int h = 0; h < H; ++h) sum[h] += at(r[h], j);
        }
    };
    auto column_sums = [&]() {
        if constexpr (BUTTERFLY) {
            sum[0] = butterfly_sum<N, N * N>(c[0]);
        } else {
#pragma unroll
            for (int h = 0; h < H; ++h) sum[h] = 0.f;
#pragma unroll
            for (int i = 0; i < N; ++i)
#pragma unroll
                for (int h = 0; h < H; ++h) sum[h] += at(i, k[h]);
        }
    };
    float peak[H];  // row softmax, then + eps: the first iteration's row step
#pragma unroll
    for (int h = 0; h < H; ++h) peak[h] = -3.402823466e38f;
    if constexpr (BUTTERFLY) {
        peak[0] = c[0];
#pragma unroll
        for (int o = 1; o < N; o <<= 1) peak[0] = fmaxf(peak[0], __shfl_xor_sync(0xffffffffu, peak[0], o));
    } else {
#pragma unroll
        for (int j = 0; j < N; ++j)
#pragma unroll
            for (int h = 0; h < H; ++h) peak[h] = fmaxf(peak[h], at(r[h], j));
    }
#pragma unroll
    for (int h = 0; h < H; ++h) c[h] = expf(c[h] - peak[h]);
    row_sums();
#pragma unroll
    for (int h = 0; h < H; ++h) c[h] = __fmaf_rn(c[h], hc_rcp(sum[h]), eps);
    for (int it = 0; it < iters; ++it) {
        if (it > 0) {
            row_sums();
#pragma unroll
            for (int h = 0; h < H; ++h) c[h] = __fmul_rn(c[h], hc_rcp(sum[h] + eps));
        }
        column_sums();
#pragma unroll
        for (int h = 0; h < H; ++h) c[h] = __fmul_rn(c[h], hc_rcp(sum[h] + eps));
    }
#pragma unroll
    for (int h = 0; h < H; ++h)
        if (lane + 32 * h < N * N) comb[lane + 32 * h] = c[h];
}

__device__ void hc_split_token(const float* __restrict__ m, const float* __restrict__ scale,
                               const float* __restrict__ base, int n, int iters, float eps, float* __restrict__ pre,
                               float* __restrict__ post, float* __restrict__ comb) {
    switch (n) {
        case 1: hc_split_warp<1>(m, scale, base, iters, eps, pre, post, comb); break;
        case 2: hc_split_warp<2>(m, scale, base, iters, eps, pre, post, comb); break;
        case 3: hc_split_warp<3>(m, scale, base, iters, eps, pre, post, comb); break;
        case 4: hc_split_warp<4>(m, scale, base, iters, eps, pre, post, comb); break;
        case 5: hc_split_warp<5>(m, scale, base, iters, eps, pre, post, comb); break;
        case 6: hc_split_warp<6>(m, scale, base, iters, eps, pre, post, comb); break;
        case 7: hc_split_warp<7>(m, scale, base, iters, eps, pre, post, comb); break;
        default: hc_split_warp<8>(m, scale, base, iters, eps, pre, post, comb); break;
    }
}

// mix [T, (2+n)·n], scale [3], base [(2+n)·n] -> pre [T, n], post [T, n], comb [T, n, n]; n <= HC_MAX;
// grid ceil(T / warps per block). With slices > 0 the warp first writes its token's mix row from the column slices
// of mix_slices (hc_mix_row; part [T, M + 1, slices]).
extern "C" __global__ void hc_split(float* __restrict__ mix, const float* __restrict__ part, int slices, int K,
                                    float norm_eps, const float* __restrict__ scale, const float* __restrict__ base,
                                    int T, int n, int iters, float eps, float* __restrict__ pre,
                                    float* __restrict__ post, float* __restrict__ comb) {
    grid_wait();
    const int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (t >= T) return;  // whole warps leave together
    const int M = (2 + n) * n;
    float* m = mix + (size_t)t * M;
    if (slices > 0) hc_mix_row(m, part + (size_t)t * (M + 1) * slices, M, slices, K, norm_eps);
    hc_split_token(m, scale, base, n, iters, eps, pre + (size_t)t * n, post + (size_t)t * n, comb + (size_t)t * n * n);
}

// hc_split with the slices, then the collapse c = sum_i pre_i · S_i of the streams S [T, n, D] and its RMSNorm with
// weight w -> out [T, D]. The first blocks run the Sinkhorn iterations (hc_split4_lane; pre, post and comb into
// global memory): only the sub-layer's end needs them, so its 20 dependent iterations run beside the collapse instead
// of after it. With slices, a block a token (its warps sum the mix row's slices, HcMixSums, and warp 0 goes on
// alone); with one slice (a prefill's GEMM made the rows, and hc_mix_row's division is all that is left) a thread a
// token: a block a token held a whole block's registers for one lane, and a prefill's tokens waited for them in
// waves. The other T blocks collapse a token each (hc_norm_token), making the mix row and pre while the streams'
// loads are in flight (all warps summing its slices, warp 0 dividing; with one slice, warp 0). Three launches of a
// decode step's hyper-connection became one. HC_NORM_THREADS threads (the registers of the Sinkhorn and the slice
// sums); n = HC_NORM_STREAMS, the models' 4. part's tokens are ld floats apart. Grid: HC_SINKS(T, slices) + T blocks.
#define HC_SINKS(T, slices) ((slices) == 1 ? ((T) + HC_NORM_THREADS - 1) / HC_NORM_THREADS : (T))
__device__ __forceinline__ void hc_split_norm_body(
        const float* __restrict__ part, int ld, int slices, int K, float norm_eps,
        const float* __restrict__ scale, const float* __restrict__ base, int iters, float eps, float* __restrict__ pre,
        float* __restrict__ post, float* __restrict__ comb, const float* __restrict__ S, int D,
        const float* __restrict__ w, float* __restrict__ out, int T, unsigned char* __restrict__ act) {
    constexpr int N = HC_NORM_STREAMS, M = (2 + N) * N;
    __shared__ float weight[N], row[M], sums[M + 1];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, sinks = HC_SINKS(T, slices);
    if ((int)blockIdx.x < sinks) {
        if (slices == 1) {
            const int t = blockIdx.x * HC_NORM_THREADS + threadIdx.x;
            if (t >= T) return;
            const float* p = part + (size_t)t * ld;
            const float root = sqrtf(p[M] / (float)K + norm_eps);  // hc_mix_row's, a thread's own
            float m[M];
#pragma unroll
            for (int r = 0; r < M; ++r) m[r] = p[r] / root;
            hc_split4_lane(m, scale, base, iters, eps, pre + (size_t)t * N, post + (size_t)t * N,
                           comb + (size_t)t * N * N, true);
        } else {
            const int t = blockIdx.x;
            HcMixSums mix;
            mix.load(part + (size_t)t * ld, M, slices, warp);
            mix.store(M, slices, warp, sums);
            __syncthreads();
            if (warp == 0) {
                hc_mix_divide(row, sums, M, K, norm_eps);
                hc_split4_lane(row, scale, base, iters, eps, pre + (size_t)t * N, post + (size_t)t * N,
                               comb + (size_t)t * N * N);
            }
        }
        return;
    }
    const size_t t = blockIdx.x - sinks;
    HcMixSums mix;  // every warp's loads first, then the streams' (a warp's own were behind the others' streams)
    if (slices > 1) {
        mix.load(part + t * ld, M, slices, warp);
        __syncthreads();
    }
    hc_norm_token(S + t * N * D, D, w, norm_eps, out + t * D, act ? act + t * (D + D / 4 + D / 8) : nullptr, weight,
                  [&] {  // the mix row, its loads beside the streams'
                      if (slices == 1) {
                          if (warp == 0) hc_mix_row(row, part + t * ld, M, slices, K, norm_eps);
                      } else {
                          mix.store(M, slices, warp, sums);
                          __syncthreads();
                          if (warp == 0) hc_mix_divide(row, sums, M, K, norm_eps);
                      }
                      if (warp == 0 && lane < N) weight[lane] = hc_sigmoid(row[lane] * scale[0] + base[lane]) + eps;
                      __syncthreads();
                  });
}

// A decode step's entry (its few blocks take every register they need) and a prefill's (two blocks a
// multiprocessor: 128 registers and a few spills, against one block of 167 registers, whose tokens went in waves).
extern "C" __global__ void __launch_bounds__(HC_NORM_THREADS) hc_split_norm(
        const float* __restrict__ part, int ld, int slices, int K, float norm_eps,
        const float* __restrict__ scale, const float* __restrict__ base, int iters, float eps, float* __restrict__ pre,
        float* __restrict__ post, float* __restrict__ comb, const float* __restrict__ S, int D,
        const float* __restrict__ w, float* __restrict__ out, int T, unsigned char* __restrict__ act) {
    grid_wait();
    hc_split_norm_body(part, ld, slices, K, norm_eps, scale, base, iters, eps, pre, post, comb, S, D, w, out, T, act);
}

extern "C" __global__ void __launch_bounds__(HC_NORM_THREADS, 2) hc_split_norm_rows(
        const float* __restrict__ part, int ld, int slices, int K, float norm_eps,
        const float* __restrict__ scale, const float* __restrict__ base, int iters, float eps, float* __restrict__ pre,
        float* __restrict__ post, float* __restrict__ comb, const float* __restrict__ S, int D,
        const float* __restrict__ w, float* __restrict__ out, int T, unsigned char* __restrict__ act) {
    grid_wait();
    hc_split_norm_body(part, ld, slices, K, norm_eps, scale, base, iters, eps, pre, post, comb, S, D, w, out, T, act);
}

// out[t, d] = sum_i w[t, i] · S[t, i, d]: the collapse of the streams S [T, n, D] with weights w [T, n] (also the
// weighted sum of a token's expert outputs);
// one thread per (t, d), grid (ceil(D / blockDim.x), T).
extern "C" __global__ void hc_collapse(const float* __restrict__ w, const float* __restrict__ S, int n, int D,
                                       float* __restrict__ out) {
    grid_wait();
    const int d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= D) return;
    const size_t t = blockIdx.y;
    const float* s = S + t * n * D + d;
    float acc = 0.f;
    for (int i = 0; i < n; ++i) acc = fmaf(w[t * n + i], s[(size_t)i * D], acc);
    out[t * D + d] = acc;
}

// out[t, k, d] = post[t, k] · y[t, d] + sum_i comb[t, i, k] · S[t, i, d]: the sub-layer output spread back over
// the streams; one thread per (t, d) reads its n stream values once (into registers: the loops over HC_MAX are
// unrolled, as a runtime-indexed array lives in local memory); grid (ceil(D / blockDim.x), T).
extern "C" __global__ void hc_expand(const float* __restrict__ S, const float* __restrict__ y,
                                     const float* __restrict__ post, const float* __restrict__ comb, int n, int D,
                                     float* __restrict__ out) {
    grid_wait();
    const int d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= D) return;
    const size_t t = blockIdx.y;
    float s[HC_MAX];
#pragma unroll
    for (int i = 0; i < HC_MAX; ++i) s[i] = i < n ? S[(t * n + i) * D + d] : 0.f;
    const float yd = y[t * D + d];
    const float* c = comb + t * n * n;
    for (int k = 0; k < n; ++k) {
        float mixed = 0.f;
#pragma unroll
        for (int i = 0; i < HC_MAX; ++i)
            if (i < n) mixed = fmaf(c[i * n + k], s[i], mixed);
        out[(t * n + k) * D + d] = fmaf(post[t * n + k], yd, mixed);  // as expand_mix_slice (kernels/quant.cu)
    }
}

// hc_expand of a prefill's tokens of HC_NORM_STREAMS streams, one block of HC_NORM_THREADS a token (D % 4 == 0,
// D <= 4 · HC_QUADS · HC_NORM_THREADS): out[t, k, :] = post[t, k] · (y[t] + y2[t]) + sum_i comb[t, i, k] · S[t, i, :]
// (y2 null: y alone), hc_expand's arithmetic after the graph's sum of a MoE's two outputs; and squares[t · ld], the
// sum of squares of the token's new streams, which the next mix's norm takes (hc_split_norm with one slice). The two
// launches of the sum and a pass over the new streams for their squares go into this one.
extern "C" __global__ void __launch_bounds__(HC_NORM_THREADS) hc_expand_rows(
        const float* __restrict__ S, const float* __restrict__ y, const float* __restrict__ y2,
        const float* __restrict__ post, const float* __restrict__ comb, int D, float* __restrict__ out,
        float* __restrict__ squares, int ld) {
    grid_wait();
    constexpr int N = HC_NORM_STREAMS;
    __shared__ float partial[32];
    const size_t t = blockIdx.x;
    const int D4 = D / 4;
    const float4* s = reinterpret_cast<const float4*>(S + t * N * D);
    const float4* ya = reinterpret_cast<const float4*>(y + t * D);
    const float4* yb = reinterpret_cast<const float4*>(y2 ? y2 + t * D : y);
    float4 v[HC_QUADS][N], yv[HC_QUADS];
#pragma unroll
    for (int k = 0; k < HC_QUADS; ++k) {  // every load in flight before the arithmetic
        const int d = threadIdx.x + k * blockDim.x;
        const float4 zero = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
        for (int i = 0; i < N; ++i) v[k][i] = d < D4 ? s[(size_t)i * D4 + d] : zero;
        yv[k] = d < D4 ? ya[d] : zero;
        if (y2) {
            const float4 b = d < D4 ? yb[d] : zero;
            yv[k] = make_float4(yv[k].x + b.x, yv[k].y + b.y, yv[k].z + b.z, yv[k].w + b.w);
        }
    }
    float c[N * N], p[N];
#pragma unroll
    for (int i = 0; i < N * N; ++i) c[i] = comb[t * N * N + i];
#pragma unroll
    for (int k = 0; k < N; ++k) p[k] = post[t * N + k];
    float ss = 0.f;
    float4* o = reinterpret_cast<float4*>(out + t * N * D);
#pragma unroll
    for (int k = 0; k < HC_QUADS; ++k) {
        const int d = threadIdx.x + k * blockDim.x;
#pragma unroll
        for (int j = 0; j < N; ++j) {
            float4 m = make_float4(0.f, 0.f, 0.f, 0.f);
#pragma unroll
            for (int i = 0; i < N; ++i) {
                m.x = fmaf(c[i * N + j], v[k][i].x, m.x);
                m.y = fmaf(c[i * N + j], v[k][i].y, m.y);
                m.z = fmaf(c[i * N + j], v[k][i].z, m.z);
                m.w = fmaf(c[i * N + j], v[k][i].w, m.w);
            }
            m = make_float4(fmaf(p[j], yv[k].x, m.x), fmaf(p[j], yv[k].y, m.y), fmaf(p[j], yv[k].z, m.z),
                            fmaf(p[j], yv[k].w, m.w));
            if (d < D4) {
                o[(size_t)j * D4 + d] = m;
                ss = fmaf(m.x, m.x, fmaf(m.y, m.y, fmaf(m.z, m.z, fmaf(m.w, m.w, ss))));
            }
        }
    }
    ss = block_sum(ss, partial);
    if (threadIdx.x == 0) squares[t * ld] = ss;
}
