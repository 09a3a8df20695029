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
