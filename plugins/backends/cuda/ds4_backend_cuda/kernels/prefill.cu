// Prefill kernels around cuBLAS tensor-core GEMMs. Compiled appended to quant.cu, whose format structs
// (Q::decode, QK, BYTES) decode the blocks: weights become 16-bit tiles (fp16 or bf16, chosen per format by
// prefill.py), activations 16-bit with one power-of-two scale, and the routed experts' glue runs on the device
// (gather by expert, SwiGLU, weighted scatter). 16-bit values travel as raw u16 bits.

struct Half {  // IEEE fp16, round to nearest even
    static __device__ __forceinline__ u32 from(float v) { return __half_as_ushort(__float2half_rn(v)); }
};

struct BHalf {  // bfloat16, round to nearest even; a NaN stays a (quiet) NaN
    static __device__ __forceinline__ u32 from(float v) {
        u32 b = __float_as_uint(v);
        if ((b & 0x7FFFFFFFu) > 0x7F800000u) return (b >> 16) | 0x40u;
        return (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
    }
};

template <class O>
__device__ __forceinline__ uint4 pack8(const float* v) {
    return make_uint4(O::from(v[0]) | (O::from(v[1]) << 16), O::from(v[2]) | (O::from(v[3]) << 16),
                      O::from(v[4]) | (O::from(v[5]) << 16), O::from(v[6]) | (O::from(v[7]) << 16));
}

// out[j, r, :] = row r (< nrows) of matrix e = experts[j] (experts null: e = j) of w as O, j = blockIdx.y.
// Matrix e starts at w + e * matrix_bytes, its rows row_bytes apart; ncols % 8 == 0; one thread per 8 values.
template <class Q, class O>
__global__ void dequant16(const u8* __restrict__ w, long long matrix_bytes, long long row_bytes, int nrows, int ncols,
                          const int* __restrict__ experts, long long out_stride, u16* __restrict__ out) {
    int units = ncols / 8;
    long long id = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (id >= (long long)nrows * units) return;
    long long r = id / units;
    int u = (int)(id - r * units);
    long long e = experts ? experts[blockIdx.y] : blockIdx.y;
    constexpr int PARTS = Q::QK / 8;
    const u8* blk = w + e * matrix_bytes + r * row_bytes + (long long)(u / PARTS) * Q::BYTES;
    float v[8];
    Q::decode(blk, u % PARTS, v);
    *reinterpret_cast<uint4*>(out + blockIdx.y * out_stride + r * ncols + 8LL * u) = pack8<O>(v);
}

// The power of two that brings amax into [2^13, 2^14): fp16 then holds every value above 2^-27 * amax as a
// normal number and nothing overflows (1 when amax is 0, infinite or NaN).
__device__ __forceinline__ float up_scale(float amax) {
    if (!(amax > 0.f) || amax > 3.4e38f) return 1.f;
    int e;
    frexpf(amax, &e);  // amax = m * 2^e, m in [0.5, 1)
    return ldexpf(1.f, min(14 - e, 126));
}

// out[i] = x[i] * s as O, s = up_scale(*amax); thread 0 also writes alpha_beta = (1 / s, 0), the GEMM's scalars
// that undo the scale (cuBLAS in device pointer mode).
template <class O>
__global__ void to16(const float* __restrict__ x, long long n, const float* __restrict__ amax,
                     u16* __restrict__ out, float* __restrict__ alpha_beta) {
    float s = up_scale(*amax);
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i == 0) {
        alpha_beta[0] = 1.f / s;
        alpha_beta[1] = 0.f;
    }
    if (i < n) out[i] = (u16)O::from(x[i] * s);
}

