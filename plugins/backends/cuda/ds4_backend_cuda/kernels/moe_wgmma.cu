// The routed experts' tile kernel on Hopper's warpgroup MMA (wgmma, sm_90a only; compiled after quant.cu and
// prefill.cu into a module of its own). moe_mma16 read its A and B tiles back from shared memory into registers
// with ldmatrix, which with the decode's stores kept the L1/shared-memory pipe ~80% busy; wgmma reads both
// operands from shared memory itself, once per warpgroup rather than once per warp.
//
// A 64 x 64 tile (rows or tokens x columns) of 16-bit values is stored K-major with the 128-byte swizzle: row r's 128
// bytes at r * 128, its 16-byte chunk k8 (columns 8 * k8 .. + 7) at position k8 ^ (r % 8), tiles 1024-byte aligned.
// The tensor cores read 8 rows' chunks at once; unswizzled, those share banks (8-way conflicts: wgmma at a fraction
// of its rate). A quarter-warp's 16-byte stores (8 rows, one chunk each) are conflict-free too.

#define WG_ROW_BYTES 128
#define WG_ATOM_BYTES (8 * WG_ROW_BYTES)  // 8 rows: the swizzle's period, the stride of 8-row groups (SBO)

// Shared-memory matrix descriptor of the tile at p (1024-byte aligned), offset by k16 slices of 16 columns (32
// bytes: the swizzle is of address bits, so a slice starts inside each row).
__device__ __forceinline__ u64 wg_desc(const void* p, int k16) {
    const u32 addr = (u32)__cvta_generic_to_shared(p) + 32 * k16;
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(WG_ATOM_BYTES >> 4) << 32) | ((u64)1 << 62);
}

// Byte offset of row r, columns 8 * k8 .. + 7 of a tile.
__device__ __forceinline__ int wg_offset(int r, int k8) { return r * WG_ROW_BYTES + ((k8 ^ (r & 7)) << 4); }

// d (64 rows x 64 tokens, f32, this thread's 32) += A (64 x 16) * B (16 x 64), both read from shared memory.
template <class O>
__device__ __forceinline__ void wgmma64(float (&d)[32], u64 a, u64 b);

#define WG_D32                                                                                                       \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "     \
    "%23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define WG_OUT32(d)                                                                                                  \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),     \
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),       \
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),      \
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])

template <>
__device__ __forceinline__ void wgmma64<Half>(float (&d)[32], u64 a, u64 b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " WG_D32 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : WG_OUT32(d) : "l"(a), "l"(b), "r"(1));
}

template <>
__device__ __forceinline__ void wgmma64<BHalf>(float (&d)[32], u64 a, u64 b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WG_D32 ", %32, %33, p, 1, 1, 0, 0;\n}\n"
                 : WG_OUT32(d) : "l"(a), "l"(b), "r"(1));
}

// The accumulators are written by the tensor cores until wgmma.wait_group returns: this keeps the compiler from
// reading them earlier.
__device__ __forceinline__ void wg_settle(float (&d)[32]) {
#pragma unroll
    for (int i = 0; i < 32; i++) asm volatile("" : "+f"(d[i])::"memory");
}

// Shared memory of moe_wgmma16<Q, *, NW> (dynamic: more than 48 KB): two A tiles a matrix, so that step s + 1
// decodes while the tensor cores multiply step s, two B tiles, and two staging areas (the next span's windows copy
// while this span's decode), in 16-byte chunks; STAGED when that leaves room for two blocks a multiprocessor.
// BLOCKS: the blocks per SM that shared memory admits (at most 4), which the registers are capped for.
template <class Q, int NW>
struct WgPlan : StagePlan<Q, NW, 16> {
    using Base = StagePlan<Q, NW, 16>;
    static constexpr int TILE = MMA_BM * MMA_BK * 2;  // bytes of an A or B tile
    static constexpr int OPS = (2 * NW + 2) * TILE, ACC = NW * MMA_BN * MMA_CLD * 4;
    static constexpr bool STAGED = OPS + 2 * Base::RAW <= 110 * 1024;
    static constexpr int USED = OPS + (STAGED ? 2 * Base::RAW : 0);
    static constexpr int SMEM = (USED > ACC ? USED : ACC) + WG_ATOM_BYTES;  // + the alignment of the tiles
    static constexpr int BLOCKS = 227 * 1024 / SMEM < 4 ? 227 * 1024 / SMEM : 4;
};

