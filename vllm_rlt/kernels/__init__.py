"""Triton kernels for the CUDA path (imported only where triton and CUDA exist)."""
