// MoE router arithmetic around the device top-k, one launch each instead of about a dozen array operations, or one
// launch in all (route_topk), or with the router's projection too (route_linear_topk).

#include <cuda_fp16.h>

__device__ __forceinline__ float route_score(float l, int kind) {
    return kind == 0 ? sqrtf(l > 20.f ? l : log1pf(expf(fminf(l, 20.f)))) : 1.f / (1.f + expf(-l));
}

// scores[i] = sqrt(softplus(logits[i])) (kind 0, DeepSeek V4) or sigmoid(logits[i]) (kind 1, GLM 5.x), and
// choice[i] = scores[i] + bias[i % E] (bias may be null); one thread per element of logits [T, E].
extern "C" __global__ void route_scores(const float* __restrict__ logits, const float* __restrict__ bias, int kind,
                                        long long n, int E, float* __restrict__ scores, float* __restrict__ choice) {
    grid_wait();
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float s = route_score(logits[i], kind);
    scores[i] = s;
    choice[i] = bias ? s + bias[i % E] : s;
}

// w[t, j] = scores[t, idx[t, j]], divided by (their sum + 1e-20) when normalize, times scale; one thread per token.
extern "C" __global__ void route_weights(const float* __restrict__ scores, const int* __restrict__ idx, int T, int E,
                                         int k, int normalize, float scale, float* __restrict__ w) {
    grid_wait();
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T) return;
    float sum = 0.f;
    for (int j = 0; j < k; ++j) sum += scores[(size_t)t * E + idx[t * k + j]];
    for (int j = 0; j < k; ++j) {
        const float s = scores[(size_t)t * E + idx[t * k + j]];
        w[t * k + j] = (normalize ? s / (sum + 1e-20f) : s) * scale;
    }
}

// route_scores, topk_rank (select.cu) and route_weights for token t's logits l [E] by one block, E <= blockDim.x
// experts: thread i scores expert i, ranks its choice among the block's in shared memory (ties to the lower index,
// NaN as -inf) and, when the rank is below k, writes id and score to that place; the first k threads then weigh the
// chosen scores as route_weights does, in the same order. The logits are read through L2 (they may come from other
// blocks of the same launch). choice: shared memory of E + k floats.
__device__ void route_choose(const float* __restrict__ l, const float* __restrict__ bias, int kind, int E, int k,
                             int normalize, float scale, int* __restrict__ idx, float* __restrict__ w, float* choice) {
    float* chosen = choice + E;  // the chosen scores [k]
    const int i = threadIdx.x;
    float s = 0.f, c = NEG_INF;
    if (i < E) {
        s = route_score(__ldcg(l + i), kind);
        c = rank_key(bias ? s + bias[i] : s);
        choice[i] = c;
    }
    __syncthreads();
    int rank[4] = {};  // four counts in flight
    int j = 0;
    for (; j + 4 <= E; j += 4)
#pragma unroll
        for (int u = 0; u < 4; ++u) rank[u] += (choice[j + u] > c) | ((choice[j + u] == c) & (j + u < i));
    for (; j < E; ++j) rank[0] += (choice[j] > c) | ((choice[j] == c) & (j < i));
    const int r = rank[0] + rank[1] + rank[2] + rank[3];
    if (i < E && r < k) {
        idx[r] = i;
        chosen[r] = s;
    }
    __syncthreads();
    if (i < k) {
        float sum = 0.f;
        for (int q = 0; q < k; ++q) sum += chosen[q];
        w[i] = (normalize ? chosen[i] / (sum + 1e-20f) : chosen[i]) * scale;
    }
}

// route_choose for token t = blockIdx.x of logits [T, E]; idx, w [T, k]; dynamic shared memory E + k floats.
extern "C" __global__ void route_topk(const float* __restrict__ logits, const float* __restrict__ bias, int kind,
                                      int E, int k, int normalize, float scale, int* __restrict__ idx,
                                      float* __restrict__ w) {
    grid_wait();
    extern __shared__ float choice[];
    const size_t t = blockIdx.x;
    route_choose(logits + t * E, bias, kind, E, k, normalize, scale, idx + t * k, w + t * k, choice);
}

