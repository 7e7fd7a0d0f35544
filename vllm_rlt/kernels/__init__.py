"""Triton kernels for the CUDA path (imported only where triton and CUDA exist; w8a8_tile.py,
a launch shape, needs neither)."""
