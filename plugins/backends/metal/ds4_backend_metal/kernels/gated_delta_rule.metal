// Gated delta rule, token by token: one thread per (value column j, head h). Column S[h, :, j] of the
// state evolves on its own: decay by exp(g), read u = S^T k, write k * beta (v - u), output S^T q.
// Body of an mx.fast.metal_kernel. Template constants: H (heads), DK, DV, GK (1: one log-decay per head,
// DK: one per key channel). Inputs q, k [T, H, DK], v [T, H, DV], g [T, H, GK], beta [T, H],
// state [H, DK, DV]; outputs o [T, H, DV], new_state [H, DK, DV].
uint j = thread_position_in_grid.x;
uint h = thread_position_in_grid.y;
if (j >= DV || h >= H) return;
uint steps = q_shape[0];
for (uint c = 0; c < DK; ++c) {
    uint s = (h * DK + c) * DV + j;
    new_state[s] = state[s];
}
for (uint t = 0; t < steps; ++t) {
    uint row = t * H + h;
    float u = 0.0f;
    for (uint c = 0; c < DK; ++c) {
        uint s = (h * DK + c) * DV + j;
        float decayed = new_state[s] * metal::exp(g[row * GK + (GK == 1 ? 0 : c)]);
        new_state[s] = decayed;
        u += decayed * k[row * DK + c];
    }
    float write = beta[row] * (v[row * DV + j] - u);
    float out = 0.0f;
    for (uint c = 0; c < DK; ++c) {
        uint s = (h * DK + c) * DV + j;
        float updated = new_state[s] + k[row * DK + c] * write;
        new_state[s] = updated;
        out += updated * q[row * DK + c];
    }
    o[row * DV + j] = out;
}
