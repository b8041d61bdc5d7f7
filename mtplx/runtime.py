"""Device and dtype choice, and the CPU's OpenMP threads."""

from __future__ import annotations

import ctypes
import functools

import torch

from mtplx.errors import InvalidParameter

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def resolve_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise InvalidParameter("device", f"{device!r}: only 'cpu' and 'cuda' are supported")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidParameter("device", "'cuda' was asked for but PyTorch sees no CUDA device here")
    return dev


def resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise InvalidParameter("dtype", f"{dtype} is not one of float32, bfloat16, float16")
        return dtype
    if dtype not in DTYPES:
        raise InvalidParameter("dtype", f"{dtype!r} is not one of float32, bfloat16, float16")
    return DTYPES[dtype]


def resolve_kv_dtype(kv_dtype, device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The KV cache's element type. None or "auto": float16 on the CPU where the model computes in
    float32 (a long context's decode reads half the bytes; each entry is rounded once, to
    nearest, when written, and widened exactly when read), else the model's dtype. On the CPU
    "float32" or the model's dtype may be asked for, and "float16" for a float32 model; on CUDA
    only the model's dtype (its kernels read the pools in the activations' type). float16 holds
    magnitudes up to 65,504: a model whose keys or values exceed that (none measured here) needs
    "float32" (an entry past it becomes inf, and its attention NaN; the engine logs a warning the
    first time it happens: ``ModelRunner.warn_on_kv_overflow``)."""
    if kv_dtype is None or kv_dtype == "auto":
        return torch.float16 if device.type == "cpu" and dtype == torch.float32 else dtype
    name = kv_dtype if isinstance(kv_dtype, str) else None
    if name is not None and name not in DTYPES:
        raise InvalidParameter("kv_dtype", f"{kv_dtype!r} is not one of auto, float32, float16, bfloat16")
    want = DTYPES[name] if name is not None else kv_dtype
    allowed = {dtype}
    if device.type != "cuda":
        allowed |= {torch.float32, torch.float16} if dtype == torch.float32 else {torch.float32}
    if want not in allowed:
        def short(d: torch.dtype) -> str:
            return str(d).removeprefix("torch.")

        raise InvalidParameter("kv_dtype", f"{short(want)} is not available on {device.type} with a {short(dtype)} "
                                           f"model: use auto or {', '.join(sorted(map(short, allowed)))}")
    return want


def release_idle_openmp_threads() -> bool:
    """Let the calling thread's idle OpenMP workers exit (``omp_pause_resource_all`` with
    ``omp_pause_soft``, on the OpenMP runtime PyTorch loaded), before another thread takes over
    the CPU work: the server's model thread (``batching.scheduler.Scheduler.start``) after the
    engine was built on the main thread. Returns whether a runtime took the call.

    Why: libgomp spins only briefly before it sleeps once its threads outnumber the CPUs, so
    while the loading thread keeps its pool, each parallel region of the model thread waits for
    woken workers. Measured on this project's 2-core AVX2 VM (torch 2.13, two threads;
    benchmarks/cpu_threads.py, cpu_s41_threads_2threads.json): after building the default model on
    the main thread, a 200,000-float add took 113-133 us on a second thread against 20-22 on the
    main one, and greedy AR decoded 39.2-40.2 tok/s there against 86-110; after this call, 24-27 us
    and 95.3-98.1 tok/s. A thread that runs parallel regions again after this call gets a pool again."""
    runtime = _openmp_runtime()
    pause = getattr(runtime, "omp_pause_resource_all", None) if runtime is not None else None
    if pause is None:
        return False
    pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
    return pause(1) == 0  # 1: omp_pause_soft (threads go, the runtime stays initialised)


@functools.cache
def _openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime already mapped into this process (GNU, Intel or LLVM), or None."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if line.rstrip().endswith(".so") or ".so." in line}
    except OSError:  # not Linux
        return None
    for path in sorted(paths):
        name = path.rsplit("/", 1)[-1]
        if name.startswith(("libgomp", "libiomp5", "libomp.")):
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    return None
