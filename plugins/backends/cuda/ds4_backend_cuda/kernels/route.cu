// MoE router arithmetic around the device top-k, one launch each instead of about a dozen array operations.

// scores[i] = sqrt(softplus(logits[i])) (kind 0, DeepSeek V4) or sigmoid(logits[i]) (kind 1, GLM 5.x), and
// choice[i] = scores[i] + bias[i % E] (bias may be null); one thread per element of logits [T, E].
extern "C" __global__ void route_scores(const float* __restrict__ logits, const float* __restrict__ bias, int kind,
                                        long long n, int E, float* __restrict__ scores, float* __restrict__ choice) {
    const long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float l = logits[i];
    const float s = kind == 0 ? sqrtf(l > 20.f ? l : log1pf(expf(fminf(l, 20.f)))) : 1.f / (1.f + expf(-l));
    scores[i] = s;
    choice[i] = bias ? s + bias[i % E] : s;
}

// w[t, j] = scores[t, idx[t, j]], divided by (their sum + 1e-20) when normalize, times scale; one thread per token.
extern "C" __global__ void route_weights(const float* __restrict__ scores, const int* __restrict__ idx, int T, int E,
                                         int k, int normalize, float scale, float* __restrict__ w) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T) return;
    float sum = 0.f;
    for (int j = 0; j < k; ++j) sum += scores[(size_t)t * E + idx[t * k + j]];
    for (int j = 0; j < k; ++j) {
        const float s = scores[(size_t)t * E + idx[t * k + j]];
        w[t * k + j] = (normalize ? s / (sum + 1e-20f) : s) * scale;
    }
}
