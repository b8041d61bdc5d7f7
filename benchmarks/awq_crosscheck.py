"""AWQ's GEMM layout as loading/prequantized.py reads it, against AutoAWQ's own reader
(``dequantize_gemm`` in ``awq/utils/packing_utils.py``, a file that needs only torch) from an
AutoAWQ source tree (e.g. the PyPI sdist of autoawq 0.2.9, unpacked): tests/test_prequantized.py's
AWQ writer and random int32 words, each read both ways.

    pip download autoawq==0.2.9 --no-deps -d /tmp/w && tar xzf /tmp/w/autoawq-0.2.9.tar.gz -C /tmp/w
    python benchmarks/awq_crosscheck.py --autoawq-src /tmp/w/autoawq-0.2.9
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mtplx.loading import prequantized  # noqa: E402
from tests.test_prequantized import _awq_tensors  # noqa: E402


def ours(t: dict, group: int) -> torch.Tensor:
    state = {f"m.{k}": v for k, v in t.items()}
    return prequantized.unpack_state(state, prequantized.Scheme("awq", {4}, group), torch.float32)["m.weight"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--autoawq-src", required=True)
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location("awq_packing", Path(args.autoawq_src) / "awq/utils/packing_utils.py")
    awq = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(awq)
    torch.manual_seed(0)
    for out_f, in_f, g in ((64, 64, 32), (128, 64, 64), (64, 128, 32)):
        t, dense = _awq_tensors(torch.randn(out_f, in_f) * 0.05, g)
        theirs = awq.dequantize_gemm(t["qweight"], t["qzeros"], t["scales"], 4, g).float().T  # float16 arithmetic
        mine = ours(t, g)
        w = mine.dequantize() if isinstance(mine, prequantized.QuantizedWeight) else mine
        print(f"{out_f} x {in_f}, groups of {g}: max |AutoAWQ - writer's weights| {float((theirs - dense).abs().max()):.2e}, "
              f"max |mtplx - AutoAWQ| {float((w - theirs).abs().max()):.2e}, max |w| {float(theirs.abs().max()):.3f}")
    qweight = torch.randint(-2**31, 2**31 - 1, (64, 16), dtype=torch.int32)
    qzeros = torch.randint(-2**31, 2**31 - 1, (2, 16), dtype=torch.int32)
    scales = (torch.rand(2, 128) * 0.01 + 1e-3).half()
    theirs = awq.dequantize_gemm(qweight, qzeros, scales, 4, 32).float().T
    mine = ours({"qweight": qweight, "qzeros": qzeros, "scales": scales}, 32).dequantize()
    print(f"random words, 128 x 64, groups of 32: max |mtplx - AutoAWQ| {float((mine - theirs).abs().max()):.2e}, "
          f"max |w| {float(theirs.abs().max()):.3f} (AutoAWQ multiplies in float16: half a float16 step apart)")


if __name__ == "__main__":
    main()
