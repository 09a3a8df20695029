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

// s[t, j] = scale · sum_h w[t, h] · max(q[t, h] · keys[j], 0) for q [T, H, D], keys [J, D], H <= SCORE_HEADS and
// D % 4 == 0: the lightning indexer's score without the [T, H, J] products in memory. A block takes SCORE_KEYS keys
// of one query row and all its heads, in stages of SCORE_DEPTH channels through shared memory, the next stage's
// loads in flight while the current one is multiplied; each thread keeps a 4-head x 4-key tile of fp32 products, so
// a key is read once per row instead of once per head. Missing heads are zero (their products and weights vanish).
// grid (ceil(J / SCORE_KEYS), T), SCORE_THREADS threads.
#define SCORE_HEADS 64
#define SCORE_KEYS 32
#define SCORE_DEPTH 32
#define SCORE_THREADS (SCORE_HEADS / 4 * SCORE_KEYS / 4)
#define SCORE_Q_LOADS (SCORE_HEADS * SCORE_DEPTH / 4 / SCORE_THREADS)  // float4 loads a thread makes a stage
#define SCORE_K_LOADS (SCORE_KEYS * SCORE_DEPTH / 4 / SCORE_THREADS)

__device__ __forceinline__ float4 score_load(const float* rows, int row, int rows_n, int c, int D) {
    return row < rows_n && c < D ? *reinterpret_cast<const float4*>(rows + (long long)row * D + c)
                                 : make_float4(0.f, 0.f, 0.f, 0.f);
}

__device__ __forceinline__ void score_store(float* col, int stride, float4 v) {
    col[0] = v.x;
    col[stride] = v.y;
    col[2 * stride] = v.z;
    col[3 * stride] = v.w;
}

