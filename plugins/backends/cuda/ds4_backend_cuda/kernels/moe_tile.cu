// The routed experts' tile kernels (compiled after quant.cu and prefill.cu): a block takes up to MMA_BN tokens of one
// expert (a tile that moe_tiles lists) and MMA_BM rows of its NW matrices (gate and up, or down) and runs over the
// columns MMA_BK at a time. Each thread decodes its share of the weights straight into the A fragments of the tensor
// cores' 16-row MMAs, in registers; only the activations (B) go through shared memory. The quantized weights are read
// once per token tile and never written back. Two cores multiply: mma.sync (MmaCore, here: any sm_80+ device) and
// Hopper's warpgroup MMA (WgCore, kernels/moe_wgmma.cu, sm_90a only). Decoded tiles in shared memory, read back by
// ldmatrix or wgmma, had kept the L1/shared-memory pipe 77-83% busy.
//
// The column loop is software-pipelined with cp.async (sm_80+), which copies global memory into shared memory
// without holding registers: while the tensor cores multiply step s, the activations of step s + 1 (into the other of
// two B tiles) and, a span ahead, the raw weight blocks (two staging areas) are on their way, so the decode reads
// shared memory rather than waiting on L2 or DRAM.
//
// A 64 x 64 B tile (tokens x columns) of 16-bit values is stored K-major with the 128-byte swizzle: row r's 128
// bytes at r * 128, its 16-byte chunk k8 (columns 8 * k8 .. + 7) at position k8 ^ (r % 8), tiles 1024-byte aligned.
// wgmma reads 8 rows' chunks at once, ldmatrix 8 rows of one chunk; unswizzled, those share banks. The columns of
// every 64 are in the k64 order (k64_position), in which each thread's fragment columns are 16 consecutive weights.

#define MMA_BM 64
#define MMA_BN 64
#define MMA_BK 64
#define MMA_CLD (MMA_BM + 4)  // accumulator tile row stride in floats (token-major)

#define WG_ROW_BYTES 128
#define WG_ATOM_BYTES (8 * WG_ROW_BYTES)  // 8 rows: the swizzle's period, the stride of 8-row groups (SBO)

// Byte offset of row r, columns 8 * k8 .. + 7 of a tile.
__device__ __forceinline__ int wg_offset(int r, int k8) { return r * WG_ROW_BYTES + ((k8 ^ (r & 7)) << 4); }

// Copy N (4, 8 or 16) bytes global -> shared asynchronously; 16-byte copies skip L1 (the weights stream).
template <int N>
__device__ __forceinline__ void cp_async(void* dst, const void* src) {
    u32 addr = (u32)__cvta_generic_to_shared(dst);
    if constexpr (N == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(addr), "l"(src) : "memory");
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(addr), "l"(src), "n"(N) : "memory");
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Wait until at most N of this thread's latest cp.async groups are in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// The staging of raw weight blocks for NW matrices of
// format Q: a span is the columns whose blocks are copied at once (one MMA_BK step, or a whole block when QK > MMA_BK:
// the next copy then comes QK / MMA_BK steps later), WIN the bytes of a row's blocks in a span. Copies of CH bytes
// keep each byte's address modulo CH, at least the alignment a block of BYTES bytes can rely on (blocks lie back to
// back), so Q::decode's wide loads stay aligned in shared memory; a row's window starts up to CH - 1 bytes after a CH
// boundary, hence LD. Whole CH-byte chunks never pass the end of a buffer whose end is CH-aligned (device allocations
// are).
template <class Q, int NW, int CH_>
struct StagePlan {
    static constexpr int SPAN = Q::QK > MMA_BK ? Q::QK : MMA_BK;
    static constexpr int WIN = SPAN / Q::QK * Q::BYTES;
    static constexpr int CH = CH_;
    static constexpr int LD = (WIN + 2 * CH - 2) / CH * CH, RAW = NW * MMA_BM * LD;
};

// Shared memory of the tile kernels (dynamic: more than 48 KB with the accumulators' tiles): two B tiles, so that step
// s + 1's activations copy while the tensor cores multiply step s, and two staging areas (the next span's windows
// copy while this span's decode). BLOCKS: the blocks per SM the registers are capped for (each thread holds 32
// accumulators a matrix and, under wgmma, two steps' A fragments of 16 registers a matrix).
template <class Q, int NW>
struct TilePlan : StagePlan<Q, NW, 16> {
    using Base = StagePlan<Q, NW, 16>;
    static constexpr int TILE = MMA_BN * MMA_BK * 2;  // bytes of a B tile
    static constexpr int USED = 2 * TILE + 2 * Base::RAW, ACC = NW * MMA_BN * MMA_CLD * 4;
    static constexpr int SMEM = (USED > ACC ? USED : ACC) + WG_ATOM_BYTES;  // + the alignment of the tiles
    static constexpr int FIT = 227 * 1024 / SMEM, CAP = NW == 2 ? 3 : 4;
    static constexpr int BLOCKS = FIT < CAP ? FIT : CAP;
};

