"""CPU tuning: the GEMM backend, tile sizes, BLAS threads and the torch kernel backend that run the blocks fast.

``gemm`` (NumPy's BLAS or Intel MKL's through ctypes), ``machine`` (this CPU and
its tuning cache), ``tune`` (``python -m mpiring bench tune`` fills the cache),
``threads`` (BLAS threads shared out among a node's ranks) and ``torch_kernel``
(the block on PyTorch's CPU flash-attention ops, ``MPIRING_KERNEL=torch``).
"""
