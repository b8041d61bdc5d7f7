"""Weight-only quantized linear layers: int4 and int8 weights with group-wise scales, and fp8.

A quantized weight [out, in] is integers ``q`` with one scale and one offset per group of
``group_size`` consecutive inputs of a row:

    w[n, k] = q[n, k] * scale[n, k // g] + zero[n, k // g]       q: int4 in [-8, 7] or int8

which holds GGUF's block formats exactly (Q4_0: zero 0; Q4_1 / Q4_K: zero = the block's min)
and round-to-nearest quantization of a 16-bit checkpoint (``quantize_rtn``). An fp8 weight is
the same with ``q`` float8 e4m3 values, one scale per output row and no offset
(``quantize_fp8``).

Backends (``QuantLinear.forward``):

- CPU ("cpu"): the C++ kernel of kernels/cpu.py (AVX2 + FMA, compiled once per machine):
  float32 activations, int4 (two per byte) or int8 weights, float16 scales and offsets per
  group; a row's output does not depend on the other rows of the batch.
- CPU where that kernel cannot be built ("int4pack": no AVX2, no compiler, or
  ``MTPLX_CPU_KERNELS=0``): PyTorch's packed int4 kernel
  (``aten._weight_int4pack_mm_for_cpu``, bf16 activations and scales, fp32 accumulation). An
  int8 weight runs through it as two int4 planes, ``q = 16 * hi + lo`` (hi in [-8, 7], lo in
  [0, 15]), laid side by side along the input axis, which is exact and reads the same 1 byte
  per weight.
- CUDA, int4 ("mma", sm_80+; ``MTPLX_CUDA_QUANT=cuda-cores`` opts out, ``=mma`` takes int8
  too): kernels/quant_mma.py, a GEMV on the tensor cores for up to 8 bf16 token rows that costs
  about the same at 1 and at 8 rows, and a dequantizing kernel plus cuBLAS for more rows or
  other dtypes.
- CUDA, everything else ("triton": fp8, int8; int4 with other activation dtypes, with
  ``MTPLX_CUDA_QUANT=cuda-cores``, or in shapes the tensor-core layout cannot hold):
  kernels/quant_gemv.py, a GEMV for up to 8 token rows (CUDA cores up to 4 rows, tensor cores
  for 5-8), a dequantizing kernel plus cuBLAS for more (prefill).
  On both, a fused gate/up layer's SiLU * up is the GEMV's epilogue
  (``QuantLinear.silu_mul_forward``).
- Anywhere else, and fp8 on the CPU (which has no fp8 kernel): dequantize-then-matmul in the
  activation dtype (correct, not fast; on the CPU fp8 is for quality checks such as
  benchmarks/perplexity.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mtplx.kernels import cpu as cpu_kernels, quant_gemv, quant_mma
from mtplx.models.layers import MLP, Attention, silu_mul

FORMATS = ("int4", "int8", "fp8")
GROUP_SIZES = (32, 64, 128, 256)  # what the packed CPU kernel takes
FP8_MAX = 448.0  # the largest float8 e4m3fn value
_PACK_ROWS = 16  # the packed CPU kernel wants out_features a multiple of this


@dataclass
class QuantizedWeight:
    """A weight in the portable quantized form (what loaders produce, before packing).

    q: [out, in] int8 (int4 values in [-8, 7]) or float8_e4m3fn (bits 8); scale, zero:
    [out, in // group_size] float32; source: where the values came from ("gguf Q4_1", "rtn"),
    shown by ``mtplx inspect``."""

    q: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    bits: int
    group_size: int
    source: str = "rtn"

    def __post_init__(self):
        out, inp = self.q.shape
        if self.bits not in (4, 8) or (self.fp8 and self.bits != 8):
            raise ValueError(f"bits must be 4 or 8 (8 for fp8), got {self.bits}")
        if inp % self.group_size:
            raise ValueError(f"in_features {inp} is not a multiple of group_size {self.group_size}")
        groups = (out, inp // self.group_size)
        if tuple(self.scale.shape) != groups or tuple(self.zero.shape) != groups:
            raise ValueError(f"scale/zero must be {groups}, got {tuple(self.scale.shape)} / {tuple(self.zero.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    @property
    def fp8(self) -> bool:
        return self.q.dtype == torch.float8_e4m3fn

    @property
    def kind(self) -> str:
        """"int4", "int8" or "fp8": one of FORMATS."""
        return "fp8" if self.fp8 else f"int{self.bits}"

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out, in] these integers and scales stand for."""
        g = self.group_size
        return (self.q.float().unflatten(1, (-1, g)) * self.scale.unsqueeze(-1) + self.zero.unsqueeze(-1)).flatten(1)


def quantize_rtn(weight: torch.Tensor, bits: int, group_size: int = 32) -> QuantizedWeight:
    """Round-to-nearest, symmetric (zero = 0), one scale per group of ``group_size`` inputs.
    weight: [out, in] any float dtype."""
    out, inp = weight.shape
    if inp % group_size:
        raise ValueError(f"in_features {inp} is not a multiple of group_size {group_size}")
    w = weight.detach().float().reshape(out, inp // group_size, group_size)
    qmax = 7 if bits == 4 else 127
    scale = w.abs().amax(-1) / qmax
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale.unsqueeze(-1)).clamp_(-qmax - 1, qmax).to(torch.int8).reshape(out, inp)
    return QuantizedWeight(q, scale, torch.zeros_like(scale), bits, group_size, "rtn")


def quantize_fp8(weight: torch.Tensor) -> QuantizedWeight:
    """float8 e4m3 values (round to nearest even) with one scale per output row, the row's
    largest magnitude over FP8_MAX. weight: [out, in] any float dtype."""
    w = weight.detach().float()
    scale = w.abs().amax(-1, keepdim=True) / FP8_MAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (w / scale).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return QuantizedWeight(q, scale, torch.zeros_like(scale), 8, w.shape[1], "rtn")


def quantize(weight: torch.Tensor, fmt: str, group_size: int = 32) -> QuantizedWeight:
    """``weight`` in one of FORMATS: int4/int8 round-to-nearest with groups of ``group_size``
    inputs, fp8 with per-row scales (``group_size`` unused). On the weight's device."""
    if fmt == "fp8":
        return quantize_fp8(weight)
    if fmt not in ("int4", "int8"):
        raise ValueError(f"format {fmt!r} is not one of {FORMATS}")
    return quantize_rtn(weight, int(fmt[3:]), group_size)


class QuantLinear(nn.Module):
    """``nn.Linear`` with a quantized weight (see the module docstring). Inference only.

    Holds the weight packed for its backend ("cpu": kernels/cpu.py; "int4pack": PyTorch's
    packed int4 kernel; "mma": the CUDA tensor-core GEMV; "triton": the other CUDA kernels;
    "dequantize": the portable form, multiplied after dequantizing), by default the fastest one
    for ``device``; ``dequantize()`` gives the float weight."""

    def __init__(self, qw: QuantizedWeight, bias: torch.Tensor | None = None, device=None,
                 backend: str | None = None, dtype: torch.dtype | None = None):
        """dtype: the activations' dtype where known (the CUDA tensor-core GEMV takes bf16 ones)."""
        super().__init__()
        device = torch.device(device or "cpu")
        self.out_features, self.in_features = qw.shape
        self.bits, self.group_size, self.source, self.fp8 = qw.bits, qw.group_size, qw.source, qw.fp8
        self.backend = backend or _backend_for(qw, device, dtype)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(device), requires_grad=False)
        if self.backend == "cpu":
            words, scale, zero = cpu_kernels.pack(qw.q, qw.scale, qw.zero, qw.bits, qw.group_size)
            self.register_buffer("words", words, persistent=False)
            self.register_buffer("scale", scale, persistent=False)
            self.register_buffer("zero", zero, persistent=False)
            self.activation_bits = cpu_kernels.activation_bits()
        elif self.backend == "int4pack":
            packed, scales_zeros = _pack_cpu(qw)
            self.register_buffer("packed", packed, persistent=False)
            self.register_buffer("scales_zeros", scales_zeros, persistent=False)
            self._kernel_k = qw.shape[1] * (2 if qw.bits == 8 else 1)
        elif self.backend == "mma":
            if not quant_mma.supports(qw.bits, qw.group_size, qw.shape[1], qw.fp8):
                raise ValueError(f"the 'mma' backend takes int4/int8 in groups of a multiple of 32 and rows of "
                                 f"whole {quant_mma.tile_k(qw.bits)}-input tiles, not {self.format} with "
                                 f"{qw.shape[1]} inputs")
            scale, zero = quant_gemv.compact_scales(qw.scale.to(device), qw.zero.to(device))
            n, k = qw.shape
            self.register_buffer("words", quant_mma.pack(qw.q.to(device), qw.bits), persistent=False)
            self.register_buffer("scale", quant_mma.pack_scales(scale, qw.bits, qw.group_size, n, k),
                                 persistent=False)
            self.register_buffer("zero", None if zero is None else quant_mma.pack_scales(
                zero, qw.bits, qw.group_size, n, k), persistent=False)
        elif self.backend == "triton":
            quant_gemv.check_group(qw.group_size, qw.shape[1])
            scale, zero = quant_gemv.compact_scales(qw.scale.to(device), qw.zero.to(device))
            self.register_buffer("words", quant_gemv.pack(qw.q.to(device), qw.bits), persistent=False)
            self.register_buffer("scale", scale, persistent=False)
            self.register_buffer("zero", zero, persistent=False)  # None: all offsets 0
        else:
            self.register_buffer("q", qw.q.to(device), persistent=False)
            self.register_buffer("scale", qw.scale.to(device), persistent=False)
            self.register_buffer("zero", qw.zero.to(device), persistent=False)

    @property
    def format(self) -> str:
        """``int4 g32 (gguf Q4_1)``, ``fp8 e4m3 per-row (rtn)``: what ``mtplx inspect`` prints."""
        if self.fp8:
            scales = "per-row" if self.group_size == self.in_features else f"g{self.group_size}"
            return f"fp8 e4m3 {scales} ({self.source})"
        return f"int{self.bits} g{self.group_size} ({self.source})"

    def weight_bytes(self) -> int:
        """Bytes one forward reads for the weight: integers, scales and offsets."""
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in] -> [..., out] in x's dtype."""
        if self.backend == "mma":
            return quant_mma.matmul(x, self.words, self.scale, self.zero, self.bias, **self._mma_args())
        if self.backend == "triton" and quant_gemv.usable(x):
            return quant_gemv.matmul(x, self.words, self.scale, self.zero, self.bias, **self._kernel_args())
        if self.backend == "cpu":
            a = x.reshape(-1, self.in_features).float()
            out = cpu_kernels.matmul(a, self.words, self.scale, self.zero, self.group_size, self.bits,
                                   self.activation_bits)
            if out.shape[1] != self.out_features:  # the padding row
                out = out[:, : self.out_features]
            out = out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)
        elif self.backend == "int4pack":
            out = self._forward_int4pack(x)
        else:
            out = F.linear(x, self.dequantize().to(x.dtype))
        return out if self.bias is None else out + self.bias.to(out.dtype)

    def silu_mul_forward(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up of this layer's output [..., 2 I] (gate first, a fused gate/up
        projection): x [..., in] -> [..., out / 2] in x's dtype. On the kernels, one launch (the
        SiLU * up is the GEMV's epilogue), else the product then ``layers.silu_mul``."""
        if self.backend == "mma" and quant_mma.fits(x, self.out_features, self.in_features, silu=True):
            return quant_mma.gemv(x, self.words, self.scale, self.zero, self.bias, silu=True, **self._mma_args())
        if self.backend == "triton" and quant_gemv.usable(x):
            return quant_gemv.matmul(x, self.words, self.scale, self.zero, self.bias, silu=True, **self._kernel_args())
        return silu_mul(self(x))

    def cpu_projection(self):
        """This weight as ``kernels/cpu.layer`` takes it, or None where that path cannot run it
        (another backend, a bias, int8 activations)."""
        if self.backend != "cpu" or self.bias is not None or self.activation_bits == 8:
            return None
        return cpu_kernels.projection(self.words, self.scale, self.zero, self.group_size, self.bits,
                                      self.out_features, self.activation_bits)

    def _kernel_args(self) -> dict:
        return dict(k=self.in_features, group=self.group_size, bits=self.bits, fp8=self.fp8)

    def _mma_args(self) -> dict:
        return dict(n=self.out_features, k=self.in_features, bits=self.bits)

    def _forward_int4pack(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        a = x.reshape(-1, self.in_features).to(torch.bfloat16)
        if self.bits == 8:  # the two planes read the same activations
            a = torch.cat((a, a), dim=1)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(a, self.packed, self.group_size, self.scales_zeros)
        if out.shape[1] != self.out_features:
            out = out[:, : self.out_features]
        return out.to(x.dtype).reshape(*lead, self.out_features)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out, in] the kernel computes with (bf16-rounded scales on the CPU,
        float16-rounded ones for the CUDA kernels, "triton" and "mma", where
        ``quant_gemv.compact_scales`` chose so)."""
        if self.backend == "triton":
            return quant_gemv.dequantize_reference(self.words, self.scale, self.zero, **self._kernel_args())
        if self.backend == "mma":
            return quant_mma.dequantize_reference(self.words, self.scale, self.zero, group=self.group_size,
                                                  **self._mma_args())
        if self.backend == "dequantize":
            return QuantizedWeight(self.q, self.scale, self.zero, self.bits, self.group_size).dequantize()
        if self.backend == "cpu":  # (what a product of many rows multiplies by)
            w = cpu_kernels.dequantize(self.words, self.scale, self.zero, self.group_size, self.bits)
            return w[: self.out_features]
        n, k, g = self.out_features, self.in_features, self.group_size
        rows = self.scales_zeros.shape[1]
        u = _unpack_cpu(self.packed, rows, self._kernel_k)
        sz = self.scales_zeros.float()
        planes = (u - 8).unflatten(1, (-1, g)) * sz[..., 0].T.unsqueeze(-1) + sz[..., 1].T.unsqueeze(-1)
        planes = planes.flatten(1)[:n]
        return planes[:, :k] + planes[:, k:] if self.bits == 8 else planes

    def select_rows(self, ids: torch.Tensor) -> "QuantLinear":
        """A layer of these output rows (``ids`` [N] long) of this "cpu" layer, sharing nothing:
        the same integers, scales and offsets, so its outputs are this layer's at those rows."""
        if self.backend != "cpu":
            raise ValueError(f"select_rows takes a 'cpu' layer, not {self.backend!r}")
        ids = ids.to(torch.long)
        u = cpu_kernels.unpack(self.words, self.bits).index_select(0, ids)
        q = (u - 8 if self.bits == 4 else u).to(torch.int8)
        scale = self.scale.index_select(0, ids).float()
        if self.zero.shape[1]:
            zero = self.zero.index_select(0, ids).float() + (8 * scale if self.bits == 4 else 0)
        else:  # int8 without offsets (``cpu_kernels.pack``)
            zero = torch.zeros_like(scale)
        qw = QuantizedWeight(q, scale, zero, self.bits, self.group_size, self.source)
        bias = None if self.bias is None else self.bias.index_select(0, ids)
        return QuantLinear(qw, bias, device=self.words.device, backend="cpu")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.format}, {self.backend}"


