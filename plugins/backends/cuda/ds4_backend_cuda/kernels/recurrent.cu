// Recurrent-layer kernels, float32: the causal depthwise convolution with carried history and the gated delta
// rule token by token (definitions in ds4_core/ops_recurrent.py). Row-major arrays, token-major.

// y[t, c] = sum_j w[c, j] * full[t + j * dilation, c], full = history [span, C] then x [T, C], span = (taps-1)*dilation.
// Also writes the last `span` rows of full to new_history (a separate buffer: rows move up by T).
// Grid: x over channels, y over rows (strided up to max(T, span)).
extern "C" __global__ void short_conv(const float* __restrict__ x, const float* __restrict__ history,
                                      const float* __restrict__ w, int T, int C, int taps, int dilation,
                                      float* __restrict__ y, float* __restrict__ new_history) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const int span = (taps - 1) * dilation;
    const int rows = T > span ? T : span;
    for (int t = blockIdx.y; t < rows; t += gridDim.y) {
        if (t < T) {
            float acc = 0.0f;
            for (int j = 0; j < taps; ++j) {
                const int i = t + j * dilation;
                const float v = i < span ? history[(long long)i * C + c] : x[(long long)(i - span) * C + c];
                acc += v * w[(long long)c * taps + j];
            }
            y[(long long)t * C + c] = acc;
        }
        if (t < span) {
            const int i = T + t;
            new_history[(long long)t * C + c] =
                i < span ? history[(long long)i * C + c] : x[(long long)(i - span) * C + c];
        }
    }
}

// Gated delta rule over T tokens for H heads. One thread owns one value column j of one head's state S [dk, dv]
// and keeps it in registers (DK >= dk, a compile-time bound so the column stays in registers); the token's q, k
// and exp(g) are staged in shared memory for the block. Per token:
//   S[i, j] *= exp(g_i);  u = sum_i S[i, j] k_i;  S[i, j] += k_i * beta * (v_j - u);  o_j = sum_i S[i, j] q_i.
// g is [T, H, dk] when g_per_channel, else [T, H]. Grid: x over column tiles of blockDim.x, y over heads.
template <int DK>
__global__ void delta_rule(const float* __restrict__ q, const float* __restrict__ k, const float* __restrict__ v,
                           const float* __restrict__ g, int g_per_channel, const float* __restrict__ beta,
                           const float* __restrict__ state_in, float* __restrict__ state_out,
                           float* __restrict__ out, int T, int H, int dk, int dv) {
    __shared__ float sq[DK], sk[DK], sdecay[DK];
    const int h = blockIdx.y;
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    const bool active = j < dv;
    const long long head_state = (long long)h * dk * dv;
    float s[DK];
#pragma unroll
    for (int i = 0; i < DK; ++i) s[i] = (active && i < dk) ? state_in[head_state + (long long)i * dv + j] : 0.0f;

    for (int t = 0; t < T; ++t) {
        const long long th = (long long)t * H + h;
        __syncthreads();  // the previous token is done with the shared vectors
        for (int i = threadIdx.x; i < dk; i += blockDim.x) {
            sq[i] = q[th * dk + i];
            sk[i] = k[th * dk + i];
            sdecay[i] = expf(g_per_channel ? g[th * dk + i] : g[th]);
        }
        __syncthreads();
        float u = 0.0f;
#pragma unroll
        for (int i = 0; i < DK; ++i) {
            if (i < dk) {
                s[i] *= sdecay[i];
                u += s[i] * sk[i];
            }
        }
        const float delta = beta[th] * ((active ? v[th * dv + j] : 0.0f) - u);
        float o = 0.0f;
#pragma unroll
        for (int i = 0; i < DK; ++i) {
            if (i < dk) {
                s[i] += sk[i] * delta;
                o += s[i] * sq[i];
            }
        }
        if (active) out[th * dv + j] = o;
    }
    if (active) {
#pragma unroll
        for (int i = 0; i < DK; ++i)
            if (i < dk) state_out[head_state + (long long)i * dv + j] = s[i];
    }
}
