"""Compile the tensor-core GEMVs (inline PTX: kernels/mma_gemv.py, kernels/quant_mma.py) and the
paged-attention kernel for an NVIDIA architecture on a machine without a GPU, and report each
configuration's registers and spills from ptxas, and whether the lane layout the mma fragments
rely on held: every inline PTX
of 4 packed elements over a 128-element tile axis must see them in Triton's layout of 4
consecutive elements a lane and 32 lanes along that axis (``lane_layout``; a load whose
addresses are not 4 contiguous elements a lane can make Triton choose another layout for the
tile's operands, and the GEMV then sums the wrong elements: a version of the scales' load did,
on an H100 in session 38, and this check flags it). A check to run before spending device time
(a kernel Triton refuses, a configuration that spills, or a broken lane layout shows here), not
a measurement of speed.

    pip install triton==3.6.0          # the device's version; its wheel bundles ptxas
    python benchmarks/compile_kernels.py [--arch 90] [--json r.json]

Each kernel is compiled at the configurations its ``config_for`` picks for SmolLM2's products (bf16,
5-16 rows) and the 8B shape's (int4 in groups of 32 and 128, int8 in groups of 128, with and
without offsets, 1-8 rows), with SiLU, bias and split-K variants; then the paged-attention kernel's decode and verify tiles on 8 and 4
warps; the exit status is 1 if any fails.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from mtplx.kernels import mma_gemv, paged_attention, quant_mma  # noqa: E402

SMOLLM2 = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
QWEN3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}
POINTERS = {"x_ptr": "*bf16", "w_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*fp16", "b_ptr": "*bf16",
            "out_ptr": "*bf16"}


ATTENTION_POINTERS = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "out_ptr": "*bf16", "tables_ptr": "*i64",
                      "pos_ptr": "*i64", "ml_ptr": "*fp32", "acc_ptr": "*fp32"}


def compile_kernel(fn, constexprs: dict, arch: int, partial: bool, warps: int | None = None):
    """The compiled ``fn`` with these constexprs (other arguments: pointers as named and 16-byte
    aligned, as Triton specializes them at run time, integers i32, ``zk`` and ``scale`` fp32; a
    partial-sum kernel writes float32), on ``warps`` warps (None: constexprs' WARPS)."""
    names = fn.arg_names
    pointers = ATTENTION_POINTERS if fn is paged_attention._paged_attention_kernel else POINTERS
    sig = {}
    for n in names:
        if n in constexprs:
            sig[n] = "constexpr"
        elif n in pointers:
            sig[n] = "*fp32" if n == "out_ptr" and partial else pointers[n]
        else:
            sig[n] = "fp32" if n in ("zk", "scale") else "i32"
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n in pointers if n in names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(n),): v for n, v in constexprs.items()},
                    attrs=aligned)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": warps or constexprs["WARPS"]})


def attention_cases():
    """(constexprs, warps, a label): the paged-attention kernel's decode and verify tiles on its
    own warps for short chunks (SHORT_WARPS) and on 4, pages of 16: the 8B shape (32 query heads
    on 8 KV heads, 128 dims) with split partials, and SmolLM2's (9 on 3, 64 dims) with and
    without them."""
    for tokens, m_pad in ((1, 16), (8, 32)):
        for warps in (paged_attention.SHORT_WARPS, 4):
            c = dict(GROUP=4, HEAD_DIM=128, PAGE=16, M_PAD=m_pad, LOOP_CHUNKS=0, PRECISION="tf32", BLOCK_N=64,
                     DYNAMIC_BOUND=True, PARTIAL=True, PDL=True)
            yield c, warps, f"attention {tokens} token{'s' if tokens > 1 else ''}"
    for tokens, m_pad in ((1, 16), (4, 16), (8, 32)):
        for warps in (paged_attention.SHORT_WARPS, 4):
            for partial in (True, False):
                c = dict(GROUP=3, HEAD_DIM=64, PAGE=16, M_PAD=m_pad, LOOP_CHUNKS=0, PRECISION="tf32", BLOCK_N=64,
                         DYNAMIC_BOUND=True, PARTIAL=partial, PDL=True)
                yield c, warps, f"attention smollm2 {tokens} token{'s' if tokens > 1 else ''}{' split' if partial else ''}"


def lane_layout(ttgir: str) -> dict:
    """{"tile_asm": how many inline PTX ops whose results are used take 4 packed elements of
    tensors whose last axis is a 128-element tile, "broken": how many of them see that axis in
    another layout than 4 consecutive elements a lane and 32 lanes (sizePerThread and
    threadsPerWarp ending 4 and 32)}. Ops whose results nothing reads are left out: Triton keeps
    copies of an impure one (the activations' loads under PDL) in other layouts after moving
    it, and ptxas drops them (no more global loads in the SASS with PDL than without)."""
    layouts = {name: (size, threads) for name, size, threads in re.findall(
        r"^(#\w+) = #ttg\.blocked<\{sizePerThread = \[([\d, ]+)\], threadsPerWarp = \[([\d, ]+)\]", ttgir, re.M)}
    lines = ttgir.splitlines()
    tile_asm = broken = 0
    for i, line in enumerate(lines):
        if "elementwise_inline_asm" not in line or "packed_element = 4" not in line or "=" not in line:
            continue
        tensors = re.findall(r"tensor<((?:\d+x)+)\w+, (#\w+)>", line)
        if not tensors or any(not shape.endswith("128x") for shape, _ in tensors):
            continue
        result = line.split("=")[0].strip().split(":")[0]
        used = re.compile(re.escape(result) + r"(?![\w])")
        if not any(used.search(other) for j, other in enumerate(lines) if j != i):
            continue
        tile_asm += 1
        lanes = [layouts.get(name, ("", "")) for _, name in tensors]
        if any(size.split(", ")[-1] != "4" or threads.split(", ")[-1] != "32" for size, threads in lanes):
            broken += 1
    return {"tile_asm": tile_asm, "broken": broken}