def _backend_for(qw: QuantizedWeight, device: torch.device, dtype: torch.dtype | None = None) -> str:
    """For int4/int8 on the CPU kernels/cpu.py's kernel where it builds here, else
    PyTorch's packed int4 kernel; on CUDA the tensor-core GEMV for int4 with bf16 activations
    (``dtype``: None counts as bf16, CUDA's default) (and int8 with
    ``MTPLX_CUDA_QUANT=mma``; ``cuda-cores`` keeps int4 off it), the other Triton kernels for the
    rest (where Triton is installed and the groups fit their layout); else dequantize-then-matmul.
    H200, 8B shape (docs/performance.md, session 12): int4 AR 370.8 tok/s on the tensor cores
    against 404.8 on the CUDA cores, but a verify of 1+3 tokens 1.04x its AR step against
    2.03x; int8 on the tensor cores 231.2 tok/s, slower than the CUDA cores' (313.4 in session 9)."""
    if device.type == "cpu" and not qw.fp8:
        if qw.group_size % 32 == 0 and cpu_kernels.fits(qw.scale, qw.zero, qw.bits) and cpu_kernels.available():
            return "cpu"
        if qw.group_size in GROUP_SIZES:
            return "int4pack"
    choice = os.environ.get("MTPLX_CUDA_QUANT", "auto")
    if choice not in ("auto", "mma", "cuda-cores"):
        raise ValueError(f"MTPLX_CUDA_QUANT={choice!r}: expected auto, mma or cuda-cores")
    wants_mma = choice == "mma" or (choice == "auto" and qw.bits == 4 and dtype in (None, torch.bfloat16))
    if (device.type == "cuda" and wants_mma
            and quant_mma.supports(qw.bits, qw.group_size, qw.shape[1], qw.fp8)
            and quant_mma.device_ok(device)):
        return "mma"
    if device.type == "cuda" and quant_gemv.triton is not None and (
            qw.group_size % quant_gemv.GROUP_MULTIPLE == 0 or qw.group_size == qw.shape[1]):
        return "triton"
    return "dequantize"


