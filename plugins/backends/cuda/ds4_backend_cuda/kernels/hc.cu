// The hyper-connection split of one token's mix row (spec §3): pre and post gates, and the Sinkhorn-balanced
// n×n combination. Array code spends ~5 launches per Sinkhorn iteration on a few dozen floats, about a hundred per
// layer and mix; here one thread does a whole token (n ≤ 8), so a decode step records one launch instead.
//
// mix [T, (2+n)·n], scale [3], base [(2+n)·n] -> pre [T, n], post [T, n], comb [T, n, n]; grid ceil(T / blockDim.x).

#define HC_MAX 8

__device__ __forceinline__ float hc_sigmoid(float x) { return 1.f / (1.f + expf(-x)); }

extern "C" __global__ void hc_split(const float* __restrict__ mix, const float* __restrict__ scale,
                                    const float* __restrict__ base, int T, int n, int iters, float eps,
                                    float* __restrict__ pre, float* __restrict__ post, float* __restrict__ comb) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T) return;
    const float* m = mix + (size_t)t * (2 + n) * n;
    for (int i = 0; i < n; ++i) {
        pre[t * n + i] = hc_sigmoid(m[i] * scale[0] + base[i]) + eps;
        post[t * n + i] = 2.f * hc_sigmoid(m[n + i] * scale[1] + base[n + i]);
    }
    float c[HC_MAX * HC_MAX];
    const float* lm = m + 2 * n;
    const float* lb = base + 2 * n;
    for (int r = 0; r < n; ++r) {  // row softmax, then + eps
        float peak = -3.402823466e38f;
        for (int k = 0; k < n; ++k) {
            c[r * n + k] = lm[r * n + k] * scale[2] + lb[r * n + k];
            peak = fmaxf(peak, c[r * n + k]);
        }
        float sum = 0.f;
        for (int k = 0; k < n; ++k) {
            c[r * n + k] = expf(c[r * n + k] - peak);
            sum += c[r * n + k];
        }
        for (int k = 0; k < n; ++k) c[r * n + k] = c[r * n + k] / sum + eps;
    }
    for (int it = 0; it < iters; ++it) {
        if (it > 0) {  // the first iteration's row step is the softmax above
            for (int r = 0; r < n; ++r) {
                float sum = 0.f;
                for (int k = 0; k < n; ++k) sum += c[r * n + k];
                for (int k = 0; k < n; ++k) c[r * n + k] /= sum + eps;
            }
        }
        for (int k = 0; k < n; ++k) {
            float sum = 0.f;
            for (int r = 0; r < n; ++r) sum += c[r * n + k];
            for (int r = 0; r < n; ++r) c[r * n + k] /= sum + eps;
        }
    }
    for (int i = 0; i < n * n; ++i) comb[(size_t)t * n * n + i] = c[i];
}
