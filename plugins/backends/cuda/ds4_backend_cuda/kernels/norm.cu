// RMSNorm and interleaved RoPE as one launch each. As CuPy array code they cost about 5 and 12 launches per call,
// and a decode step calls them a few dozen times, so in a recorded graph their launch gaps outweighed the work.

// y[r] = x[r] / sqrt(mean(x[r]^2) + eps) [· w] for rows of width d; one block per row (blockDim.x a multiple of 32,
// at most 1024); w may be null. A thread's first HELD elements and their weights are loaded at once and kept in
// registers for the second pass (a strided loop would wait for each load in turn, and weights loaded after the sum
// add a second memory round trip to a launch of a few µs); wider rows loop over the rest. With pos non-null the
// normalised row is also RoPE'd as rope_rows does (row r of token r / rows_per_token; d <= HELD · blockDim.x): a
// pair's two channels are held by neighbouring lanes.
#define HELD 8
extern "C" __global__ void rms_norm_rows(const float* __restrict__ x, const float* __restrict__ w, int d, float eps,
                                         float* __restrict__ y, const int* __restrict__ pos,
                                         const float* __restrict__ inv_freq, int half, int rows_per_token) {
    grid_wait();
    __shared__ float partial[32];
    const float* xr = x + (size_t)blockIdx.x * d;
    float v[HELD], g[HELD];
    float ss = 0.f;
#pragma unroll
    for (int k = 0; k < HELD; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        v[k] = i < d ? xr[i] : 0.f;
        g[k] = w && i < d ? w[i] : 1.f;
    }
#pragma unroll
    for (int k = 0; k < HELD; ++k) ss = fmaf(v[k], v[k], ss);
    for (int i = threadIdx.x + HELD * blockDim.x; i < d; i += blockDim.x) ss = fmaf(xr[i], xr[i], ss);
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if (lane == 0) partial[warp] = ss;
    __syncthreads();
    if (warp == 0) {
        ss = lane < warps ? partial[lane] : 0.f;
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if (lane == 0) partial[0] = ss;
    }
    __syncthreads();
    const float root = sqrtf(partial[0] / (float)d + eps);
    float* yr = y + (size_t)blockIdx.x * d;
    const float p = pos ? (float)pos[blockIdx.x / rows_per_token] : 0.f;
#pragma unroll
    for (int k = 0; k < HELD; ++k) {
        const int i = threadIdx.x + k * blockDim.x;
        float out = v[k] / root * g[k];
        if (pos) {  // the same for the whole block
            const float partner = __shfl_xor_sync(0xffffffffu, out, 1);  // channel i ^ 1
            const int j = i - (d - 2 * half);
            if (j >= 0 && i < d) {
                float s, co;
                sincosf(p * inv_freq[j >> 1], &s, &co);
                out = (j & 1) ? partner * s + out * co : out * co - partner * s;
            }
        }
        if (i < d) yr[i] = out;
    }
    for (int i = threadIdx.x + HELD * blockDim.x; i < d; i += blockDim.x) yr[i] = w ? xr[i] / root * w[i] : xr[i] / root;
}

// Rotation of the trailing 2·half channels of each row of width d, pairs (2i, 2i+1) by pos[t] · inv_freq[i]
// (backwards when inverse); the leading channels are copied. Rows are grouped per token: row r belongs to token
// r / rows_per_token. One thread per element; n = all elements.
extern "C" __global__ void rope_rows(const float* __restrict__ x, const int* __restrict__ pos,
                                     const float* __restrict__ inv_freq, long long n, int d, int half,
                                     int rows_per_token, int inverse, float* __restrict__ y) {
    grid_wait();
    const long long e = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n) return;
    const int c = (int)(e % d);
    const int j = c - (d - 2 * half);
    if (j < 0) {
        y[e] = x[e];
        return;
    }
    const long long row = e / d;
    const float angle = (float)pos[row / rows_per_token] * inv_freq[j >> 1];
    float s, co;
    sincosf(angle, &s, &co);
    if (inverse) s = -s;
    const float a = x[e - (j & 1)], b = x[e - (j & 1) + 1];
    y[e] = (j & 1) ? a * s + b * co : a * co - b * s;
}