def _pack_cpu(qw: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 weight, scales_and_zeros [groups, out_padded, 2] bf16) for the int4 kernel,
    whose dequantization is ``(u - 8) * scale + zero`` with u the stored nibble in [0, 15]."""
    q, scale, zero = qw.q.to(torch.int32), qw.scale.float(), qw.zero.float()
    if qw.bits == 8:  # q = 16 * hi + lo: hi in [-8, 7] (scale 16 s, the offset z), lo in [0, 15] (scale s, offset 8 s)
        hi, lo = torch.div(q, 16, rounding_mode="floor"), torch.remainder(q, 16)
        u = torch.cat((hi + 8, lo), dim=1)
        scale, zero = torch.cat((16 * scale, scale), dim=1), torch.cat((zero, 8 * scale), dim=1)
    else:
        u = q + 8
    pad = -u.shape[0] % _PACK_ROWS
    if pad:  # zero rows, cut from the output
        u = F.pad(u, (0, 0, 0, pad), value=8)
        scale, zero = F.pad(scale, (0, 0, 0, pad)), F.pad(zero, (0, 0, 0, pad))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u.contiguous(), 1)
    scales_zeros = torch.stack((scale.T, zero.T), dim=-1).to(torch.bfloat16).contiguous()
    return packed, scales_zeros


def _unpack_cpu(packed: torch.Tensor, rows: int, k: int) -> torch.Tensor:
    """The nibbles u [rows, k] int32 back from the packed CPU layout (recovered by multiplying
    the packed weight with the identity: exact, since every nibble is a small integer)."""
    g = 32 if k % 32 == 0 else k
    eye = torch.eye(k, dtype=torch.bfloat16)
    ones = torch.stack((torch.ones(k // g, rows), torch.zeros(k // g, rows)), dim=-1).to(torch.bfloat16)
    # (u - 8) * 1 + 0 for each input: values in [-8, 7], exact in bf16
    return torch.ops.aten._weight_int4pack_mm_for_cpu(eye, packed, g, ones).T.float().round().to(torch.int32) + 8


def is_quantized(module: nn.Module) -> bool:
    return isinstance(module, QuantLinear)


def quantize_linears(module: nn.Module, fmt: str, group_size: int = 32) -> int:
    """Replace each ``nn.Linear`` below ``module`` by a ``QuantLinear`` of its weight in ``fmt``
    (one of FORMATS, quantized on the Linear's device), a block's q/k/v and gate/up fused into
    one matrix each as loading does; a Linear whose inputs are not whole groups stays float.
    Returns the count of QuantLinears made."""
    quantized = {name: (quantize(sub.weight, fmt, group_size), sub.bias)
                 for name, sub in module.named_modules()
                 if type(sub) is nn.Linear and (fmt == "fp8" or sub.in_features % group_size == 0)}
    dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), None)  # the activations'
    for name, (qw, bias) in fuse_quantized(module, quantized).items():
        parent, _, child = name.rpartition(".")
        setattr(module.get_submodule(parent), child, QuantLinear(qw, bias, device=qw.q.device, dtype=dtype))
    return len(quantized)


_FUSED = ((Attention, ("q_proj", "k_proj", "v_proj"), "qkv_proj"), (MLP, ("gate_proj", "up_proj"), "gate_up_proj"))


def fuse_quantized(module: nn.Module, quantized: dict) -> dict:
    """Quantized q/k/v (and gate/up) of one block with the same format become one matrix, one
    kernel call instead of three (two): on the CPU each call costs tens of microseconds.
    quantized: {module name: (QuantizedWeight, bias or None)}; the fused parts are removed from
    it and set to None on their block. Returns it."""
    for name, sub in list(module.named_modules()):
        for kind, parts, target in _FUSED:
            keys = [f"{name}.{p}" for p in parts]
            if type(sub) is not kind or not all(k in quantized for k in keys):
                continue
            weights, biases = zip(*(quantized[k] for k in keys))
            if (len({(w.bits, w.group_size, w.q.dtype) for w in weights}) > 1
                    or len({b is None for b in biases}) > 1):
                continue
            fused = QuantizedWeight(torch.cat([w.q for w in weights]), torch.cat([w.scale for w in weights]),
                                    torch.cat([w.zero for w in weights]), weights[0].bits, weights[0].group_size,
                                    " + ".join(sorted({w.source for w in weights})))
            quantized[f"{name}.{target}"] = (fused, None if biases[0] is None else torch.cat(biases))
            for key, part in zip(keys, parts):
                del quantized[key]
                setattr(sub, part, None)
    return quantized


def weight_formats(module: nn.Module) -> dict[str, str]:
    """Module name -> weight format ("int4 g32 (gguf Q4_1)", "float32") of every linear map."""
    out = {}
    for name, sub in module.named_modules():
        if isinstance(sub, QuantLinear):
            out[name] = sub.format
        elif isinstance(sub, nn.Linear):
            out[name] = str(sub.weight.dtype).replace("torch.", "")
    return out


def linear_weight_bytes(module: nn.Module) -> int:
    """Bytes of linear-map weights one token's forward reads (embedding lookups excluded)."""
    total, seen = 0, set()
    for sub in module.modules():
        if isinstance(sub, QuantLinear):
            total += sub.weight_bytes()
        elif isinstance(sub, nn.Linear) and sub.weight.data_ptr() not in seen:
            seen.add(sub.weight.data_ptr())
            total += sub.weight.numel() * sub.weight.element_size()
    return total
