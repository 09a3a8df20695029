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
// grid (ceil(n / SELECT_ENTRIES), rows), block (SELECT_ENTRIES, SELECT_SLICES); out [rows, ld]: the P entries of
// head, then k <= n (select_row).
#define SELECT_ENTRIES 32
#define SELECT_SLICES 8
#define SELECT_TILE 1024                                   // scores staged per round: 4 per thread
#define SELECT_SLICE (SELECT_TILE / SELECT_SLICES)         // 128 a warp counts per round

// Row y of out [rows, ld]: its first P entries are head [P] (written by the threads of the row's first block, so
// the caller needs no concatenation), then the k chosen ones; returns where those start.
__device__ __forceinline__ int* select_row(int* out, int ld, const int* __restrict__ head, int P, int threads,
                                           int tid) {
    int* dst = out + (size_t)blockIdx.y * ld;
    if (blockIdx.x == 0)
        for (int i = tid; i < P; i += threads) dst[i] = head[i];
    return dst + P;
}

extern "C" __global__ void __launch_bounds__(SELECT_ENTRIES * SELECT_SLICES) index_select(
        const float* __restrict__ scores, const int* __restrict__ limit, int n, int k, int offset,
        int* __restrict__ out, int ld, const int* __restrict__ head, int P) {
    grid_wait();
    __shared__ float4 tile[SELECT_TILE / 4];
    __shared__ int partial[SELECT_SLICES][SELECT_ENTRIES];
    const float nan = __int_as_float(0x7fffffff);  // compares false: padding past the complete entries counts nothing
    const int x = threadIdx.x, y = threadIdx.y, first = blockIdx.x * SELECT_ENTRIES, i = first + x;
    const float* row = scores + (size_t)blockIdx.y * n;
    int* dst = select_row(out, ld, head, P, SELECT_ENTRIES * SELECT_SLICES, y * SELECT_ENTRIES + x);
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

// index_select's choice in O(n) per row, for long rows (a decode step at a long context ranks ~16K compressed rows,
// where index_select's O(limit^2) count takes tens of microseconds): one block per row.
//  1. Scores become uint32 keys in the same order (NaN as -inf, -0 as +0, so equal floats give equal keys).
//  2. A radix select, RADIX_BITS of the key per pass from the top, counts the complete entries whose key matches the
//     prefix found so far into a shared histogram and keeps the digit where the take-th best falls, until the entries
//     matching the prefix are exactly the ones still wanted (random scores: after two passes; ties: all three).
//  3. The chosen entries (above the prefix, plus the lowest-index ones equal to it: a block scan in index order, only
//     when the boundary splits a tie) are gathered into shared memory as (key, ~index) pairs, which are unique and in
//     the descending order of a stable sort, and a bitonic sort (shuffles within a warp, shared memory across warps)
//     puts them in rank order.
//
// grid (1, rows), block RADIX_THREADS; out [rows, ld] as index_select, k <= RADIX_THREADS (one chosen entry per
// thread in the sort).
#define RADIX_THREADS 1024
#define RADIX_BITS 11
#define RADIX_BINS (1 << RADIX_BITS)  // two per thread in the scan that finds the digit

__device__ __forceinline__ unsigned int select_key(float v) {
    unsigned int b = __float_as_uint(rank_key(v));
    if (b == 0x80000000u) b = 0;  // -0 == +0 as floats: one key
    return (b & 0x80000000u) ? ~b : b | 0x80000000u;  // negatives reversed below the positives
}

// Exclusive prefix sum of v over the block's threads in order; total gets the sum of all. Ends on a barrier, so
// warp_sums can be reused at once.
__device__ __forceinline__ int block_exclusive_sum(int v, int* warp_sums, int& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int inc = v;
    for (int d = 1; d < 32; d <<= 1) {
        const int u = __shfl_up_sync(0xffffffffu, inc, d);
        if (lane >= d) inc += u;
    }
    if (lane == 31) warp_sums[warp] = inc;
    __syncthreads();
    if (warp == 0) {
        int s = warp_sums[lane];
        for (int d = 1; d < 32; d <<= 1) {
            const int u = __shfl_up_sync(0xffffffffu, s, d);
            if (lane >= d) s += u;
        }
        warp_sums[lane] = s;
    }
    __syncthreads();
    const int before = warp ? warp_sums[warp - 1] : 0;
    total = warp_sums[31];
    __syncthreads();
    return before + inc - v;
}

__device__ __forceinline__ unsigned long long shfl_xor_u64(unsigned long long v, int mask) {
    const unsigned int lo = __shfl_xor_sync(0xffffffffu, (unsigned int)v, mask);
    const unsigned int hi = __shfl_xor_sync(0xffffffffu, (unsigned int)(v >> 32), mask);
    return ((unsigned long long)hi << 32) | lo;
}

extern "C" __global__ void __launch_bounds__(RADIX_THREADS) index_select_radix(
        const float* __restrict__ scores, const int* __restrict__ limit, int n, int k, int offset,
        int* __restrict__ out, int ld, const int* __restrict__ head, int P) {
    grid_wait();
    static_assert(RADIX_BINS == 2 * RADIX_THREADS, "the digit scan gives each thread two bins");
    static_assert(RADIX_THREADS == 32 * 32, "block_exclusive_sum scans one warp's worth of warp sums");
    __shared__ int hist[RADIX_BINS];
    __shared__ unsigned long long chosen[RADIX_THREADS];
    __shared__ int warp_sums[32];
    __shared__ int found_digit, found_above, found_count, gathered;
    const int tid = threadIdx.x, lane = tid & 31;
    const float* row = scores + (size_t)blockIdx.y * n;
    int* dst = select_row(out, ld, head, P, RADIX_THREADS, tid);
    const int complete = min(max(limit[blockIdx.y], 0), n);
    const int take = min(k, complete);
    for (int r = take + tid; r < k; r += RADIX_THREADS) dst[r] = -1;
    if (take == 0) return;  // the whole block: no barrier below is left half-reached

    // 2. Entries whose key & mask == prefix are `matching`; `remaining` of them are still to be taken.
    unsigned int prefix = 0, mask = 0;
    int remaining = take, matching = complete;
    for (int pass = 0; pass < 3 && matching > remaining; ++pass) {
        const int shift = pass < 2 ? 32 - RADIX_BITS * (pass + 1) : 0;  // bits 21-31, 10-20, 0-10 (10 known by then)
        for (int b = tid; b < RADIX_BINS; b += RADIX_THREADS) hist[b] = 0;
        __syncthreads();
        for (int base = 0; base < complete; base += RADIX_THREADS) {  // whole warps: the vote needs every lane
            const int i = base + tid;
            const unsigned int key = i < complete ? select_key(row[i]) : 0;
            const unsigned int bin = (key >> shift) & (RADIX_BINS - 1);
            const bool counted = i < complete && (key & mask) == prefix;
            const unsigned int voters = __ballot_sync(0xffffffffu, counted);
            if (counted) {  // one atomic per distinct bin of a warp: the first pass's bins are few for similar scores
                const unsigned int peers = __match_any_sync(voters, bin);
                if (lane == __ffs(peers) - 1) atomicAdd(&hist[bin], __popc(peers));
            }
        }
        __syncthreads();
        const int hi = RADIX_BINS - 1 - 2 * tid;  // thread order runs from the top bin down
        const int count_hi = hist[hi], count_lo = hist[hi - 1];
        int total;
        const int above = block_exclusive_sum(count_hi + count_lo, warp_sums, total);
        if (above < remaining && remaining <= above + count_hi) {
            found_digit = hi, found_above = above, found_count = count_hi;
        } else if (above + count_hi < remaining && remaining <= above + count_hi + count_lo) {
            found_digit = hi - 1, found_above = above + count_hi, found_count = count_lo;
        }
        __syncthreads();
        prefix |= (unsigned int)found_digit << shift;
        mask |= (unsigned int)(RADIX_BINS - 1) << shift;
        remaining -= found_above;
        matching = found_count;
    }

    // 3. Gather the take chosen entries (slots in any order: the sort orders them).
    if (tid == 0) gathered = 0;
    const bool split_tie = matching > remaining;  // the same in every thread
    int equal_before = 0;                         // entries equal to the prefix in earlier rounds
    __syncthreads();
    for (int base = 0; base < complete; base += RADIX_THREADS) {
        const int i = base + tid;
        const unsigned int key = i < complete ? select_key(row[i]) : 0;
        const unsigned int top = key & mask;
        bool take_it = i < complete && top >= prefix;
        if (split_tie) {  // of the entries equal to the prefix only the remaining lowest-index ones
            int round_equal;
            const bool equal = i < complete && top == prefix;
            const int rank = equal_before + block_exclusive_sum(equal, warp_sums, round_equal);
            take_it = i < complete && (top > prefix || (equal && rank < remaining));
            equal_before += round_equal;
        }
        const unsigned int ballot = __ballot_sync(0xffffffffu, take_it);
        int slot = 0;
        if (lane == 0 && ballot) slot = atomicAdd(&gathered, __popc(ballot));
        slot = __shfl_sync(0xffffffffu, slot, 0) + __popc(ballot & ((1u << lane) - 1));
        if (take_it) chosen[slot] = ((unsigned long long)key << 32) | (unsigned int)~i;
    }
    __syncthreads();

    // Bitonic sort, descending, of width >= take pairs (whole warps); the padding 0 is below every real pair.
    int width = 32;
    while (width < take) width <<= 1;
    unsigned long long v = tid < take ? chosen[tid] : 0ull;
    for (int size = 2; size <= width; size <<= 1) {
        for (int stride = size >> 1; stride > 0; stride >>= 1) {
            unsigned long long other;
            if (stride >= 32) {
                __syncthreads();  // every thread has read its last partner
                chosen[tid] = v;
                __syncthreads();
                other = chosen[tid ^ stride];
            } else {
                other = shfl_xor_u64(v, stride);
            }
            // the lower of a pair keeps the larger in a run sorted descending ((tid & size) == 0), the smaller else
            const bool keep_larger = ((tid & stride) == 0) == ((tid & size) == 0);
            v = (keep_larger == (other > v)) ? other : v;
        }
    }
    if (tid < take) dst[tid] = (int)~(unsigned int)v + offset;
}

// DeepSeek V4's index arrays of a one-token step in one launch (ds4_model_deepseek4's compose_step_index): out = the
// ring slot pos % W, the window's rows (slot s where s <= pos, else -1), then for each of the n_specs (m, n) pairs the
// limit (pos + 1) / m and, where n > 0, the window's rows again and W + w for w < n below the limit (else -1). One
// block; pos >= 0.
extern "C" __global__ void step_index(const int* __restrict__ pos, int W, const int2* __restrict__ specs, int n_specs,
                                      int* __restrict__ out) {
    grid_wait();
    const int p = pos[0];
    const auto window = [&](int* rows) {
        for (int s = threadIdx.x; s < W; s += blockDim.x) rows[s] = s <= p ? s : -1;
    };
    if (threadIdx.x == 0) out[0] = p % W;
    window(out + 1);
    int at = 1 + W;
    for (int i = 0; i < n_specs; ++i) {
        const int2 spec = specs[i];
        const int limit = (p + 1) / spec.x;
        if (threadIdx.x == 0) out[at] = limit;
        at += 1;
        if (spec.y > 0) {
            window(out + at);
            for (int w = threadIdx.x; w < spec.y; w += blockDim.x) out[at + W + w] = w < limit ? W + w : -1;
            at += W + spec.y;
        }
    }
}
