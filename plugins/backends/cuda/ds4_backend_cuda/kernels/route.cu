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
// experts: thread i scores expert i, ranks its choice (ties to the lower index, NaN as -inf) and, when the rank is
// below k, writes id and score to that place; the first k threads then weigh the chosen scores as route_weights does,
// in the same order. The logits are read through L2 (they may come from other blocks of the same launch). choice:
// shared memory of E + k floats.
// The rank takes two rounds when k <= 32 and the candidates fit in choice: each warp ranks its 32 choices among
// themselves by shuffles, and its first k are candidates; every expert ranked above a chosen one is chosen too, so
// is among its warp's candidates, and a candidate's rank among all warps' candidates is its rank among all E. A
// thread then compares its choice with 32 + warps · k others instead of E (for Flash's 256 experts, 80 against 256).
// Else every thread counts over all E in shared memory.
__device__ void route_choose(const float* __restrict__ l, const float* __restrict__ bias, int kind, int E, int k,
                             int normalize, float scale, int* __restrict__ idx, float* __restrict__ w, float* choice) {
    float* chosen = choice + E;  // the chosen scores [k]
    const int i = threadIdx.x, lane = i & 31, warp = i >> 5, warps = blockDim.x >> 5;
    float s = 0.f, c = NEG_INF;
    if (i < E) {
        s = route_score(__ldcg(l + i), kind);
        c = rank_key(bias ? s + bias[i] : s);
    }
    int r = k;
    if (k <= 32 && 2 * warps * k <= E) {
        float* key = choice;  // the candidates' choices and experts, warp w's in places w · k .. w · k + k - 1
        int* who = reinterpret_cast<int*>(choice + warps * k);
        int mine = 0;
        for (int j = 0; j < 32; ++j) {
            const float o = __shfl_sync(0xffffffffu, c, j);
            mine += (o > c) | ((o == c) & (j < lane));
        }
        if (mine < k) {
            key[warp * k + mine] = c;
            who[warp * k + mine] = i;
        }
        __syncthreads();
        if (mine < k) {
            int count[4] = {};  // four counts in flight
            int q = 0;
            for (; q + 4 <= warps * k; q += 4)
#pragma unroll
                for (int u = 0; u < 4; ++u) count[u] += (key[q + u] > c) | ((key[q + u] == c) & (who[q + u] < i));
            for (; q < warps * k; ++q) count[0] += (key[q] > c) | ((key[q] == c) & (who[q] < i));
            r = count[0] + count[1] + count[2] + count[3];
        }
    } else {
        if (i < E) choice[i] = c;
        __syncthreads();
        int count[4] = {};  // four counts in flight
        int j = 0;
        for (; j + 4 <= E; j += 4)
#pragma unroll
            for (int u = 0; u < 4; ++u) count[u] += (choice[j + u] > c) | ((choice[j + u] == c) & (j + u < i));
        for (; j < E; ++j) count[0] += (choice[j] > c) | ((choice[j] == c) & (j < i));
        r = count[0] + count[1] + count[2] + count[3];
    }
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

// A token's given experts e [k] and their weights from its logits l [E], by its first k threads: thread j writes e[j]
// and its weight, the scores summed in route_weights' order, with route_scores' arithmetic (read through L2: other
// blocks of the launch wrote l).
__device__ __forceinline__ void route_fixed(const float* __restrict__ l, const int* __restrict__ e, int kind, int k,
                                            int normalize, float scale, int* __restrict__ idx, float* __restrict__ w) {
    const int j = threadIdx.x;
    if (j >= k) return;
    float sum = 0.f, mine = 0.f;
    for (int q = 0; q < k; ++q) {
        const float s = route_score(__ldcg(l + e[q]), kind);
        sum += s;
        if (q == j) mine = s;
    }
    idx[j] = e[j];
    w[j] = (normalize ? mine / (sum + 1e-20f) : mine) * scale;
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

// acc plus the 16 bytes q of a router row times the columns of x under them, a and b: eight F16 (fmt 1) or BF16
// (fmt 2) weights, as quant.cu's formats read them, or four F32 (fmt 0) with a alone.
__device__ __forceinline__ float router_dot16(uint4 q, int fmt, float4 a, float4 b, float acc) {
    const unsigned h[4] = {q.x, q.y, q.z, q.w};
    if (fmt == 0)
        return fmaf(__uint_as_float(h[0]), a.x, fmaf(__uint_as_float(h[1]), a.y,
                    fmaf(__uint_as_float(h[2]), a.z, fmaf(__uint_as_float(h[3]), a.w, acc))));
    const float xs[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned lo = h[i] & 0xFFFFu, hi = h[i] >> 16;
        acc = fmaf(fmt == 1 ? __half2float(__ushort_as_half((unsigned short)lo)) : __uint_as_float(lo << 16),
                   xs[2 * i], acc);
        acc = fmaf(fmt == 1 ? __half2float(__ushort_as_half((unsigned short)hi)) : __uint_as_float(hi << 16),
                   xs[2 * i + 1], acc);
    }
    return acc;
}

#define ROUTER_THREADS 256
#define ROUTER_ROWS 2
#define ROUTER_SPLIT (ROUTER_THREADS / 32 / ROUTER_ROWS)
#define ROUTER_BATCH 8

// A lane's share of its router row: the row's 16-byte words first, first + step, ... below n (n = 0 for a warp past
// the E rows).
struct RouterLane {
    const uint4* row;
    int n, first;
    static constexpr int step = 32 * ROUTER_SPLIT;
};

__device__ __forceinline__ RouterLane router_lane(const unsigned char* __restrict__ W, int fmt, int D, int E) {
    const int warp = threadIdx.x >> 5, e = blockIdx.x * ROUTER_ROWS + warp / ROUTER_SPLIT;
    return {reinterpret_cast<const uint4*>(W + (size_t)min(e, E - 1) * D * (fmt == 0 ? 4 : 2)),
            e < E ? D / (fmt == 0 ? 4 : 8) : 0, (warp % ROUTER_SPLIT) * 32 + (int)(threadIdx.x & 31)};
}

// Batch b of the lane's words (zeros past the row's end).
__device__ __forceinline__ void router_fetch(const unsigned char* __restrict__ W, int fmt, int D, int E, int b,
                                             uint4 (&q)[ROUTER_BATCH]) {
    const RouterLane l = router_lane(W, fmt, D, E);
#pragma unroll
    for (int j = 0; j < ROUTER_BATCH; ++j) {
        const int u = l.first + (b * ROUTER_BATCH + j) * RouterLane::step;
        q[j] = u < l.n ? __ldcs(l.row + u) : make_uint4(0u, 0u, 0u, 0u);
    }
}

// The router of a few tokens in one launch: logits[t, e] = W[e] . x[t] for the E experts (W's rows of D columns, D a
// multiple of 8, in format fmt as router_dot16 reads them); then the last block of token t = blockIdx.y to finish
// (count[t] in global memory counts them, and that block sets it back to 0) makes the choice as route_topk does. A
// launch and the logits' round trip fewer than a GEMV, then route_topk. With fixed [T, k] (a hash layer's experts,
// from its table), that block takes those instead and weighs them as route_scores and route_weights would: two
// launches fewer. With fixed_rows [T] too, fixed is the table and token t's experts its row fixed_rows[t] (the token's
// id), read here: the gather's launch fewer.
// A block projects ROUTER_ROWS rows, each split over ROUTER_SPLIT warps, and a lane loads ROUTER_BATCH 16-byte words
// and the columns of x under them before it uses them: Flash's 8 KB rows take one batch, so the projection waits on
// memory about once (a warp a row, loading as it went, took 12.3 us on the H200); the first batch is loaded before the
// block waits for x.
// grid (ceil(E / ROUTER_ROWS), T), ROUTER_THREADS threads, E <= ROUTER_THREADS; dynamic shared memory E + k floats.
extern "C" __global__ void __launch_bounds__(ROUTER_THREADS) route_linear_topk(
        const unsigned char* __restrict__ W, int fmt, const float* __restrict__ x, int D, int E,
        float* __restrict__ logits, int* __restrict__ count, const float* __restrict__ bias, int kind, int k,
        int normalize, float scale, int* __restrict__ idx, float* __restrict__ w, const int* __restrict__ fixed,
        const int* __restrict__ fixed_rows) {
    extern __shared__ float choice[];
    __shared__ float part[ROUTER_THREADS / 32];
    __shared__ int last;
    uint4 q[ROUTER_BATCH];
    router_fetch(W, fmt, D, E, 0, q);  // constant data: the first batch loads while the previous kernel ends
    grid_wait();
    const int t = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const RouterLane l = router_lane(W, fmt, D, E);
    const int n = l.n, first = l.first, step = RouterLane::step;
    const float4* xt = reinterpret_cast<const float4*>(x + (size_t)t * D);
    float acc = 0.f;
    for (int batch = 0, u0 = first; u0 < n; ++batch, u0 += step * ROUTER_BATCH) {
        if (batch) router_fetch(W, fmt, D, E, batch, q);
        float4 a[ROUTER_BATCH], b[ROUTER_BATCH];
#pragma unroll
        for (int j = 0; j < ROUTER_BATCH; ++j) {
            const int u = u0 + j * step;
            const bool in = u < n;
            a[j] = in ? xt[fmt == 0 ? u : 2 * u] : make_float4(0.f, 0.f, 0.f, 0.f);
            b[j] = in && fmt != 0 ? xt[2 * u + 1] : make_float4(0.f, 0.f, 0.f, 0.f);
        }
#pragma unroll
        for (int j = 0; j < ROUTER_BATCH; ++j) acc = router_dot16(q[j], fmt, a[j], b[j], acc);
    }
    for (int o = 16; o > 0; o >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (lane == 0) part[warp] = acc;
    __syncthreads();
    const int r = blockIdx.x * ROUTER_ROWS + threadIdx.x;
    if (threadIdx.x < ROUTER_ROWS && r < E) {
        float s = 0.f;
        for (int i = 0; i < ROUTER_SPLIT; ++i) s += part[threadIdx.x * ROUTER_SPLIT + i];
        logits[(size_t)t * E + r] = s;
        __threadfence();  // visible to the block that counts last
    }
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(count + t, 1) == (int)gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    if (threadIdx.x == 0) count[t] = 0;  // every block has counted: ready for the next launch
    __threadfence();
    if (fixed) {
        const size_t row = fixed_rows ? (size_t)fixed_rows[t] : (size_t)t;
        route_fixed(logits + (size_t)t * E, fixed + row * k, kind, k, normalize, scale, idx + (size_t)t * k,
                    w + (size_t)t * k);
        return;
    }
    route_choose(logits + (size_t)t * E, bias, kind, E, k, normalize, scale, idx + (size_t)t * k, w + (size_t)t * k,
                 choice);
}
