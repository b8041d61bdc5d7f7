"""The Triton sampling and quantized-GEMV kernels' own tests, run under Triton's interpreter in a
child process: CI has no GPU, and the interpreter is chosen when Triton is imported, so these
tests cannot share the suite's process (where they skip). On a CUDA machine, or with
TRITON_INTERPRET=1 already set, those files run directly instead."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mtplx.kernels import fused

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.skipif(not fused.available(), reason="needs Triton")
@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="the kernel tests run directly here")
@pytest.mark.parametrize("path", ["tests/test_sampling_kernels.py", "tests/test_quant_kernels_triton.py",
                                  "tests/test_cycle_kernels.py"])
def test_kernel_tests_pass_under_the_interpreter(path):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout.splitlines()[-1]
