// Sparse attention gather: query q[t, h] attends over its own rows idx[t, :] of a shared K=V table kv;
// score (q . kv[r]) * scale, softmax whose denominator also holds exp(sinks[h]) when SINK, weighted sum of kv[r].
// Rows listed as -1 are skipped. One SIMD group (32 lanes) per (head h, token t); lane l owns channels
// l, l + 32, ... of the query, the row and the accumulator, so each row is read once, coalesced.
// Online softmax over the rows in order: running max m, denominator l, accumulator acc, both rescaled by
// exp(m_old - m_new) when the max grows. Without a sink m starts at -inf (exp(-inf) = 0 in the default "safe"
// math mode), so a query that sees no row and no sink gives 0/0, as the MLX-op path does.
// Body of an mx.fast.metal_kernel. Template constants: D (head dim), SINK (the sinks join the denominator).
// Inputs q [T, H, D], kv [N, D], idx [T, K] int32, sinks [H], scale [1]; output out [T, H, D].
constexpr uint C = (D + 31) / 32;
uint lane = thread_position_in_grid.x % 32;
uint h = thread_position_in_grid.y;
uint t = thread_position_in_grid.z;
uint heads = q_shape[1];
uint rows = idx_shape[1];
const device float* qr = q + (size_t(t) * heads + h) * D;
const device int* picked = idx + size_t(t) * rows;
float qc[C];
float acc[C];
for (uint i = 0; i < C; ++i) {
    uint c = lane + 32 * i;
    qc[i] = c < D ? qr[c] : 0.0f;
    acc[i] = 0.0f;
}
float m = SINK ? sinks[h] : -INFINITY;
float l = SINK ? 1.0f : 0.0f;
float sc = scale[0];
for (uint j = 0; j < rows; ++j) {
    int r = picked[j];
    if (r < 0) continue;
    const device float* kr = kv + size_t(r) * D;
    float kc[C];
    float part = 0.0f;
    for (uint i = 0; i < C; ++i) {
        uint c = lane + 32 * i;
        kc[i] = c < D ? kr[c] : 0.0f;
        part += qc[i] * kc[i];
    }
    float s = simd_sum(part) * sc;
    float m_new = max(m, s);
    float decay = metal::exp(m - m_new);
    float p = metal::exp(s - m_new);
    l = l * decay + p;
    for (uint i = 0; i < C; ++i) {
        acc[i] = acc[i] * decay + p * kc[i];
    }
    m = m_new;
}
device float* o = out + (size_t(t) * heads + h) * D;
for (uint i = 0; i < C; ++i) {
    uint c = lane + 32 * i;
    if (c < D) o[c] = acc[i] / l;
}