extern "C" __global__ void __launch_bounds__(SCORE_THREADS) indexer_scores_rows(
        const float* __restrict__ q, const float* __restrict__ keys, const float* __restrict__ w, int H, int J, int D,
        float scale, float* __restrict__ s) {
    grid_wait();
    // channel-major, so a thread's 4 heads (4 keys) are one float4; rows padded by 4 against store conflicts
    __shared__ __align__(16) float qs[SCORE_DEPTH][SCORE_HEADS + 4];
    __shared__ __align__(16) float ks[SCORE_DEPTH][SCORE_KEYS + 4];
    __shared__ float part[SCORE_HEADS / 4][SCORE_KEYS];
    const int tid = threadIdx.x, hg = tid / (SCORE_KEYS / 4), kg = tid % (SCORE_KEYS / 4);
    const long long t = blockIdx.y;
    const int j0 = blockIdx.x * SCORE_KEYS;
    const float* qt = q + t * H * D;
    const float* kb = keys + (long long)j0 * D;
    constexpr int quads = SCORE_DEPTH / 4;  // float4 loads per row and stage; load i is row i / quads
    float4 qn[SCORE_Q_LOADS], kn[SCORE_K_LOADS];
#pragma unroll
    for (int r = 0; r < SCORE_Q_LOADS; ++r) {
        const int i = tid + r * SCORE_THREADS;
        qn[r] = score_load(qt, i / quads, H, 4 * (i % quads), D);
    }
#pragma unroll
    for (int r = 0; r < SCORE_K_LOADS; ++r) {
        const int i = tid + r * SCORE_THREADS;
        kn[r] = score_load(kb, i / quads, J - j0, 4 * (i % quads), D);
    }
    float acc[4][4] = {};
    for (int d0 = 0; d0 < D; d0 += SCORE_DEPTH) {
#pragma unroll
        for (int r = 0; r < SCORE_Q_LOADS; ++r) {
            const int i = tid + r * SCORE_THREADS;
            score_store(&qs[4 * (i % quads)][i / quads], SCORE_HEADS + 4, qn[r]);
        }
#pragma unroll
        for (int r = 0; r < SCORE_K_LOADS; ++r) {
            const int i = tid + r * SCORE_THREADS;
            score_store(&ks[4 * (i % quads)][i / quads], SCORE_KEYS + 4, kn[r]);
        }
        __syncthreads();
        const int next = d0 + SCORE_DEPTH;
        if (next < D) {
#pragma unroll
            for (int r = 0; r < SCORE_Q_LOADS; ++r) {
                const int i = tid + r * SCORE_THREADS;
                qn[r] = score_load(qt, i / quads, H, next + 4 * (i % quads), D);
            }
#pragma unroll
            for (int r = 0; r < SCORE_K_LOADS; ++r) {
                const int i = tid + r * SCORE_THREADS;
                kn[r] = score_load(kb, i / quads, J - j0, next + 4 * (i % quads), D);
            }
        }
#pragma unroll 8
        for (int c = 0; c < SCORE_DEPTH; ++c) {
            const float4 a = *reinterpret_cast<const float4*>(&qs[c][4 * hg]);
            const float4 b = *reinterpret_cast<const float4*>(&ks[c][4 * kg]);
            const float av[4] = {a.x, a.y, a.z, a.w}, bv[4] = {b.x, b.y, b.z, b.w};
#pragma unroll
            for (int h = 0; h < 4; ++h)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[h][j] = fmaf(av[h], bv[j], acc[h][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        float sum = 0.f;
#pragma unroll
        for (int h = 0; h < 4; ++h) {
            const int head = 4 * hg + h;
            if (head < H) sum = fmaf(w[t * H + head], fmaxf(acc[h][j], 0.f), sum);
        }
        part[hg][4 * kg + j] = sum;
    }
    __syncthreads();
    if (tid < SCORE_KEYS && j0 + tid < J) {
        float total = 0.f;
#pragma unroll
        for (int g = 0; g < SCORE_HEADS / 4; ++g) total += part[g][tid];
        s[t * J + j0 + tid] = total * scale;
    }
}

// indexer_scores_rows' scores for few keys, D <= SPREAD_DEPTH: a decode step's few hundred keys fill a dozen of its
// 32-key blocks and leave most multiprocessors idle, so here a block takes SPREAD_KEYS keys of one query row and all
// its heads, a block a multiprocessor at most (ops.py's dispatch). The warps split the channels
// (warp w the float4 quads w, w + SPREAD_WARPS, ...): a lane holds its 4 heads' channels in registers and a 4-head x
// 4-key tile of fp32 products, and the warps' tiles are summed in shared memory before the ReLU. Missing heads are
// zero. grid (ceil(J / SPREAD_KEYS), T), SPREAD_THREADS threads.
#define SPREAD_KEYS 8
#define SPREAD_WARPS 8
#define SPREAD_THREADS (32 * SPREAD_WARPS)
#define SPREAD_QUADS 4  // a warp's float4s of a row: with the other warps', DeepSeek V4's 128 channels
#define SPREAD_DEPTH (4 * SPREAD_WARPS * SPREAD_QUADS)
static_assert(SPREAD_THREADS == SPREAD_KEYS * SPREAD_DEPTH / 4, "a thread stages one float4 of the block's keys");
static_assert(SPREAD_THREADS == SCORE_HEADS / 2 * SPREAD_KEYS, "a thread sums two heads of one key");

extern "C" __global__ void __launch_bounds__(SPREAD_THREADS, 2) indexer_scores_spread(
        const float* __restrict__ q, const float* __restrict__ keys, const float* __restrict__ w, int H, int J, int D,
        float scale, float* __restrict__ s) {
    grid_wait();
    __shared__ float4 ks[SPREAD_KEYS][SPREAD_DEPTH / 4];
    __shared__ __align__(16) float part[SPREAD_WARPS][SCORE_HEADS][SPREAD_KEYS + 4];  // padded against conflicts
    __shared__ float key_sum[SPREAD_WARPS][SPREAD_KEYS];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int h0 = 4 * (lane >> 1), k0 = 4 * (lane & 1);  // this lane's heads h0.. and keys k0.. of the block's
    const int kr = threadIdx.x / (SPREAD_DEPTH / 4), kq = threadIdx.x % (SPREAD_DEPTH / 4);  // the key quad it stages
    const int k = threadIdx.x % SPREAD_KEYS, g = threadIdx.x / SPREAD_KEYS;  // in the sums: key k, heads 2g, 2g + 1
    const long long t = blockIdx.y;
    const int j0 = blockIdx.x * SPREAD_KEYS;
    const float* qt = q + t * H * D;
    const float4 staged = score_load(keys, j0 + kr, J, 4 * kq, D);
    float4 a[SPREAD_QUADS][4];
#pragma unroll
    for (int r = 0; r < SPREAD_QUADS; ++r)
#pragma unroll
        for (int i = 0; i < 4; ++i) a[r][i] = score_load(qt, h0 + i, H, 4 * (warp + r * SPREAD_WARPS), D);
    const float wg[2] = {2 * g < H ? w[t * H + 2 * g] : 0.f, 2 * g + 1 < H ? w[t * H + 2 * g + 1] : 0.f};
    ks[kr][kq] = staged;
    __syncthreads();
    float acc[4][4] = {};
#pragma unroll
    for (int r = 0; r < SPREAD_QUADS; ++r)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float4 b = ks[k0 + j][warp + r * SPREAD_WARPS];
#pragma unroll
            for (int i = 0; i < 4; ++i)
                acc[i][j] = fmaf(a[r][i].w, b.w, fmaf(a[r][i].z, b.z, fmaf(a[r][i].y, b.y,
                            fmaf(a[r][i].x, b.x, acc[i][j]))));
        }
#pragma unroll
    for (int i = 0; i < 4; ++i)
        *reinterpret_cast<float4*>(&part[warp][h0 + i][k0]) = make_float4(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
    __syncthreads();
    float v = 0.f;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
        float dot = 0.f;
#pragma unroll
        for (int x = 0; x < SPREAD_WARPS; ++x) dot += part[x][2 * g + e][k];
        v = fmaf(wg[e], fmaxf(dot, 0.f), v);
    }
#pragma unroll
    for (int o = SPREAD_KEYS; o < 32; o <<= 1) v += __shfl_xor_sync(0xffffffffu, v, o);  // the warp's heads, by key
    if (lane < SPREAD_KEYS) key_sum[warp][lane] = v;
    __syncthreads();
    if (threadIdx.x < SPREAD_KEYS && j0 + threadIdx.x < J) {
        float total = 0.f;
#pragma unroll
        for (int x = 0; x < SPREAD_WARPS; ++x) total += key_sum[x][threadIdx.x];
        s[t * J + j0 + threadIdx.x] = total * scale;
    }
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

// Slot p of dst gets expert idx[p] of the stacked expert tensor src, for the few (token, expert) pairs of a decode
// step whose experts stay in pinned host memory (host_experts.py): whole 128-byte lines over the bus, GATHER_LOADS
// 16-byte loads a thread in flight, where the GEMVs' own reads of host memory are scattered over many rows at once.
// Tensor z of up to three is src[z], dst[z], words[z] (an expert's 16-byte words); slots[p] gets p, or -1 where
// idx[p] is negative (nothing copied: the expert kernels give such a pair zeros). grid (blocks an expert, P, tensors).
#define GATHER_LOADS 4
extern "C" __global__ void gather_experts(const uint4* __restrict__ src0, const uint4* __restrict__ src1,
                                          const uint4* __restrict__ src2, uint4* __restrict__ dst0,
                                          uint4* __restrict__ dst1, uint4* __restrict__ dst2, long long words0,
                                          long long words1, long long words2, const int* __restrict__ idx,
                                          int* __restrict__ slots) {
    grid_wait();
    const int z = blockIdx.z, p = blockIdx.y, e = idx[p];
    if (z == 0 && blockIdx.x == 0 && threadIdx.x == 0) slots[p] = e < 0 ? -1 : p;
    if (e < 0) return;
    const long long words = z == 0 ? words0 : z == 1 ? words1 : words2;
    const uint4* src = (z == 0 ? src0 : z == 1 ? src1 : src2) + e * words;
    uint4* dst = (z == 0 ? dst0 : z == 1 ? dst1 : dst2) + p * words;
    const long long step = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < words; i += GATHER_LOADS * step) {
        uint4 v[GATHER_LOADS];
#pragma unroll
        for (int k = 0; k < GATHER_LOADS; k++)
            if (i + k * step < words) v[k] = src[i + k * step];
#pragma unroll
        for (int k = 0; k < GATHER_LOADS; k++)
            if (i + k * step < words) dst[i + k * step] = v[k];
    }
}
