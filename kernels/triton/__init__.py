"""Triton kernels (attention backend, AWQ), each beside its PyTorch reference."""
