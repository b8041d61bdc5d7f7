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