// Expert-major padded activations: row (j, m) = (blockIdx.y, blockIdx.x) of out is row pairs[seg_off[j] + m] / k
// of x16 when m < seg_cnt[j] (pairs: (token, slot) ids sorted by expert), zeros otherwise. ncols % 8 == 0.
extern "C" __global__ void gather16(const u16* __restrict__ x16, int ncols, const int* __restrict__ pairs, int k,
                                    const int* __restrict__ seg_off, const int* __restrict__ seg_cnt, int m_pad,
                                    u16* __restrict__ out) {
    int j = blockIdx.y, m = blockIdx.x;
    uint4* dst = reinterpret_cast<uint4*>(out + ((long long)j * m_pad + m) * ncols);
    bool live = m < seg_cnt[j];
    const uint4* src = live ? reinterpret_cast<const uint4*>(x16 + (long long)(pairs[seg_off[j] + m] / k) * ncols)
                            : nullptr;
    for (int c = threadIdx.x; c < ncols / 8; c += blockDim.x) dst[c] = live ? src[c] : make_uint4(0, 0, 0, 0);
}

__device__ __forceinline__ float block_max(float v, float* shared) {  // blockDim.x a multiple of 32, <= 1024
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    int warp = threadIdx.x / 32;
    if ((threadIdx.x & 31) == 0) shared[warp] = v;
    __syncthreads();
    v = 0.f;
    for (int i = 0; i < (int)blockDim.x / 32; i++) v = fmaxf(v, shared[i]);
    return v;
}

__device__ __forceinline__ float swiglu1(float g, float u, float limit) {
    if (limit > 0) {
        g = fminf(g, limit);
        u = fminf(fmaxf(u, -limit), limit);
    }
    return g / (1.0f + expf(-g)) * u;
}

// Row (j, m) of gu holds [gate | up] (2 * R floats): h = swiglu(gate, up) stored as O times the row's power of two
// s, hs = 1 / s (folded into the scatter). Padding rows (m >= seg_cnt[j]) give zeros. One block per row.
template <class O>
__global__ void swiglu16(const float* __restrict__ gu, int R, float limit, const int* __restrict__ seg_cnt, int m_pad,
                         u16* __restrict__ h, float* __restrict__ hs) {
    __shared__ float shared[32];
    long long row = (long long)blockIdx.y * m_pad + blockIdx.x;
    const float* g = gu + row * 2 * R;
    u16* out = h + row * R;
    if ((int)blockIdx.x >= seg_cnt[blockIdx.y]) {
        for (int c = threadIdx.x; c < R; c += blockDim.x) out[c] = 0;
        if (threadIdx.x == 0) hs[row] = 0.f;
        return;
    }
    float amax = 0.f;
    for (int c = threadIdx.x; c < R; c += blockDim.x) amax = fmaxf(amax, fabsf(swiglu1(g[c], g[R + c], limit)));
    float s = up_scale(block_max(amax, shared));
    for (int c = threadIdx.x; c < R; c += blockDim.x) out[c] = (u16)O::from(swiglu1(g[c], g[R + c], limit) * s);
    if (threadIdx.x == 0) hs[row] = 1.f / s;
}

// ypairs[p, :] = y[row, :] * hs[row] * weights[p] for row (j, m) = (blockIdx.y, blockIdx.x), m < seg_cnt[j],
// p = pairs[seg_off[j] + m]. Each pair is written once, so the final sum over a token's k slots is deterministic.
extern "C" __global__ void scatter_pairs(const float* __restrict__ y, int D, const float* __restrict__ hs,
                                         const int* __restrict__ pairs, const float* __restrict__ weights,
                                         const int* __restrict__ seg_off, const int* __restrict__ seg_cnt, int m_pad,
                                         float* __restrict__ ypairs) {
    int j = blockIdx.y, m = blockIdx.x;
    if (m >= seg_cnt[j]) return;
    long long row = (long long)j * m_pad + m;
    int p = pairs[seg_off[j] + m];
    float scale = hs[row] * weights[p];
    const float4* src = reinterpret_cast<const float4*>(y + row * D);
    float4* dst = reinterpret_cast<float4*>(ypairs + (long long)p * D);
    for (int c = threadIdx.x; c < D / 4; c += blockDim.x) {
        float4 v = src[c];
        dst[c] = make_float4(v.x * scale, v.y * scale, v.z * scale, v.w * scale);
    }
}
