"""CUDA backend for ds4-core: weights stay raw GGUF blocks on the GPU; kernels are CUDA C++ compiled by NVRTC."""
