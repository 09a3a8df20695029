// One decode token through a DeepSeek V4 compressor (ds4_model_deepseek4's Compressor.step, spec §5.3-5.4) in one
// launch; as array code it was about twenty small launches, two or three times per layer.
//
// The token's kv and gate (+ ape) rows go to ring slot pos % m. Each channel c < d pools the window: the softmax of
// the gates over the slots weights the kv values; an overlapping compressor (CSA, rows of 2d) pools 2m slots, the
// previous window's first halves (prev_*) then this window's second halves. The pooled row is RMSNormed, RoPE'd at
// the window's first position and written to rows[window] only when this token completes the window; an
// overlapping compressor then keeps this window's first halves as prev_*. One block; dynamic shared memory: d floats.
extern "C" __global__ void compress_step(const float* __restrict__ kv_row, const float* __restrict__ gate_row,
                                         const float* __restrict__ ape, const int* __restrict__ pos, int m, int d,
                                         int overlap, float* __restrict__ buf_kv, float* __restrict__ buf_gate,
                                         float* __restrict__ prev_kv, float* __restrict__ prev_gate,
                                         float* __restrict__ rows, int n_rows, const float* __restrict__ norm,
                                         float eps, const float* __restrict__ inv_freq, int half) {
    extern __shared__ float pooled[];
    __shared__ float partial[32];
    const int width = overlap ? 2 * d : d, p = pos[0], slot = p % m, window = min(p / m, n_rows - 1);
    const bool complete = slot == m - 1;
    for (int c = threadIdx.x; c < width; c += blockDim.x) {
        buf_kv[slot * width + c] = kv_row[c];
        buf_gate[slot * width + c] = gate_row[c] + ape[slot * width + c];
    }
    __syncthreads();
    if (n_rows > 0) {
        const int slots = overlap ? 2 * m : m, first = overlap ? m : 0, shift = overlap ? d : 0;
        float ss = 0.f;
        for (int c = threadIdx.x; c < d; c += blockDim.x) {
            // slot s < m of an overlapping compressor is row s of prev_* [m, d]; the others buf_* [m, width] (+d)
            const auto gate = [&](int s) {
                return overlap && s < m ? prev_gate[s * d + c] : buf_gate[(s - first) * width + shift + c];
            };
            const auto value = [&](int s) {
                return overlap && s < m ? prev_kv[s * d + c] : buf_kv[(s - first) * width + shift + c];
            };
            float peak = __int_as_float(0xff800000), sum = 0.f, acc = 0.f;
            for (int s = 0; s < slots; s++) peak = fmaxf(peak, gate(s));
            for (int s = 0; s < slots; s++) sum += expf(gate(s) - peak);
            for (int s = 0; s < slots; s++) acc += expf(gate(s) - peak) / sum * value(s);
            pooled[c] = acc;
            ss = fmaf(acc, acc, ss);
        }
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
        for (int c = threadIdx.x; c < d; c += blockDim.x) pooled[c] = pooled[c] / root * norm[c];
        __syncthreads();
        if (complete) {
            for (int c = threadIdx.x; c < d; c += blockDim.x) {
                const int j = c - (d - 2 * half);
                float y = pooled[c];
                if (j >= 0) {
                    float s, co;
                    sincosf((float)(window * m) * inv_freq[j >> 1], &s, &co);
                    const float a = pooled[c - (j & 1)], b = pooled[c - (j & 1) + 1];
                    y = (j & 1) ? a * s + b * co : a * co - b * s;
                }
                rows[window * d + c] = y;
            }
        }
    }
    if (overlap && complete) {  // every read of prev_* above is done (the barriers after the pooling)
        __syncthreads();
        for (int e = threadIdx.x; e < m * d; e += blockDim.x) {
            const int s = e / d, c = e % d;
            prev_kv[e] = buf_kv[s * width + c];
            prev_gate[e] = buf_gate[s * width + c];
        }
    }
}
