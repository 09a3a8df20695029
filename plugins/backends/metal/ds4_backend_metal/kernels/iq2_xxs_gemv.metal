// Gathered GEMV over IQ2_XXS expert rows: y[p, o] = sum_i W[expert[p], o, i] * x[p, i].
// Body of an mx.fast.metal_kernel. One SIMD group (32 lanes) per output; lanes stride over the 32-wide groups.
// Block (66 bytes, 256 weights): f16 d, then 8 groups of 8 bytes: 4 grid indices, then a u32 whose
// bits 0-27 are four 7-bit sign indices and bits 28-31 the group scale s; weight = d*(s+0.5)/4 * grid * sign.
// Template constants: O (rows per expert), NB (blocks per row), RB (bytes per row).
uint lane = thread_position_in_grid.x % 32;
uint o = thread_position_in_grid.x / 32;
uint p = thread_position_in_grid.y;
const device uint8_t* row = blocks + (size_t(expert[p]) * O + o) * RB;
const device float* xr = x + size_t(p) * (NB * 256);
float acc = 0.0f;
for (uint g = lane; g < NB * 8; g += 32) {
    const device uint8_t* blk = row + (g / 8) * 66;
    float d = float(as_type<half>(ushort(uint(blk[0]) | (uint(blk[1]) << 8))));
    const device uint8_t* q = blk + 2 + (g % 8) * 8;
    uint aux = uint(q[4]) | (uint(q[5]) << 8) | (uint(q[6]) << 16) | (uint(q[7]) << 24);
    float s = d * (float(aux >> 28) + 0.5f) * 0.25f;
    const device float* xg = xr + (g / 8) * 256 + (g % 8) * 32;
    for (uint k = 0; k < 4; ++k) {
        uint gi = uint(q[k]) * 8;
        uint si = ((aux >> (7 * k)) & 127) * 8;
        for (uint e = 0; e < 8; ++e) {
            acc += s * grid_table[gi + e] * sign_table[si + e] * xg[k * 8 + e];
        }
    }
}
acc = simd_sum(acc);
if (lane == 0) {
    y[size_t(p) * O + o] = acc;
}
