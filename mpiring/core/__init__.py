"""One rank's compute: the kernels, their tiles, one block into the running result, the references. No MPI.

CPU tuning (GEMM backends, tiles cache, BLAS threads, the torch kernel) is in ``tuning/``.
"""