// The dynamic shared memory the tile kernels of <Q, NW> take, for the host.
template <class Q, int NW>
__global__ void tile_smem(int* out) { *out = TilePlan<Q, NW>::SMEM; }

// One thread's staging: the raw windows of row drow of each of the NW matrices (two threads a row, part 0 and 1, copy
// alternate chunks) into a staging area R. arow[n]: the row's first block in matrix n (w0 or w1).
template <class Q, int NW, class S>
struct TileRows {
    const u8* arow[NW];
    int drow, part;

    __device__ __forceinline__ TileRows(const u8* w0, const u8* w1, long long row_offset, int drow_, int part_)
        : drow(drow_), part(part_) {
        arow[0] = w0 + row_offset;
        if constexpr (NW == 2) arow[1] = w1 + row_offset;
    }

    // Start the cp.async copies of span p's windows into R.
    __device__ __forceinline__ void stage(u8* R, int p) const {
#pragma unroll
        for (int n = 0; n < NW; n++) {
            const u8* win = arow[n] + (long long)p * S::WIN;
            int lead = (int)(reinterpret_cast<unsigned long long>(win) & (S::CH - 1));
            const u8* from = win - lead;
            u8* to = R + (n * MMA_BM + drow) * S::LD;
#pragma unroll
            for (int ch = part; ch < S::LD / S::CH; ch += 2)
                if (ch * S::CH < lead + S::WIN) cp_async<S::CH>(to + ch * S::CH, from + ch * S::CH);
        }
    }
};

// One thread's A fragments (warp w, lane 4g + t): rows 16w + g and 16w + g + 8 of each of the NW matrices, the 16
// columns 16t .. 16t + 15 of each step, decoded from the windows the warp staged (TileRows). lead: the low bits of
// each row's start, which place its windows in the staging area.
template <class Q, int NW, class S>
struct FragRows {
    u32 lead[NW][2];
    int row, t;

    __device__ __forceinline__ FragRows(const u8* w0, const u8* w1, long long expert_offset, int r0, int nrows,
                                        long long row_bytes, int row_, int t_)
        : row(row_), t(t_) {
#pragma unroll
        for (int n = 0; n < NW; n++)
#pragma unroll
            for (int j = 0; j < 2; j++)
                lead[n][j] = (u32) reinterpret_cast<unsigned long long>(
                    (n ? w1 : w0) + expert_offset + (long long)min(r0 + row + 8 * j, nrows - 1) * row_bytes);
    }

    // Step s's fragments of matrix n (R: the staged windows of the step's span): a[q] for the 16-wide slice q.
    template <class O>
    __device__ __forceinline__ void decode(const u8* R, int n, int s, u32 (&a)[4][4]) const {
        const int col = s * MMA_BK + 16 * t, span = col / S::SPAN;
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const u8* base = R + (n * MMA_BM + row + 8 * j) * S::LD + ((lead[n][j] + span * S::WIN) & (S::CH - 1));
            uint4 v[2];  // columns 16t + 8i .. + 7: the pairs of slices 2i (x, y) and 2i + 1 (z, w)
            Decode16<Q, O>::run(base, col % S::SPAN, v);
#pragma unroll
            for (int i = 0; i < 2; i++) {
                a[2 * i][j] = v[i].x;
                a[2 * i][2 + j] = v[i].y;
                a[2 * i + 1][j] = v[i].z;
                a[2 * i + 1][2 + j] = v[i].w;
            }
        }
    }
};

