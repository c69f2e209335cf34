"""The Triton kernels of the ``triton`` attention backend and AWQ, each beside its PyTorch
reference; ``_triton`` imports triton (interpreted on a machine without CUDA)."""
