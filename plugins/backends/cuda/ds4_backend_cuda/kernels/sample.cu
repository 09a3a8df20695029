// Sampling on the device (ds4_backend_cuda/sampling.py): the argmax of a logit row, and the few candidates the
// sampler chain can keep, so that a decode step brings back a token id or a short list instead of the whole row.
//
// Each kernel but argmax_blocks is one block of blockDim.x threads (a multiple of 32, at most 1024) over one float32
// row of n logits.
// Logits compare as the host sampler's numpy arrays do: NaN counts as -inf and -0 equals +0. Both kernels read them
// as unsigned keys ordered like those floats, so that equal logits have equal keys.

#define NEG_INF __int_as_float(0xff800000)  // NVRTC has no math.h, so no INFINITY
#define NEG_INF_KEY 0x007fffffu             // order_key(-inf), the least key
#define POS_INF_KEY 0xff800000u             // order_key(+inf), the greatest key

__device__ __forceinline__ unsigned order_key(float v) {
    unsigned bits = __float_as_uint(v);
    if (v != v) bits = 0xff800000u;     // NaN -> -inf
    if (bits == 0x80000000u) bits = 0;  // -0 -> +0
    return (bits & 0x80000000u) ? ~bits : bits | 0x80000000u;
}

__device__ __forceinline__ float key_value(unsigned key) {
    return __uint_as_float((key & 0x80000000u) ? key & 0x7fffffffu : ~key);
}

// The largest v over the block, returned to every thread. scratch: 32 entries of shared memory.
__device__ unsigned long long block_max(unsigned long long v, unsigned long long* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long w = __shfl_xor_sync(0xffffffffu, v, o);
        v = w > v ? w : v;
    }
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x >> 5) ? scratch[lane] : 0ull;
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long w = __shfl_xor_sync(0xffffffffu, v, o);
        v = w > v ? w : v;
    }
    __syncthreads();  // scratch is free again
    return v;
}

// The argmax of a row as one 64-bit word, max-ed by every block into best[0] (zero before the launch): the logit's
// key above the complement of its id, so the greatest word is the largest logit's, the lowest id among equal ones;
// a key of NEG_INF_KEY means every logit is -inf or NaN. Each block takes a grid-stride share of the row, so the whole
// GPU reads it: for DeepSeek V4's 129280 logits, a decode step's serial tail, the call took 64 µs from the host with
// one block of 1024 threads, 40 µs so.
extern "C" __global__ void argmax_blocks(const float* __restrict__ row, int n, unsigned long long* __restrict__ best) {
    __shared__ unsigned long long scratch[32];
    unsigned long long v = 0;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
        const unsigned long long w = ((unsigned long long)order_key(row[i]) << 32) | (0xffffffffu - (unsigned)i);
        v = w > v ? w : v;
    }
    v = block_max(v, scratch);
    if (threadIdx.x == 0 && v) atomicMax(best, v);
}

// The key of the k-th largest logit (1 <= k <= n), counting equal logits one by one: radix selection, 8 bits of the
// key per pass, each pass a histogram of the keys that share the digits chosen so far. Called by every thread.
// hist: 256 entries and pick: 2 entries of shared memory.
__device__ unsigned kth_key(const float* __restrict__ row, int n, int k, unsigned* hist, unsigned* pick) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    unsigned prefix = 0, mask = 0, rank = (unsigned)k;  // rank: of the sought key among the keys matching prefix
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int j = threadIdx.x; j < 256; j += blockDim.x) hist[j] = 0;
        __syncthreads();
        for (int base = 0; base < n; base += blockDim.x) {  // whole warps iterate together, for the match below
            const int i = base + threadIdx.x;
            unsigned digit = 256;  // 256: past the row, or a key outside the range still searched
            if (i < n) {
                const unsigned key = order_key(row[i]);
                if ((key & mask) == prefix) digit = (key >> shift) & 255u;
            }
            // real logits crowd into a few digits: one shared atomic per distinct digit of the warp, not per lane
            const unsigned peers = __match_any_sync(0xffffffffu, digit);
            if (digit < 256 && lane == __ffs(peers) - 1) atomicAdd(&hist[digit], (unsigned)__popc(peers));
        }
        __syncthreads();
        if (warp == 0) {  // lane L holds digits 255 - 8L down to 248 - 8L; one lane's group contains the rank
            unsigned group = 0;
            for (int j = 0; j < 8; ++j) group += hist[255 - 8 * lane - j];
            unsigned through = group;  // keys in this group and the groups above it
            for (int o = 1; o < 32; o <<= 1) {
                const unsigned t = __shfl_up_sync(0xffffffffu, through, o);
                if (lane >= o) through += t;
            }
            unsigned above = through - group;
            if (above < rank && rank <= through) {
                for (int j = 0; j < 8; ++j) {
                    const unsigned d = 255 - 8 * lane - j;
                    if (rank <= above + hist[d]) {
                        pick[0] = d;
                        pick[1] = rank - above;
                        break;
                    }
                    above += hist[d];
                }
            }
        }
        __syncthreads();
        prefix |= pick[0] << shift;
        mask |= 255u << shift;
        rank = pick[1];
        __syncthreads();  // pick and hist are rewritten by the next pass
    }
    return prefix;
}

