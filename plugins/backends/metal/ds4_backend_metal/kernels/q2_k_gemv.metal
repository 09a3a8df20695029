// Gathered GEMV over Q2_K expert rows: y[p, o] = sum_i W[expert[p], o, i] * x[p, i].
// Body of an mx.fast.metal_kernel. One SIMD group (32 lanes) per output; lanes stride over 16-wide sub-blocks.
// Block (84 bytes, 256 weights): 16 scale bytes (low nibble scale, high nibble min), 64 code bytes, f16 d, f16 dmin.
// Weight i = 128h + 32j + l holds bits 2j..2j+1 of code byte 32h + l; its sub-block is i / 16;
// weight = d * (sc & 15) * q - dmin * (sc >> 4).
// Template constants: O (rows per expert), NB (blocks per row), RB (bytes per row).
uint lane = thread_position_in_grid.x % 32;
uint o = thread_position_in_grid.x / 32;
uint p = thread_position_in_grid.y;
const device uint8_t* row = blocks + (size_t(expert[p]) * O + o) * RB;
const device float* xr = x + size_t(p) * (NB * 256);
float acc = 0.0f;
for (uint g = lane; g < NB * 16; g += 32) {
    const device uint8_t* blk = row + (g / 16) * 84;
    uint sb = g % 16;
    float d = float(as_type<half>(ushort(uint(blk[80]) | (uint(blk[81]) << 8))));
    float dmin = float(as_type<half>(ushort(uint(blk[82]) | (uint(blk[83]) << 8))));
    uint sc = blk[sb];
    float scale = d * float(sc & 15);
    float offset = dmin * float(sc >> 4);
    uint shift = 2 * ((sb % 8) / 2);
    const device uint8_t* qs = blk + 16 + 32 * (sb / 8) + (sb % 2) * 16;
    const device float* xg = xr + (g / 16) * 256 + sb * 16;
    for (uint l = 0; l < 16; ++l) {
        float q = float((uint(qs[l]) >> shift) & 3);
        acc += (scale * q - offset) * xg[l];
    }
}
acc = simd_sum(acc);
if (lane == 0) {
    y[size_t(p) * O + o] = acc;
}