def ptxas_info(ptx: str, arch: int) -> dict:
    """Registers and spill bytes ptxas -v reports for this PTX (sm_XXa)."""
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        run = subprocess.run([str(ptxas), "-v", "--gpu-name", f"sm_{arch}a", str(src), "-o", str(Path(tmp) / "k.o")],
                             capture_output=True, text=True, check=True)
    info = {}
    for line in (run.stdout + run.stderr).splitlines():
        if "spill stores" in line:
            info["spill_store_bytes"] = int(line.split("bytes spill stores")[0].split(",")[-1])
        if "Used" in line and "registers" in line:
            info["registers"] = int(line.split("Used")[1].split("registers")[0])
    return info


def cases():
    """(kernel, its constexprs, whether it writes partial sums, a label)."""
    for name, (n, k) in SMOLLM2.items():
        silu = name == "gate_up"
        for rows in (5, 8, 9, 16):
            warps, units, split = mma_gemv.config_for(n, k, rows, silu)
            for bias in (False, True):
                c = dict(PAIRS=2 if silu else 1, WARPS=warps, UNITS=units, HAS_BIAS=bias, PARTIAL=split > 1,
                         SILU=silu, NB=-(-rows // 8), PDL=True)
                yield mma_gemv._bf16_mma_kernel, c, split > 1, f"bf16 {name} {rows} rows{' bias' if bias else ''}"
        c = dict(PAIRS=2 if silu else 1, WARPS=4, UNITS=4, HAS_BIAS=False, PARTIAL=True, SILU=silu, NB=2, PDL=True)
        yield mma_gemv._bf16_mma_kernel, c, True, f"bf16 {name} 16 rows split"
    for name, (n, k) in QWEN3_8B.items():
        silu = name == "gate_up"
        for bits, group in ((4, 32), (4, 128), (8, 128)):
            tpg = group // quant_mma.tile_k(bits) if quant_mma.whole_tile_groups(bits, group) else 0
            for zero in (False, True):
                warps, units, split = quant_mma.config_for(n, k, silu, zero, bits, tpg)
                c = dict(INT8=bits == 8, PAIRS=2 if silu else 1, WARPS=warps, UNITS=units, HAS_ZERO=zero,
                         HAS_BIAS=False, PARTIAL=split > 1, SILU=silu, PDL=True, TPG=tpg)
                yield (quant_mma._mma_gemv_kernel, c, split > 1,
                       f"int{bits} g{group} {name}{' offsets' if zero else ''}")


def compile_case(fn, constexprs: dict, arch: int, partial: bool, warps: int | None = None,
                 layout: bool = False) -> dict:
    """One case's ptxas figures (``ptxas_info``) and, with ``layout``, its tile PTX's lane layout
    (``lane_layout``, an error where it broke); "error" where anything failed."""
    entry = {}
    try:
        kernel = compile_kernel(fn, constexprs, arch, partial, warps)
        entry.update(ptxas_info(kernel.asm["ptx"], arch))
        if layout:
            entry["lane_layout"] = lane_layout(kernel.asm["ttgir"])
            if entry["lane_layout"]["broken"] or not entry["lane_layout"]["tile_asm"]:
                entry["error"] = f"lane layout: {entry['lane_layout']}"
    except Exception as exc:  # report every failure, then exit 1
        entry["error"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
    return entry


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--json")
    ap.add_argument("--only", choices=("gemv", "attention"), help="compile only these cases")
    args = ap.parse_args()
    report, failed = [], 0
    for fn, constexprs, partial, label in cases() if args.only != "attention" else ():
        entry = {"kernel": fn.__name__, "case": label, "constexprs": constexprs,
                 **compile_case(fn, constexprs, args.arch, partial, layout=True)}
        failed += "error" in entry
        report.append(entry)
        cfg = (constexprs["WARPS"], constexprs["UNITS"])
        print(f"{label:32s} warps/units {cfg}: " + (entry.get("error", "")[:300] or
              f"{entry.get('registers')} registers, {entry.get('spill_store_bytes')} bytes spilled, "
              f"{entry['lane_layout']['tile_asm']} tile PTX ops in the lane layout"), flush=True)
    for constexprs, warps, label in attention_cases() if args.only != "gemv" else ():
        entry = {"kernel": "_paged_attention_kernel", "case": label, "constexprs": constexprs, "warps": warps,
                 **compile_case(paged_attention._paged_attention_kernel, constexprs, args.arch, False, warps)}
        failed += "error" in entry
        report.append(entry)
        print(f"{label:32s} warps {warps}: " + (entry.get("error", "")[:300] or
              f"{entry.get('registers')} registers, {entry.get('spill_store_bytes')} bytes spilled"), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"arch": args.arch, "triton": triton.__version__, "cases": report},
                                              indent=2))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