// Eight weights of a router row from column 8c: F32 (fmt 0), F16 (1) or BF16 (2), as quant.cu's formats read them.
__device__ __forceinline__ void router_row8(const unsigned char* __restrict__ row, int fmt, int c, float (&v)[8]) {
    if (fmt == 0) {
        const float4* p = reinterpret_cast<const float4*>(row) + 2 * c;
        const float4 a = p[0], b = p[1];
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
        return;
    }
    const uint4 q = reinterpret_cast<const uint4*>(row)[c];
    const unsigned h[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned lo = h[i] & 0xFFFFu, hi = h[i] >> 16;
        v[2 * i] = fmt == 1 ? __half2float(__ushort_as_half((unsigned short)lo)) : __uint_as_float(lo << 16);
        v[2 * i + 1] = fmt == 1 ? __half2float(__ushort_as_half((unsigned short)hi)) : __uint_as_float(hi << 16);
    }
}

// The router of a few tokens in one launch: logits[t, e] = W[e] . x[t] for the E experts (W's rows of D columns, D a
// multiple of 8, in format fmt as router_row8 reads them), a warp a row; the last block of token t = blockIdx.y to
// finish (count[t] in global memory counts them, and that block sets it back to 0) then makes the choice as
// route_topk does. A launch and the logits' round trip fewer than a GEMV, then route_topk. grid
// (ceil(E / ROUTER_WARPS), T), 32 · ROUTER_WARPS threads, E <= 32 · ROUTER_WARPS; dynamic shared memory E + k floats.
#define ROUTER_WARPS 8
extern "C" __global__ void __launch_bounds__(32 * ROUTER_WARPS) route_linear_topk(
        const unsigned char* __restrict__ W, int fmt, const float* __restrict__ x, int D, int E,
        float* __restrict__ logits, int* __restrict__ count, const float* __restrict__ bias, int kind, int k,
        int normalize, float scale, int* __restrict__ idx, float* __restrict__ w) {
    extern __shared__ float choice[];
    __shared__ int last;
    const int t = blockIdx.y, lane = threadIdx.x & 31, e = blockIdx.x * ROUTER_WARPS + (threadIdx.x >> 5);
    grid_wait();
    if (e < E) {
        const unsigned char* row = W + (size_t)e * D * (fmt == 0 ? 4 : 2);
        const float4* xt = reinterpret_cast<const float4*>(x + (size_t)t * D);
        float acc = 0.f;
#pragma unroll 8
        for (int c = lane; c < D / 8; c += 32) {
            float v[8];
            router_row8(row, fmt, c, v);
            const float4 a = xt[2 * c], b = xt[2 * c + 1];
            acc = fmaf(v[0], a.x, fmaf(v[1], a.y, fmaf(v[2], a.z, fmaf(v[3], a.w, acc))));
            acc = fmaf(v[4], b.x, fmaf(v[5], b.y, fmaf(v[6], b.z, fmaf(v[7], b.w, acc))));
        }
        for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
        if (lane == 0) logits[(size_t)t * E + e] = acc;
    }
    __syncthreads();  // this block's logits are written
    if (threadIdx.x == 0) {
        __threadfence();  // ... and visible to the block that counts last
        last = atomicAdd(count + t, 1) == (int)gridDim.x - 1;
    }
    __syncthreads();
    if (!last) return;
    if (threadIdx.x == 0) count[t] = 0;  // every block has counted: ready for the next launch
    __threadfence();
    route_choose(logits + (size_t)t * E, bias, kind, E, k, normalize, scale, idx + (size_t)t * k, w + (size_t)t * k,
                 choice);
}
