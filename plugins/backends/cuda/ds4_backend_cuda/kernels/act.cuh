// Writers of an int8 activation in I8Act's layout (kernels/quant_int8.cu): n columns as n int8 codes, then each
// 32-column group's two half sums (float2), then its scale (float). A kernel whose output is an int8 GEMV's input
// writes it so, as the GEMV's own prologue (quantize_shared) would quantize it, bit for bit: the same amax, the same
// rounding, the half sums added in the same order (pairs, quads, eights, sixteens). The GEMV then reads the codes
// instead of quantizing the row in each of its blocks. Prepended to every module after reduce.cuh.

// Columns r .. r + 31 of n, lane l holding column r + l; by a whole warp, r a multiple of 32.
__device__ __forceinline__ void write_group(float v, int r, int n, unsigned char* __restrict__ act) {
    const int lane = threadIdx.x & 31;
    float amax = fabsf(v), sum = v;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
#pragma unroll
    for (int o = 1; o <= 8; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
    const float other = __shfl_xor_sync(0xffffffffu, sum, 16);
    unsigned code = (unsigned)(__float2int_rn(v * (amax > 0.f ? 127.0f / amax : 0.f)) & 255) << (8 * (lane & 3));
    code |= __shfl_xor_sync(0xffffffffu, code, 1);
    code |= __shfl_xor_sync(0xffffffffu, code, 2);
    if ((lane & 3) == 0) *reinterpret_cast<unsigned*>(act + r + lane) = code;
    if (lane == 0) {
        reinterpret_cast<float2*>(act + n)[r / 32] = make_float2(sum, other);
        reinterpret_cast<float*>(act + n + n / 4)[r / 32] = amax / 127.0f;
    }
}

// Column quad d (columns 4d .. 4d + 3 of n) held by one lane, eight neighbouring lanes a group; by a whole warp,
// n a multiple of 32. Quads past the row's end hold zeros and write nothing.
__device__ __forceinline__ void write_quad_group(float4 y, int d, int n, unsigned char* __restrict__ act) {
    const int lane = threadIdx.x & 31;
    float amax = fmaxf(fmaxf(fabsf(y.x), fabsf(y.y)), fmaxf(fabsf(y.z), fabsf(y.w)));
#pragma unroll
    for (int o = 1; o < 8; o <<= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    float sum = (y.x + y.y) + (y.z + y.w);
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);  // the 8 columns of a thread of quantize_shared
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);  // its 16: the half sums
    const float other = __shfl_xor_sync(0xffffffffu, sum, 4);
    if (4 * d >= n) return;
    const float inv = amax > 0.f ? 127.0f / amax : 0.f;
    reinterpret_cast<unsigned*>(act)[d] =
        (unsigned)(__float2int_rn(y.x * inv) & 255) | (unsigned)(__float2int_rn(y.y * inv) & 255) << 8 |
        (unsigned)(__float2int_rn(y.z * inv) & 255) << 16 | (unsigned)(__float2int_rn(y.w * inv) & 255) << 24;
    if ((lane & 7) == 0) {
        reinterpret_cast<float2*>(act + n)[d / 8] = make_float2(sum, other);
        reinterpret_cast<float*>(act + n + n / 4)[d / 8] = amax / 127.0f;
    }
}
