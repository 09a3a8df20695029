// Small batched contractions of decode-sized attention (a few query tokens) without cuBLAS, which CuPy refuses
// inside a CUDA graph capture. The reads of rows shared by all queries hit L2.

// c[t, i, j] = sum_d a[t, i, d] * b[t, j, d]; one warp per output, lanes striding d so the row reads coalesce;
// grid (ceil(J / warps per block), I, T); b_batch = 0 shares b.
extern "C" __global__ void dot_rows(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ c,
                                    int I, int J, int D, long long b_batch) {
    grid_wait();
    const int lane = threadIdx.x & 31;
    const int j = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (j >= J) return;  // whole warps leave together: j is the same for every lane of a warp
    const long long ti = (long long)blockIdx.z * I + blockIdx.y;
    const float* ar = a + ti * D;
    const float* br = b + blockIdx.z * b_batch + (long long)j * D;
    float s = 0.f;
    for (int d = lane; d < D; d += 32) s = fmaf(ar[d], br[d], s);
    for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    if (lane == 0) c[ti * J + j] = s;
}

// c[t, i, d] = sum_j p[t, i, j] * b[t, j, d]; one thread per output, consecutive d in a warp;
// grid (ceil(D / blockDim.x), I, T); b_batch = 0 shares b.
extern "C" __global__ void mix_rows(const float* __restrict__ p, const float* __restrict__ b, float* __restrict__ c,
                                    int I, int J, int D, long long b_batch) {
    grid_wait();
    const int d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= D) return;
    const long long ti = (long long)blockIdx.z * I + blockIdx.y;
    const float* pr = p + ti * J;
    const float* bc = b + blockIdx.z * b_batch + d;
    float s = 0.f;
    for (int j = 0; j < J; ++j) s = fmaf(pr[j], bc[(long long)j * D], s);
    c[ti * D + d] = s;
}

// s[t, j] = scale · sum_h w[t, h] · max(dots[t, h, j], 0) for dots [T, H, J]: the lightning indexer's score from its
// per-head products in one launch (as array code: ReLU, product, sum, scale); one thread per (t, j), heads in order;
// grid (ceil(J / blockDim.x), T).
extern "C" __global__ void relu_head_sum(const float* __restrict__ dots, const float* __restrict__ w, int H, int J,
                                         float scale, float* __restrict__ s) {
    grid_wait();
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= J) return;
    const long long t = blockIdx.y;
    const float* d = dots + t * H * J + j;
    float acc = 0.f;
#pragma unroll 8
    for (int h = 0; h < H; ++h) acc = fmaf(w[t * H + h], fmaxf(d[(long long)h * J], 0.f), acc);
    s[t * J + j] = acc * scale;
}