// Every token whose logit is at least the k-th largest (k > 0: top-k is on) and, when use_min_p, at least
// cut = lmax + t_log_min_p - slack, where lmax is the largest logit, t_log_min_p = T ln(min_p) and the slack
// 1e-6 (|lmax| + |T ln(min_p)| + T) covers every rounding of the host's float64 test exp((l - lmax) / T) >= min_p
// with room to spare (a wider set only costs a few more candidates). Both bounds keep every logit equal to one
// they keep, so the set is a prefix of the row in the order (logit descending, id ascending).
// out: int32 [1 + 2 cap]: out[0] the number of candidates (possibly above cap; only cap are written), then
// (id, logit bits) pairs in no particular order, NaN written as -inf. A row whose logits are all -inf or NaN gives
// the single candidate (0, -inf), on which the host chain raises the error it raises for such a row.
extern "C" __global__ void chain_candidates(const float* __restrict__ row, int n, int k, int use_min_p,
                                            double t_log_min_p, double temperature, int cap, int* __restrict__ out) {
    __shared__ unsigned long long scratch[32];
    __shared__ unsigned hist[256];
    __shared__ unsigned pick[2];
    __shared__ int count;
    unsigned long long top = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const unsigned long long key = order_key(row[i]);
        top = key > top ? key : top;
    }
    const unsigned top_key = (unsigned)block_max(top, scratch);
    if (top_key == NEG_INF_KEY) {
        if (threadIdx.x == 0) {
            out[0] = 1;
            out[1] = 0;
            out[2] = __float_as_int(NEG_INF);
        }
        return;
    }
    const unsigned low_key = k > 0 ? kth_key(row, n, k, hist, pick) : 0u;
    double cut = 0.0;
    if (use_min_p) {
        const double lmax = (double)key_value(top_key);
        const double size = (lmax < 0.0 ? -lmax : lmax) + (t_log_min_p < 0.0 ? -t_log_min_p : t_log_min_p);
        cut = top_key == POS_INF_KEY ? lmax : lmax + t_log_min_p - 1e-6 * (size + temperature);
    }
    if (threadIdx.x == 0) count = 0;
    __syncthreads();
    const int lane = threadIdx.x & 31;
    for (int base = 0; base < n; base += blockDim.x) {  // whole warps iterate together, for the ballot below
        const int i = base + threadIdx.x;
        float v = NEG_INF;
        bool keep = false;
        if (i < n) {
            v = row[i];
            keep = order_key(v) >= low_key && (!use_min_p || (double)v >= cut);
        }
        const unsigned ballot = __ballot_sync(0xffffffffu, keep);
        if (ballot == 0) continue;
        int first = 0;  // this warp's first slot: one atomic per warp
        if (lane == 0) first = atomicAdd(&count, __popc(ballot));
        first = __shfl_sync(0xffffffffu, first, 0);
        const int slot = first + __popc(ballot & ((1u << lane) - 1u));
        if (keep && slot < cap) {
            out[1 + 2 * slot] = i;
            out[2 + 2 * slot] = __float_as_int(v != v ? NEG_INF : v);
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) out[0] = count;
}
