// MoE router arithmetic around the device top-k, one launch each instead of about a dozen array operations, or one
// launch in all (route_topk).

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

// route_scores, topk_rank (select.cu) and route_weights for one token per block, E <= blockDim.x experts: thread i
// scores expert i, ranks its choice among the block's in shared memory (ties to the lower index, NaN as -inf) and,
// when the rank is below k, writes id and score to that place; the first k threads then weigh the chosen scores as
// route_weights does, in the same order. idx, w [T, k]; dynamic shared memory E + k floats.
extern "C" __global__ void route_topk(const float* __restrict__ logits, const float* __restrict__ bias, int kind,
                                      int E, int k, int normalize, float scale, int* __restrict__ idx,
                                      float* __restrict__ w) {
    grid_wait();
    extern __shared__ float choice[];  // [E], then the chosen scores [k]
    float* chosen = choice + E;
    const int t = blockIdx.x, i = threadIdx.x;
    float s = 0.f, c = NEG_INF;
    if (i < E) {
        s = route_score(logits[(size_t)t * E + i], kind);
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
        idx[(size_t)t * k + r] = i;
        chosen[r] = s;
    }
    __syncthreads();
    if (i < k) {
        float sum = 0.f;
        for (int q = 0; q < k; ++q) sum += chosen[q];
        w[(size_t)t * k + i] = (normalize ? chosen[i] / (sum + 1e-20f) : chosen[i]) * scale;
    }
}
