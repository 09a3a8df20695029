// The routed experts' tile kernel on Hopper's warpgroup MMA (wgmma, sm_90a only; compiled after quant.cu and
// prefill.cu into a module of its own). Each thread decodes its share of the weights straight into wgmma's A
// fragments in registers; only the activations (B) go through shared memory. moe_mma16 stored the decoded tiles to
// shared memory and read them back with ldmatrix, and a first wgmma version (A from shared memory as well) still
// kept the L1/shared-memory pipe ~83% busy with the tiles' stores and reads.
//
// A 64 x 64 B tile (tokens x columns) of 16-bit values is stored K-major with the 128-byte swizzle: row r's 128
// bytes at r * 128, its 16-byte chunk k8 (columns 8 * k8 .. + 7) at position k8 ^ (r % 8), tiles 1024-byte aligned.
// The tensor cores read 8 rows' chunks at once; unswizzled, those share banks (8-way conflicts: wgmma at a fraction
// of its rate). The columns of every 64 are in the k64 order (kernels/prefill.cu), in which each thread's fragment
// columns are 16 consecutive weights.

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

// d (64 rows x 64 tokens, f32, this thread's 32) += A (64 x 16, this thread's fragment a: rows 16w + g and + 8 of
// warp w, lane 4g + t, positions 2t, 2t + 1 and + 8 of the slice) * B (16 x 64, from shared memory).
template <class O>
__device__ __forceinline__ void wgmma64(float (&d)[32], const u32 (&a)[4], u64 b);

#define WG_D32                                                                                                       \
    "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, "     \
    "%23, %24, %25, %26, %27, %28, %29, %30, %31}"
#define WG_OUT32(d)                                                                                                  \
    "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]),     \
        "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]),       \
        "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]),      \
        "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define WG_A4(a) "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3])

template <>
__device__ __forceinline__ void wgmma64<Half>(float (&d)[32], const u32 (&a)[4], u64 b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 " WG_D32 ", {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
                 : WG_OUT32(d) : WG_A4(a), "l"(b), "r"(1));
}

template <>
__device__ __forceinline__ void wgmma64<BHalf>(float (&d)[32], const u32 (&a)[4], u64 b) {
    asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 " WG_D32 ", {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
                 : WG_OUT32(d) : WG_A4(a), "l"(b), "r"(1));
}

// The accumulators are written by the tensor cores until wgmma.wait_group returns: this keeps the compiler from
// reading them earlier.
__device__ __forceinline__ void wg_settle(float (&d)[32]) {
#pragma unroll
    for (int i = 0; i < 32; i++) asm volatile("" : "+f"(d[i])::"memory");
}

// The tensor cores read a wgmma's A fragments from the registers until wgmma.wait_group retires it, which the
// compiler does not know: a use of them after that wait keeps their registers from the decode before it.
template <int NW>
__device__ __forceinline__ void wg_keep(const u32 (&a)[NW][4][4]) {
#pragma unroll
    for (int n = 0; n < NW; n++)
#pragma unroll
        for (int i = 0; i < 16; i++) asm volatile("" ::"r"(a[n][i / 4][i % 4]) : "memory");
}

// Shared memory of moe_wgmma16<Q, *, NW> (dynamic: more than 48 KB with the accumulators' tiles): two B tiles, so
// that step s + 1's activations copy while the tensor cores multiply step s, and two staging areas (the next span's
// windows copy while this span's decode). BLOCKS: the blocks per SM the registers are capped for (each thread holds
// 32 accumulators and two steps' A fragments of 16 registers a matrix).
template <class Q, int NW>
struct WgPlan : StagePlan<Q, NW, 16> {
    using Base = StagePlan<Q, NW, 16>;
    static constexpr int TILE = MMA_BN * MMA_BK * 2;  // bytes of a B tile
    static constexpr int USED = 2 * TILE + 2 * Base::RAW, ACC = NW * MMA_BN * MMA_CLD * 4;
    static constexpr int SMEM = (USED > ACC ? USED : ACC) + WG_ATOM_BYTES;  // + the alignment of the tiles
    static constexpr bool STAGED = true;  // TileRows copies the windows
    static constexpr int FIT = 227 * 1024 / SMEM, CAP = NW == 2 ? 3 : 4;
    static constexpr int BLOCKS = FIT < CAP ? FIT : CAP;
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

// The dynamic shared memory moe_wgmma16<Q, *, NW> takes, for the host.
template <class Q, int NW>
__global__ void moe_wgmma16_smem(int* out) { *out = WgPlan<Q, NW>::SMEM; }

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Wait until at most N of this thread's latest cp.async groups are in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

// moe_mma16's tile (same arguments, tiles and epilogue; activations in the k64 order) on one warpgroup. The row
// 16 * warp + lane % 16 of each matrix is staged by two lanes of one warp, lane / 16 the part (TileRows), and read by
// lanes of the same warp (FragRows), so a span's first step needs only __syncwarp. Thread tid copies activation units
// u = tid + 128i: token u % 8 + 8 * (u / 64), columns 8 * (u / 8 % 8) .. + 7 (a quarter-warp writes one chunk of 8
// tokens, free of bank conflicts, and a warp reads 64 contiguous bytes of each of 8 tokens).
// Step s: at a span's first step, wait for its windows (copied a span earlier) and sync the warp; decode into the A
// fragments of s & 1 (registers of their own, whose wgmmas, of step s - 2, are complete: a single set, rewritten while
// the tensor cores still read it, gave NaNs); wait for the activations of s and for the wgmmas of s - 1, and keep the
// fragments of s - 1 until then (wg_keep); fence to the async proxy; barrier; issue the 4 x NW wgmmas (64 x 64 x 16)
// of s; start the copies of the activations of s + 1 (into the B tile the wgmmas of s - 1 read) and, when s + 1 opens
// a span, of the windows of the span after it.
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
    u8* B = smem;         // [2] tiles: step s multiplies B + (s & 1) * TILE
    u8* R = B + 2 * TILE;  // [2] staging areas, span p in R + (p & 1) * S::RAW
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
    auto step = [&](int s, u32 (&a)[NW][4][4], const u32 (&previous)[NW][4][4]) {
        if (s % SS == 0) {
            cp_async_wait<1>();
            __syncwarp();
        }
#pragma unroll
        for (int n = 0; n < NW; n++) frag.template decode<O>(R + (s / SS & 1) * S::RAW, n, s, a[n]);
        cp_async_wait<0>();
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the copies and zeros, to the tensor cores
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        wg_keep(previous);
        __syncthreads();
        const u8* Bs = B + (s & 1) * TILE;
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
        for (int q = 0; q < MMA_BK / 16; q++)
#pragma unroll
            for (int n = 0; n < NW; n++) wgmma64<O>(acc[n], a[n][q], wg_desc(Bs, q));
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        if (s + 1 < steps) copy_b(s + 1);
        if ((s + 1) % SS == 0 && (s + 1) / SS + 1 < spans) rows.stage(R + ((s + 1) / SS + 1 & 1) * S::RAW, (s + 1) / SS + 1);
        cp_async_commit();
    };
    u32 a0[NW][4][4], a1[NW][4][4] = {};  // the A fragments of even and odd steps
    int s = 0;
    for (; s + 1 < steps; s += 2) {
        step(s, a0, a1);
        step(s + 1, a1, a0);
    }
    if (s < steps) step(s, a0, a1);
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
    store_tile<O, NW, true>(C, *alpha, r0, nrows, first, cnt, pairs, limit, hs, weights, out, ldc, out16, s16);
}
