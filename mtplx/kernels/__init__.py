"""Triton kernels for CUDA forwards (paged attention, fused elementwise work, GEMV).

``ENABLED``: one switch for all of them; off, every forward takes the PyTorch reference path
(benchmarks and tests switch it off to check the kernels against that path).

``PDL``: whether the decode path's kernels use programmatic dependent launch where the GPU has it
(compute capability 9.0+: Hopper, Blackwell). A kernel launched so may start while the kernel
before it on the stream still runs: it becomes resident, loads what no earlier kernel writes
(its weights), then waits (``griddepcontrol.wait``) until the kernel before it has finished and
its writes are visible, before it reads its inputs or writes anything; each such kernel lets
the next one launch as soon as all of its own programs have started. A decode step is a chain
of several hundred short kernels, and each one's launch and first weight loads then overlap
the one before it (docs/performance.md, session 21). ``MTPLX_PDL=0`` turns it off.
"""

from __future__ import annotations

import functools
import os

ENABLED = True
PDL = os.environ.get("MTPLX_PDL", "1") != "0"


def pdl(device) -> bool:
    """Whether kernels launched on ``device`` use programmatic dependent launch: ``PDL`` and
    ``ENABLED`` on, and a CUDA device of compute capability 9.0 or newer."""
    return PDL and ENABLED and device.type == "cuda" and _capability_major(device.index) >= 9


@functools.lru_cache(maxsize=None)
def _capability_major(index) -> int:
    import torch

    return torch.cuda.get_device_capability(index)[0]
