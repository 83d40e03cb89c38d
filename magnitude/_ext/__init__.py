"""Compiled kernels (Cython + a small C header). Use them through magnitude.kernels."""
