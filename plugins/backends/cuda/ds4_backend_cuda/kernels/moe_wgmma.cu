// The routed experts' tile kernel on Hopper's warpgroup MMA (wgmma, sm_90a only; compiled after moe_tile.cu into a
// module of its own): WgCore multiplies a step as the warpgroup's 64 x 64 x 16 wgmmas, A from the fragments in
// registers, B from the swizzled tile.

// Shared-memory matrix descriptor of the tile at p (1024-byte aligned), offset by k16 slices of 16 columns (32
// bytes: the swizzle is of address bits, so a slice starts inside each row).
__device__ __forceinline__ u64 wg_desc(const void* p, int k16) {
    const u32 addr = (u32)__cvta_generic_to_shared(p) + 32 * k16;
    return (u64)((addr & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(WG_ATOM_BYTES >> 4) << 32) | ((u64)1 << 62);
}

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

// wgmma.mma_async: the step's 4 x NW wgmmas issue back to back and run while the next step decodes; settle waits for
// them (and fences the activations' copies and zeros to the tensor cores) before the barrier, finish after the loop.
struct WgCore {
    template <int NW>
    static __device__ __forceinline__ void settle(const u32 (&previous)[NW][4][4]) {
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // the copies and zeros, to the tensor cores
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        wg_keep(previous);
    }

    template <class O, int NW>
    static __device__ __forceinline__ void multiply(float (&acc)[NW][32], const u32 (&a)[NW][4][4], const u8* Bs,
                                                    int) {
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
        for (int q = 0; q < MMA_BK / 16; q++)
#pragma unroll
            for (int n = 0; n < NW; n++) wgmma64<O>(acc[n], a[n][q], wg_desc(Bs, q));
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    }

    template <int NW>
    static __device__ __forceinline__ void finish(float (&acc)[NW][32]) {
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
#pragma unroll
        for (int n = 0; n < NW; n++) wg_settle(acc[n]);
    }
};

template <class Q, class O, int NW>
__global__ void __launch_bounds__(128, (TilePlan<Q, NW>::BLOCKS)) moe_wgmma16(MOE_TILE_PARAMS) {
    moe_tile16<Q, O, NW, WgCore>(MOE_TILE_ARGS);
}
