// One decode token through a DeepSeek V4 compressor (ds4_model_deepseek4's Compressor.step, spec §5.3-5.4) in two
// launches; as array code it was about twenty small launches, two or three times per layer.
//
// compress_pool: the token's kv and gate (+ ape) rows go to ring slot pos % m, and each channel c < d pools the
// window: the softmax of the gates over the slots weights the kv values; an overlapping compressor (CSA, rows of
// 2d) pools 2m slots, the previous window's first halves (prev_*) then this window's second halves. When the token
// completes the window, an overlapping compressor then keeps this window's first halves as prev_*. A channel
// touches only its own columns, so blocks split the channels, and the threads of a channel split its slots.
// compress_finish: the pooled row is RMSNormed,
// RoPE'd at the window's first position and written to rows[window] when the token completes the window (one
// block; dynamic shared memory: d floats).
#define POOL_CHANNELS 32  // channels of a compress_pool block (threadIdx.x)
#define POOL_GROUPS 8     // slot groups of a channel (threadIdx.y: slots s = y, y + 8, ...), merged in order
#define POOL_LOADS 4      // slots of a group whose loads are in flight together

extern "C" __global__ void __launch_bounds__(POOL_CHANNELS * POOL_GROUPS) compress_pool(
        const float* __restrict__ kv_row, const float* __restrict__ gate_row, const float* __restrict__ ape,
        const int* __restrict__ pos, int m, int d, int overlap, float* __restrict__ buf_kv,
        float* __restrict__ buf_gate, float* __restrict__ prev_kv, float* __restrict__ prev_gate,
        float* __restrict__ pooled) {
    grid_wait();
    __shared__ float part[3][POOL_GROUPS][POOL_CHANNELS];  // each group's (peak, sum, weighted sum)
    const float neg_inf = __int_as_float(0xff800000);
    const int c = blockIdx.x * POOL_CHANNELS + threadIdx.x, y = threadIdx.y;
    const bool live = c < d;  // no early return: every thread reaches the barriers
    const int width = overlap ? 2 * d : d, slot = pos[0] % m;
    if (live && y == 0) {
        for (int k = c; k < width; k += d) {  // this channel's columns: c, and d + c when overlapping
            buf_kv[slot * width + k] = kv_row[k];
            buf_gate[slot * width + k] = gate_row[k] + ape[slot * width + k];
        }
    }
    // slot s < m of an overlapping compressor is row s of prev_* [m, d]; the others rows of buf_* [m, width] (+d),
    // the token's own slot read from its rows (the ring's copy is being written). A thread's slots go POOL_LOADS at
    // a time, their loads in flight together (an HCA window's 128 slots are 16 a thread).
    const int slots = overlap ? 2 * m : m, first = overlap ? m : 0, shift = overlap ? d : 0;
    float peak = neg_inf, sum = 0.f, acc = 0.f;
    for (int s0 = y; live && s0 < slots; s0 += POOL_LOADS * POOL_GROUPS) {  // one pass: rescaled when the peak rises
        float g[POOL_LOADS], v[POOL_LOADS];
#pragma unroll
        for (int u = 0; u < POOL_LOADS; ++u) {
            const int s = s0 + u * POOL_GROUPS, at = (s - first) * width + shift + c;
            const bool old = overlap && s < m, own = !old && s - first == slot;
            g[u] = s >= slots ? neg_inf
                 : old        ? prev_gate[s * d + c]
                 : own        ? gate_row[shift + c] + ape[at]
                              : buf_gate[at];
            v[u] = s >= slots ? 0.f : old ? prev_kv[s * d + c] : own ? kv_row[shift + c] : buf_kv[at];
        }
#pragma unroll
        for (int u = 0; u < POOL_LOADS; ++u) {
            if (g[u] == neg_inf) continue;  // weight 0 (window 0's missing first halves, slots past the window)
            if (g[u] > peak) {
                const float r = expf(peak - g[u]);
                sum *= r;
                acc *= r;
                peak = g[u];
            }
            const float e = expf(g[u] - peak);
            sum += e;
            acc += e * v[u];
        }
    }
    part[0][y][threadIdx.x] = peak;
    part[1][y][threadIdx.x] = sum;
    part[2][y][threadIdx.x] = acc;
    __syncthreads();
    if (live && y == 0) {
        float top = neg_inf, total = 0.f, weighted = 0.f;
        for (int i = 0; i < POOL_GROUPS; i++) top = fmaxf(top, part[0][i][threadIdx.x]);
        for (int i = 0; i < POOL_GROUPS; i++) {
            const float p = part[0][i][threadIdx.x];
            if (p == neg_inf) continue;  // a group that saw no slot with weight
            const float r = expf(p - top);
            total += part[1][i][threadIdx.x] * r;
            weighted += part[2][i][threadIdx.x] * r;
        }
        pooled[c] = weighted / total;
    }
    if (overlap && slot == m - 1 && live) {  // the pooling's reads of prev_* are behind the barrier above
        for (int s = y; s < m; s += POOL_GROUPS) {
            prev_kv[s * d + c] = buf_kv[s * width + c];
            prev_gate[s * d + c] = buf_gate[s * width + c];
        }
    }
}

extern "C" __global__ void compress_finish(const float* __restrict__ pooled, const int* __restrict__ pos, int m,
                                           int d, float* __restrict__ rows, int n_rows,
                                           const float* __restrict__ norm, float eps,
                                           const float* __restrict__ inv_freq, int half) {
    grid_wait();
    extern __shared__ float y[];
    __shared__ float partial[32];
    const int p = pos[0], window = min(p / m, n_rows - 1);
    if (p % m != m - 1) return;  // the window is not complete: nothing to store (the whole block leaves)
    float ss = 0.f;
    for (int c = threadIdx.x; c < d; c += blockDim.x) ss = fmaf(pooled[c], pooled[c], ss);
    for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if ((threadIdx.x & 31) == 0) partial[threadIdx.x >> 5] = ss;
    __syncthreads();
    if (threadIdx.x < 32) {
        ss = threadIdx.x < (blockDim.x >> 5) ? partial[threadIdx.x] : 0.f;
        for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
        if (threadIdx.x == 0) partial[0] = ss;
    }
    __syncthreads();
    const float root = sqrtf(partial[0] / (float)d + eps);
    for (int c = threadIdx.x; c < d; c += blockDim.x) y[c] = pooled[c] / root * norm[c];
    __syncthreads();
    for (int c = threadIdx.x; c < d; c += blockDim.x) {
        const int j = c - (d - 2 * half);
        float out = y[c];
        if (j >= 0) {
            float s, co;
            sincosf((float)(window * m) * inv_freq[j >> 1], &s, &co);
            const float a = y[c - (j & 1)], b = y[c - (j & 1) + 1];
            out = (j & 1) ? a * s + b * co : a * co - b * s;
        }
        rows[window * d + c] = out;
    }
}
