/* libattnforge_cuda_emulated.so: the CUDA backend's host code (src/cuda/backend.cu) and its kernels, compiled by
 * the host compiler against the CPU emulation of the CUDA features they use (cuda_emulated.h, AF_CUDA_EMULATED).
 * The tests point ATTNFORGE_CUDA_LIBRARY at it, so libattnforge loads it exactly as it loads the nvcc build. */
#include "cuda/backend.cu"
