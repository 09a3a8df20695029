// Top-k selection by rank counting. Element i's rank is the number of larger elements plus the equal ones at lower
// indices, so the ranks of a row are a permutation and ties go to the lowest index, the order of a stable
// descending sort. It needs no scratch memory and no host round trip, so a decode step that selects experts or
// compressed rows can be captured in a CUDA graph. Cost is O(n^2 / threads) per row: fine for router logits and
// the indexer's compressed rows at the contexts decode reaches (tens of thousands of rows).
//
// grid (ceil(n / blockDim.x), rows), dynamic shared memory blockDim.x floats. NaN ranks as -inf.

#define NEG_INF __int_as_float(0xff800000)  // NVRTC has no math.h, so no INFINITY

__device__ __forceinline__ float rank_key(float v) { return v != v ? NEG_INF : v; }

extern "C" __global__ void topk_rank(const float* __restrict__ scores, int n, int k, int* __restrict__ out) {
    grid_wait();
    extern __shared__ float tile[];
    const float* row = scores + (size_t)blockIdx.y * n;
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    const float v = i < n ? rank_key(row[i]) : NEG_INF;
    int rank = 0;
    for (int base = 0; base < n; base += blockDim.x) {
        const int j = base + threadIdx.x;
        tile[threadIdx.x] = j < n ? rank_key(row[j]) : NEG_INF;
        __syncthreads();
        const int m = min((int)blockDim.x, n - base);
        for (int q = 0; q < m; ++q) {
            const float w = tile[q];
            rank += (w > v) | ((w == v) & (base + q < i));
        }
        __syncthreads();
    }
    if (i < n && rank < k) out[(size_t)blockIdx.y * k + rank] = i;
}

// The DeepSeek V4 indexer's choice (ds4_model_deepseek4's index_select): of row t's complete entries j < limit[t],
// the k best by the rank of topk_rank, written as j + offset, then -1 in the slots past the complete entries. Only
// complete entries are ranked, so a block past the limit only writes its -1s, and the rest cost O(limit^2).
// The rank count is the hot loop, so it is spread wide: a block ranks SELECT_ENTRIES entries (threadIdx.x, one
// warp's lanes) and each of its SELECT_SLICES warps (threadIdx.y) counts a slice of every tile of scores staged in
// shared memory; a slice wholly before the block's entries ranks ties above (>=), one wholly after below (>), and
// only a slice holding them compares indices. Four counters over float4 reads keep each warp busy; the slices'
// counts are summed at the end.
//
// grid (ceil(n / SELECT_ENTRIES), rows), block (SELECT_ENTRIES, SELECT_SLICES); out [rows, k], k <= n.
#define SELECT_ENTRIES 32
#define SELECT_SLICES 8
#define SELECT_TILE 1024                                   // scores staged per round: 4 per thread
#define SELECT_SLICE (SELECT_TILE / SELECT_SLICES)         // 128 a warp counts per round

extern "C" __global__ void __launch_bounds__(SELECT_ENTRIES * SELECT_SLICES) index_select(
        const float* __restrict__ scores, const int* __restrict__ limit, int n, int k, int offset,
        int* __restrict__ out) {
    grid_wait();
    __shared__ float4 tile[SELECT_TILE / 4];
    __shared__ int partial[SELECT_SLICES][SELECT_ENTRIES];
    const float nan = __int_as_float(0x7fffffff);  // compares false: padding past the complete entries counts nothing
    const int x = threadIdx.x, y = threadIdx.y, first = blockIdx.x * SELECT_ENTRIES, i = first + x;
    const float* row = scores + (size_t)blockIdx.y * n;
    int* dst = out + (size_t)blockIdx.y * k;
    const int complete = min(max(limit[blockIdx.y], 0), n);
    if (y == 0 && i >= complete && i < k) dst[i] = -1;
    if (first >= complete) return;  // the whole block: no barrier below is left half-reached
    const float v = i < complete ? rank_key(row[i]) : NEG_INF;
    float* flat = reinterpret_cast<float*>(tile);
    int r0 = 0, r1 = 0, r2 = 0, r3 = 0;
    for (int base = 0; base < complete; base += SELECT_TILE) {
        for (int s = y * SELECT_ENTRIES + x; s < SELECT_TILE; s += SELECT_ENTRIES * SELECT_SLICES) {
            const int j = base + s;
            flat[s] = j < complete ? rank_key(row[j]) : nan;
        }
        __syncthreads();
        const int lo = base + y * SELECT_SLICE;  // this warp's slice: entries lo, lo + 1, ...
        const float4* w4 = tile + y * (SELECT_SLICE / 4);
        const int quads = lo < complete ? (min(SELECT_SLICE, complete - lo) + 3) >> 2 : 0;
        if (lo + SELECT_SLICE <= first) {  // every entry at a lower index: ties rank above
            for (int q = 0; q < quads; ++q) {
                const float4 w = w4[q];
                r0 += w.x >= v;
                r1 += w.y >= v;
                r2 += w.z >= v;
                r3 += w.w >= v;
            }
        } else if (lo >= first + SELECT_ENTRIES) {  // every entry at a higher index: ties rank below
            for (int q = 0; q < quads; ++q) {
                const float4 w = w4[q];
                r0 += w.x > v;
                r1 += w.y > v;
                r2 += w.z > v;
                r3 += w.w > v;
            }
        } else {  // the slice holding the block's own entries
            const int before = i - lo;  // entries of the slice at lower indices than i
            for (int q = 0; q < quads; ++q) {
                const float4 w = w4[q];
                r0 += (w.x > v) | ((w.x == v) & (4 * q < before));
                r1 += (w.y > v) | ((w.y == v) & (4 * q + 1 < before));
                r2 += (w.z > v) | ((w.z == v) & (4 * q + 2 < before));
                r3 += (w.w > v) | ((w.w == v) & (4 * q + 3 < before));
            }
        }
        __syncthreads();
    }
    partial[y][x] = r0 + r1 + r2 + r3;
    __syncthreads();
    if (y == 0) {
        int rank = 0;
        for (int s = 0; s < SELECT_SLICES; ++s) rank += partial[s][x];
        if (i < complete && rank < k) dst[rank] = i + offset;
    }
}
