"""The CUDA backend: CuPy device arrays and our own kernels from kernels_cu/."""
