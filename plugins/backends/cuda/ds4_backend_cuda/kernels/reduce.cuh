// Reductions over a thread block, shared by the modules' kernels (prepended to every module after pdl.cuh).

// v summed over the block (blockDim.x a multiple of 32, at most 1024), warps' sums in warp order, the total returned
// to every thread; partial: 32 floats of shared memory.
__device__ __forceinline__ float block_sum(float v, float* partial) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    if (lane == 0) partial[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < warps ? partial[lane] : 0.f;
        for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        if (lane == 0) partial[0] = v;
    }
    __syncthreads();
    return partial[0];
}
