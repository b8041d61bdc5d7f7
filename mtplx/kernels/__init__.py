"""Triton kernels for CUDA forwards (paged attention, fused elementwise work, GEMV).

``ENABLED``: one switch for all of them; off, every forward takes the PyTorch reference path
(benchmarks and tests switch it off to check the kernels against that path)."""

ENABLED = True