// The tile kernels' epilogue (128 threads) from the accumulators in shared memory, C[n][token][row] (row stride
// MMA_CLD): NW = 2 stores h = swiglu(alpha * gate, alpha * up) at [(first + m) * ldc + r]: as float32 into out, or
// with out16 non-null as O times s16 into out16 (the down projection's operand, its rows in the k64 order; the
// caller's s16 keeps |h| <= limit^2 in range); NW = 1 writes out[p * ldc + r] = alpha * hs[first + m] * weights[p] *
// acc, p = pairs[first + m] (hs null: 1).
template <class O, int NW>
__device__ __forceinline__ void store_tile(const float* C, float a, int r0, int nrows, int first, int cnt,
                                           const int* __restrict__ pairs, float limit, const float* __restrict__ hs,
                                           const float* __restrict__ weights, float* __restrict__ out, int ldc,
                                           u16* __restrict__ out16, float s16) {
    for (int id = threadIdx.x; id < MMA_BN * MMA_BM; id += 128) {
        int m = id / MMA_BM, r = id % MMA_BM;
        if (m >= cnt || r0 + r >= nrows) continue;
        float v = a * C[m * MMA_CLD + r];
        if constexpr (NW == 2) {
            const float h = swiglu1(v, a * C[(MMA_BN + m) * MMA_CLD + r], limit);
            const long long at = (long long)(first + m) * ldc + r0;
            if (out16)
                out16[at + k64_position(r)] = (u16)O::from(h * s16);
            else
                out[at + r] = h;
        } else {
            int p = pairs[first + m];
            out[(long long)p * ldc + r0 + r] = v * (hs ? hs[first + m] : 1.f) * weights[p];
        }
    }
}

