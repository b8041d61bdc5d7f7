"""GGUF quantized blocks -> ``QuantizedWeight`` (integers plus group scales and offsets), read
straight from the file's bytes with no float32 weight in between.

Exact for the formats whose groups are 32 inputs with one scale and one offset:

    Q4_0  w = d (q - 8)                 -> int4, scale d, zero 0
    Q4_1  w = d q + m                   -> int4, scale d, zero m + 8 d
    Q5_0  w = d (q - 16)                -> int8, scale d, zero 0
    Q5_1  w = d q + m                   -> int8, scale d, zero m
    Q8_0  w = d q                       -> int8, scale d, zero 0
    Q4_K  w = d sc q - dmin mn (per 32) -> int4, scale d sc, zero 8 d sc - dmin mn
    Q5_K  w = d sc q - dmin mn (per 32) -> int8, scale d sc, zero -dmin mn

Q6_K scales every 16 inputs, which the packed kernel's groups (>= 32) cannot hold: its blocks
are dequantized and re-quantized round-to-nearest to int8 with groups of 32 (``source`` says
so). Block layouts follow ggml (ggml-quants.c); tests check every decoder against
``gguf.quants.dequantize``.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from mtplx.models.quant import QuantizedWeight, quantize_rtn

EXACT = (Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q4_K, Q.Q5_K)
REQUANTIZED = (Q.Q6_K,)
SUPPORTED = EXACT + REQUANTIZED


def runs_as(qtype: int) -> str:
    """How a projection stored in ggml type ``qtype`` runs on the CPU: "int4 g32 (exact)",
    "int8 g32 (re-quantized)", or "float" for the formats read as floats."""
    qtype = Q(qtype)
    if qtype in EXACT:
        return f"int{4 if qtype in (Q.Q4_0, Q.Q4_1, Q.Q4_K) else 8} g32 (exact)"
    if qtype in REQUANTIZED:
        return "int8 g32 (re-quantized)"
    return "float" if qtype in (Q.F32, Q.F16, Q.BF16) else "float (dequantized)"


def quantized_weight(raw: np.ndarray, qtype: int, shape: tuple[int, int]) -> QuantizedWeight:
    """raw: the tensor's bytes (uint8, any shape); shape: [out, in] in torch order."""
    qtype = Q(qtype)
    out, inp = shape
    blocks = np.ascontiguousarray(raw).reshape(-1)
    if qtype in REQUANTIZED:
        w = torch.from_numpy(np.asarray(dequantize(blocks.reshape(out, -1), qtype), dtype=np.float32))
        qw = quantize_rtn(w.reshape(out, inp), 8, 32)
        qw.source = f"gguf {qtype.name} -> rtn int8"
        return qw
    q, scale, zero, bits = _DECODERS[qtype](blocks)
    g = 32
    return QuantizedWeight(torch.from_numpy(q.reshape(out, inp)), torch.from_numpy(scale.reshape(out, inp // g)),
                           torch.from_numpy(zero.reshape(out, inp // g)), bits, g, f"gguf {qtype.name}")


def _f16(b: np.ndarray) -> np.ndarray:
    """[..., 2] uint8 little-endian half floats -> [...] float32."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0].astype(np.float32)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """[blocks, 16] bytes -> [blocks, 32]: low nibbles are elements 0..15, high ones 16..31."""
    return np.concatenate((qs & 0x0F, qs >> 4), axis=1)


def _q4_0(b):
    b = b.reshape(-1, 18)
    d = _f16(b[:, 0:2])
    return (_nibbles_32(b[:, 2:]).astype(np.int8) - 8), d, np.zeros_like(d), 4


def _q4_1(b):
    b = b.reshape(-1, 20)
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    return (_nibbles_32(b[:, 4:]).astype(np.int8) - 8), d, m + 8 * d, 4


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """[blocks, 4] bytes (a little-endian uint32) -> [blocks, 32] bit j of it, times 16."""
    bits = np.unpackbits(np.ascontiguousarray(qh), axis=1, bitorder="little")
    return bits.astype(np.int16) << 4


def _q5_0(b):
    b = b.reshape(-1, 22)
    d = _f16(b[:, 0:2])
    q = _nibbles_32(b[:, 6:]).astype(np.int16) + _high_bits(b[:, 2:6])
    return (q - 16).astype(np.int8), d, np.zeros_like(d), 8


def _q5_1(b):
    b = b.reshape(-1, 24)
    d, m = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    q = _nibbles_32(b[:, 8:]).astype(np.int16) + _high_bits(b[:, 4:8])
    return q.astype(np.int8), d, m, 8


def _q8_0(b):
    b = b.reshape(-1, 34)
    d = _f16(b[:, 0:2])
    return np.ascontiguousarray(b[:, 2:]).view(np.int8), d, np.zeros_like(d), 8


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[blocks, 12] packed 6-bit scales and mins -> ([blocks, 8], [blocks, 8]) (ggml get_scale_min_k4)."""
    s = s.astype(np.int32)
    sc = np.concatenate((s[:, 0:4] & 63, (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)), axis=1)
    mn = np.concatenate((s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)), axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_nibbles(qs: np.ndarray) -> np.ndarray:
    """[blocks, 128] bytes -> [blocks, 256]: each 32-byte chunk gives 32 low nibbles (sub-block
    2i) then 32 high nibbles (sub-block 2i + 1)."""
    qs = qs.reshape(-1, 4, 32)
    return np.stack((qs & 0x0F, qs >> 4), axis=2).reshape(-1, 256)


def _q4_k(b):
    b = b.reshape(-1, 144)
    d, dmin = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
    sc, mn = _k_scales(b[:, 4:16])
    scale = d * sc
    return _k_nibbles(b[:, 16:]).astype(np.int8) - 8, scale, 8 * scale - dmin * mn, 4


def _q5_k(b):
    b = b.reshape(-1, 176)
    d, dmin = _f16(b[:, 0:2])[:, None], _f16(b[:, 2:4])[:, None]
    sc, mn = _k_scales(b[:, 4:16])
    # qh[l] bit j is the fifth bit of element l of sub-block j
    high = np.unpackbits(b[:, 16:48][:, None, :], axis=1, count=8, bitorder="little")  # [blocks, 8, 32]
    q = _k_nibbles(b[:, 48:]).astype(np.int16) + (high.reshape(-1, 256).astype(np.int16) << 4)
    return q.astype(np.int8), d * sc, -dmin * mn, 8


_DECODERS = {Q.Q4_0: _q4_0, Q.Q4_1: _q4_1, Q.Q5_0: _q5_0, Q.Q5_1: _q5_1, Q.Q8_0: _q8_0,
             Q.Q4_K: _q4_k, Q.Q5_K: _q5_k}
