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


def version(tensor) -> int | None:
    """A tensor's version counter (in-place edits move it), or None for an inference tensor, which
    has none and cannot be edited outside inference mode (an edit inside it goes unseen by the
    caches of packed or narrowed weight copies that compare versions; nothing in mtplx edits
    weights there)."""
    return None if tensor.is_inference() else tensor._version


def pdl(device) -> bool:
    """Whether kernels launched on ``device`` use programmatic dependent launch: ``PDL`` and
    ``ENABLED`` on, an NVIDIA device of compute capability 9.0 or newer (not ROCm, whose devices
    also report type "cuda"), a driver that captures such launches in CUDA graphs (CUDA 12.3+),
    and a Triton that has the launch option and ``gdc_wait`` (3.4+)."""
    if not (PDL and ENABLED and device.type == "cuda" and _supported()):
        return False
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_capability(index)[0] >= 9


@functools.lru_cache(maxsize=None)
def _supported() -> bool:
    """The software side of ``pdl`` and a device visible to this process, checked once (``pdl``
    runs at every kernel launch)."""
    import torch

    if torch.version.hip is not None or _driver_version() < 12030 or not torch.cuda.is_available():
        return False  # (a driver but no visible device: nothing to ask a capability of)
    try:
        import dataclasses

        import triton.language as tl
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return False
    return (hasattr(tl.extra, "cuda") and hasattr(tl.extra.cuda, "gdc_wait")
            and "launch_pdl" in {f.name for f in dataclasses.fields(CUDAOptions)})


def _driver_version() -> int:
    """The CUDA driver's version (12030 for 12.3) from libcuda itself; 0 where there is none."""
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    version = ctypes.c_int(0)
    return version.value if lib.cuDriverGetVersion(ctypes.byref(version)) == 0 else 0