// Four 8x8 16-bit matrices from shared memory; lane l gives the address of row l % 8 of matrix l / 8.
__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const void* row) {
    u32 addr = (u32)__cvta_generic_to_shared(row);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

// d += a (16x16, row-major) * b (16x8, column-major), fp32 accumulators; O picks fp16 or bf16 operands.
template <class O>
__device__ __forceinline__ void mma16816(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1);

template <>
__device__ __forceinline__ void mma16816<Half>(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma16816<BHalf>(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// mma.sync m16n8k16: each warp multiplies its 16 rows (the same fragments as wgmma's) by the 64 tokens, eight n8
// blocks whose B fragments ldmatrix reads from the swizzled tile; accumulator 4j + i of a matrix is block j's
// register i, which is where wgmma's m64n64 puts the same row and token. Synchronous: the fragments are free once
// the MMAs return.
struct MmaCore {
    template <int NW>
    static __device__ __forceinline__ void settle(const u32 (&)[NW][4][4]) {}

    template <int NW>
    static __device__ __forceinline__ void finish(float (&)[NW][32]) {}

    template <class O, int NW>
    static __device__ __forceinline__ void multiply(float (&acc)[NW][32], const u32 (&a)[NW][4][4], const u8* Bs,
                                                    int lane) {
#pragma unroll
        for (int q = 0; q < MMA_BK / 16; q++)
#pragma unroll
            for (int j = 0; j < MMA_BN / 16; j++) {
                u32 b[4];  // tokens 16j .. + 7 (regs 0-1: columns 16q .. + 7, + 8 .. + 15), then 16j + 8 .. + 15
                ldmatrix_x4(b, Bs + wg_offset(16 * j + (lane & 7) + 8 * (lane >> 4), 2 * q + ((lane >> 3) & 1)));
#pragma unroll
                for (int n = 0; n < NW; n++)
#pragma unroll
                    for (int h = 0; h < 2; h++)
                        mma16816<O>(*reinterpret_cast<float(*)[4]>(&acc[n][4 * (2 * j + h)]), a[n][q], b[2 * h],
                                    b[2 * h + 1]);
            }
    }
};

// The first index i of sorted[0 .. n) with sorted[i] >= v (sorted ascending).
__device__ __forceinline__ int lower_bound(const int* __restrict__ sorted, int n, int v) {
    int lo = 0, hi = n;
    while (lo < hi) {
        const int mid = (lo + hi) / 2;
        if (sorted[mid] < v) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

// The tile kernels' tiles from the pairs' expert ids sorted[0 .. n) (ascending; ids >= E, slots without an expert,
// last): tiles[3 i ..] = (expert, first sorted pair, tokens <= MMA_BN), each expert's pairs in tiles of MMA_BN,
// experts in order; slots from the last tile up to max_tiles get no tokens. On the device, so a prefill's MoE reads nothing back
// to the host (the counts were a host synchronisation per layer). One block of at most 1024 threads.
extern "C" __global__ void moe_tiles(const int* __restrict__ sorted, int n, int E, int* __restrict__ tiles,
                                     int max_tiles) {
    __shared__ int scan[1024];
    int base = 0;  // tiles of the experts before this round's
    for (int e0 = 0; e0 < E; e0 += blockDim.x) {
        const int e = e0 + threadIdx.x;
        const int first = e < E ? lower_bound(sorted, n, e) : 0;
        const int cnt = e < E ? lower_bound(sorted, n, e + 1) - first : 0;
        const int own = (cnt + MMA_BN - 1) / MMA_BN;
        scan[threadIdx.x] = own;
        __syncthreads();
        for (int off = 1; off < (int)blockDim.x; off <<= 1) {  // inclusive prefix sum
            const int add = (int)threadIdx.x >= off ? scan[threadIdx.x - off] : 0;
            __syncthreads();
            scan[threadIdx.x] += add;
            __syncthreads();
        }
        const int t0 = base + scan[threadIdx.x] - own;
        for (int i = 0; i < own; i++) {
            tiles[3 * (t0 + i)] = e;
            tiles[3 * (t0 + i) + 1] = first + MMA_BN * i;
            tiles[3 * (t0 + i) + 2] = min(MMA_BN, cnt - MMA_BN * i);
        }
        base += scan[blockDim.x - 1];
        __syncthreads();
    }
    for (int i = base + threadIdx.x; i < max_tiles; i += blockDim.x) {
        tiles[3 * i] = 0;
        tiles[3 * i + 1] = 0;
        tiles[3 * i + 2] = 0;
    }
}

// The tile kernels' parameters (moe_tile16, and the entries moe_mma16 and moe_wgmma16).
#define MOE_TILE_PARAMS                                                                                              \
    const u8 *__restrict__ w0, const u8 *__restrict__ w1, long long expert_bytes, long long row_bytes, int nrows,    \
        int ncols, const int *__restrict__ tiles, const u16 *__restrict__ x16, const int *__restrict__ pairs, int k, \
        int gather, const float *__restrict__ alpha, float limit, const float *__restrict__ hs,                      \
        const float *__restrict__ weights, float *__restrict__ out, int ldc, u16 *__restrict__ out16, float s16
#define MOE_TILE_ARGS                                                                                              \
    w0, w1, expert_bytes, row_bytes, nrows, ncols, tiles, x16, pairs, k, gather, alpha, limit, hs, weights, out, ldc, \
        out16, s16

// One expert, one token tile (see the top of this file): NW = 2 multiplies the gate and up matrices (w0, w1), NW = 1
// multiplies w0; the results leave through store_tile. tiles[3 * blockIdx.y ..] = (expert, first sorted pair, token
// count <= MMA_BN). Token m's activations are row gather ? pairs[first + m] / k : first + m of x16 [*, ncols] (16-bit
// bits, k64 order). ncols % MMA_BK == 0 and a block of the format never straddles an MMA_BK step (QK a multiple or
// divisor of MMA_BK). The row 16 * warp + lane % 16 of each matrix is staged by two lanes of one warp, lane / 16 the
// part (TileRows), and read by lanes of the same warp (FragRows), so a span's first step needs only __syncwarp.
// Thread tid copies activation units u = tid + 128i: token u % 8 + 8 * (u / 64), columns 8 * (u / 8 % 8) .. + 7 (a
// quarter-warp writes one chunk of 8 tokens, free of bank conflicts, and a warp reads 64 contiguous bytes of each of 8
// tokens).
// Step s: at a span's first step, wait for its windows (copied a span earlier) and sync the warp; decode into the A
// fragments of s & 1 (registers of their own: under wgmma those of step s - 1 are still being read; a single set,
// rewritten while the tensor cores read it, gave NaNs); wait for the activations of s (Core::settle: and for the
// wgmmas of s - 1, keeping their fragments until then); barrier; multiply step s; start the copies of the activations
// of s + 1 (into the B tile step s - 1 read) and, when s + 1 opens a span, of the windows of the span after it.
template <class Q, class O, int NW, class Core>
__device__ __forceinline__ void moe_tile16(MOE_TILE_PARAMS) {
    static_assert(MMA_BM == 64 && MMA_BN == 64 && MMA_BK == 64, "the thread maps of the copies and the decode");
    using S = TilePlan<Q, NW>;
    constexpr int TILE = S::TILE, SS = S::SPAN / MMA_BK;  // steps a span
    extern __shared__ __align__(128) u8 dynamic_smem[];
    u8* smem = dynamic_smem + (-(int)__cvta_generic_to_shared(dynamic_smem) & (WG_ATOM_BYTES - 1));
    u8* B = smem;         // [2] tiles: step s multiplies B + (s & 1) * TILE
    u8* R = B + 2 * TILE;  // [2] staging areas, span p in R + (p & 1) * S::RAW
    float* C = reinterpret_cast<float*>(smem);  // after the loop: NW tiles [MMA_BN][MMA_CLD]
    int e = tiles[3 * blockIdx.y], first = tiles[3 * blockIdx.y + 1], cnt = tiles[3 * blockIdx.y + 2];
    if (cnt == 0) return;  // a tile slot past the last tile (moe_tiles)
    const int r0 = blockIdx.x * MMA_BM, tid = threadIdx.x, lane = tid & 31, warp = tid / 32;
    constexpr int UNITS = MMA_BN * MMA_BK / 8 / 128;  // 8-value activation units a thread copies a step
    int bsrc[UNITS], bdst[UNITS];  // a unit's first element in x16 (-1: a padding token) and its offset in a B tile
#pragma unroll
    for (int i = 0; i < UNITS; i++) {
        const int u = tid + 128 * i, token = u % 8 + 8 * (u / 64), k8 = u / 8 % 8;
        const long long src = token < cnt ? (gather ? pairs[first + token] / k : first + token) : -1;
        bsrc[i] = src < 0 ? -1 : (int)src * ncols + 8 * k8;  // < 2^31: a pass's pairs times a row
        bdst[i] = wg_offset(token, k8);
    }
    const long long expert_offset = (long long)e * expert_bytes;
    const int srow = 16 * warp + lane % 16;
    const TileRows<Q, NW, S> rows(w0, w1, expert_offset + (long long)min(r0 + srow, nrows - 1) * row_bytes, srow,
                                  lane / 16);
    const FragRows<Q, NW, S> frag(w0, w1, expert_offset, r0, nrows, row_bytes, 16 * warp + lane / 4, lane & 3);
    auto copy_b = [&](int s) {
        u8* b = B + (s & 1) * TILE;
#pragma unroll
        for (int i = 0; i < UNITS; i++) {
            uint4* dst = reinterpret_cast<uint4*>(b + bdst[i]);
            if (bsrc[i] >= 0) cp_async<16>(dst, x16 + bsrc[i] + s * MMA_BK);
            else *dst = make_uint4(0, 0, 0, 0);
        }
    };
    const int steps = ncols / MMA_BK, spans = steps / SS;
    copy_b(0);
    rows.stage(R, 0);
    cp_async_commit();
    if (spans > 1) rows.stage(R + S::RAW, 1);
    cp_async_commit();
    float acc[NW][32] = {};
    auto step = [&](int s, u32 (&a)[NW][4][4], const u32 (&previous)[NW][4][4]) {
        if (s % SS == 0) {
            cp_async_wait<1>();
            __syncwarp();
        }
#pragma unroll
        for (int n = 0; n < NW; n++) frag.template decode<O>(R + (s / SS & 1) * S::RAW, n, s, a[n]);
        cp_async_wait<0>();
        Core::settle(previous);
        __syncthreads();
        Core::template multiply<O, NW>(acc, a, B + (s & 1) * TILE, lane);
        if (s + 1 < steps) copy_b(s + 1);
        const int next = (s + 1) / SS + 1;  // the span whose windows copy now, when s + 1 opens a span
        if ((s + 1) % SS == 0 && next < spans) rows.stage(R + (next & 1) * S::RAW, next);
        cp_async_commit();
    };
    u32 a0[NW][4][4], a1[NW][4][4] = {};  // the A fragments of even and odd steps
    int s = 0;
    for (; s + 1 < steps; s += 2) {
        step(s, a0, a1);
        step(s + 1, a1, a0);
    }
    if (s < steps) step(s, a0, a1);
    Core::finish(acc);
    cp_async_wait<0>();
    __syncthreads();  // every warp's wgmmas are complete before C overlays the tiles
    // Accumulator i of warp w: row 16w + g (+8 for i % 4 >= 2), token 8 * (i / 4) + 2t (+1 for odd i).
    const int g = lane >> 2, t = lane & 3;
#pragma unroll
    for (int n = 0; n < NW; n++)
#pragma unroll
        for (int i = 0; i < 32; i++)
            C[(n * MMA_BN + 8 * (i / 4) + 2 * t + (i & 1)) * MMA_CLD + 16 * warp + g + 8 * ((i >> 1) & 1)] = acc[n][i];
    __syncthreads();
    store_tile<O, NW>(C, *alpha, r0, nrows, first, cnt, pairs, limit, hs, weights, out, ldc, out16, s16);
}

template <class Q, class O, int NW>
__global__ void __launch_bounds__(128, (TilePlan<Q, NW>::BLOCKS)) moe_mma16(MOE_TILE_PARAMS) {
    moe_tile16<Q, O, NW, MmaCore>(MOE_TILE_ARGS);
}
