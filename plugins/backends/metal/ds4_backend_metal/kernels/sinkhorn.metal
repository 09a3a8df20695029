// mHC Sinkhorn balancing, one thread per token: logits[t] (N x N) -> comb[t].
// Row softmax plus eps, a column pass, then ITERS - 1 row/column passes; each pass divides by (sum + eps).
// Body of an mx.fast.metal_kernel. Template constants: N (streams), ITERS; input eps[1].
uint t = thread_position_in_grid.x;
const device float* L = logits + size_t(t) * N * N;
float c[N][N];
float e = eps[0];
for (uint i = 0; i < N; ++i) {
    float m = -INFINITY;
    for (uint k = 0; k < N; ++k) m = max(m, L[i * N + k]);
    float s = 0.0f;
    for (uint k = 0; k < N; ++k) { c[i][k] = exp(L[i * N + k] - m); s += c[i][k]; }
    for (uint k = 0; k < N; ++k) c[i][k] = c[i][k] / s + e;
}
for (uint it = 0; it < ITERS; ++it) {
    if (it > 0) {
        for (uint i = 0; i < N; ++i) {
            float s = 0.0f;
            for (uint k = 0; k < N; ++k) s += c[i][k];
            for (uint k = 0; k < N; ++k) c[i][k] /= (s + e);
        }
    }
    for (uint k = 0; k < N; ++k) {
        float s = 0.0f;
        for (uint i = 0; i < N; ++i) s += c[i][k];
        for (uint i = 0; i < N; ++i) c[i][k] /= (s + e);
    }
}
device float* out = comb + size_t(t) * N * N;
for (uint i = 0; i < N; ++i)
    for (uint k = 0; k < N; ++k) out[i * N + k] = c[i][k];
