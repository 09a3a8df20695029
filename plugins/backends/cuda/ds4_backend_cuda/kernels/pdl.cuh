// Programmatic dependent launch (compute capability 9.0 and later). A kernel the backend launches with it
// (launch.py) may start while the kernel before it in the stream still runs; grid_wait() returns once that kernel
// has finished and its writes are visible. Such a kernel calls grid_wait() before it reads anything an earlier
// kernel writes and before it writes anything: only loads of constant data (weights, tables) may come first, and
// they then overlap the predecessor's tail. Without the launch attribute, and before sm_90, it does nothing.
//
// Past the wait, the kernel lets its own successor launch: that one's blocks take free slots and run up to their
// own grid_wait() (a GEMV: its first weight loads) while this kernel works. The successor's wait still covers all
// of this kernel's writes, and it cannot launch before every block here has started, so nothing here is crowded out.
// The release never comes before the wait: a successor released earlier may start before this kernel's predecessor
// has ended, and its own wait covers only this kernel's writes, so it could read that predecessor's output stale
// through L1 (expert ids read so gave illegal addresses in recorded steps: docs/performance.md, session 57).
__device__ __forceinline__ void grid_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