// The dynamic shared memory moe_wgmma16<Q, *, NW> takes, for the host.
template <class Q, int NW>
__global__ void moe_wgmma16_smem(int* out) { *out = WgPlan<Q, NW>::SMEM; }

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Wait until at most N of this thread's latest cp.async groups are in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// moe_mma16's tile (same arguments, tiles and epilogue) on one warpgroup. Thread tid decodes row 16 * warp + lane %
// 16, columns 32 * (lane / 16) .. + 31 of each step (the row's two threads, lanes of one warp, stage its windows) and
// copies activation units u = tid + 128i: token u % 8 + 8 * (u / 64), columns 8 * (u / 8 % 8) .. + 7 (a quarter-warp
// writes one chunk of 8 tokens, free of bank conflicts, and a warp reads 64 contiguous bytes of each of 8 tokens).
// Step s: at a span's first step, wait for its windows (copied a span earlier) and sync the warp; decode into A tile
// s & 1 (its wgmmas, of step s - 2, are complete); fence to the async proxy; wait for the activations of s and for the
// wgmmas of s - 1; barrier; issue the 4 x NW wgmmas (64 x 64 x 16) of s; start the copies of the activations of s + 1
// (into the B tile the wgmmas of s - 1 read) and, when s + 1 opens a span, of the windows of the span after it.
template <class Q, class O, int NW>
__global__ void __launch_bounds__(128, (WgPlan<Q, NW>::BLOCKS)) moe_wgmma16(
        const u8* __restrict__ w0, const u8* __restrict__ w1, long long expert_bytes, long long row_bytes, int nrows,
        int ncols, const int* __restrict__ tiles, const u16* __restrict__ x16, const int* __restrict__ pairs, int k,
        int gather, const float* __restrict__ alpha, float limit, const float* __restrict__ hs,
        const float* __restrict__ weights, float* __restrict__ out, int ldc, u16* __restrict__ out16, float s16) {
    static_assert(MMA_BM == 64 && MMA_BN == 64 && MMA_BK == 64, "the thread maps of the copies and the decode");
    using S = WgPlan<Q, NW>;
    constexpr int TILE = S::TILE, SS = S::SPAN / MMA_BK;  // steps a span
    extern __shared__ __align__(128) u8 dynamic_smem[];
    u8* smem = dynamic_smem + (-(int)__cvta_generic_to_shared(dynamic_smem) & (WG_ATOM_BYTES - 1));
    u8* A = smem;                 // [2][NW] tiles: step s decodes into A + (s & 1) * NW * TILE
    u8* B = A + 2 * NW * TILE;    // [2] tiles: step s multiplies B + (s & 1) * TILE
    u8* R = B + 2 * TILE;         // STAGED: [2] staging areas, span p in R + (p & 1) * S::RAW
    float* C = reinterpret_cast<float*>(smem);  // after the loop: NW tiles [MMA_BN][MMA_CLD]
    int e = tiles[3 * blockIdx.y], first = tiles[3 * blockIdx.y + 1], cnt = tiles[3 * blockIdx.y + 2];
    if (cnt == 0) return;  // a tile slot past the last tile (moe_tiles)
    const int r0 = blockIdx.x * MMA_BM, tid = threadIdx.x, lane = tid & 31, warp = tid / 32;
    constexpr int UNITS = MMA_BN * MMA_BK / 8 / 128;  // 8-value activation units a thread copies a step
    const u16* bsrc[UNITS];
    int bdst[UNITS];
#pragma unroll
    for (int i = 0; i < UNITS; i++) {
        const int u = tid + 128 * i, token = u % 8 + 8 * (u / 64), k8 = u / 8 % 8;
        const long long src = token < cnt ? (gather ? pairs[first + token] / k : first + token) : -1;
        bsrc[i] = src < 0 ? nullptr : x16 + src * ncols + 8 * k8;
        bdst[i] = wg_offset(token, k8);
    }
    const int drow = 16 * warp + lane % 16;
    const TileRows<Q, NW, S> rows(w0, w1, (long long)e * expert_bytes + (long long)min(r0 + drow, nrows - 1) * row_bytes,
                                  drow, lane / 16);
    auto copy_b = [&](int s) {
        u8* b = B + (s & 1) * TILE;
#pragma unroll
        for (int i = 0; i < UNITS; i++) {
            uint4* dst = reinterpret_cast<uint4*>(b + bdst[i]);
            if (bsrc[i]) cp_async<16>(dst, bsrc[i] + s * MMA_BK);
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
    for (int s = 0; s < steps; s++) {
        if (s % SS == 0) {
            cp_async_wait<1>();
            __syncwarp();
        }
#pragma unroll
        for (int n = 0; n < NW; n++)
            rows.template decode<O>(R + (s / SS & 1) * S::RAW, n, s,
                                    reinterpret_cast<uint4*>(A + ((s & 1) * NW + n) * TILE + drow * WG_ROW_BYTES +
                                                             ((rows.dc / 8 ^ (drow & 4)) << 4)),
                                    drow & 3);  // chunk dc / 8 + j at (dc / 8 + j) ^ (drow % 8)
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the stores and copies, to the tensor cores
        cp_async_wait<0>();
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        __syncthreads();
        const u8* As = A + (s & 1) * NW * TILE;
        const u8* Bs = B + (s & 1) * TILE;
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
        for (int q = 0; q < MMA_BK / 16; q++)
#pragma unroll
            for (int n = 0; n < NW; n++)
                wgmma64<O>(acc[n], wg_desc(As + n * TILE, q), wg_desc(Bs, q));
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        if (s + 1 < steps) copy_b(s + 1);
        if ((s + 1) % SS == 0 && (s + 1) / SS + 1 < spans) rows.stage(R + ((s + 1) / SS + 1 & 1) * S::RAW, (s + 1) / SS + 1);
        cp_async_commit();
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#pragma unroll
    for (int n = 0; n < NW; n++) wg_settle(acc[n]);
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
