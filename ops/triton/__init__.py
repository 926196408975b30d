"""Triton kernels for the MLA ops (CUDA path); imported lazily so CPU machines need no Triton."""
