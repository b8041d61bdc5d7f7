"""Device and dtype choice."""

from __future__ import annotations

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
