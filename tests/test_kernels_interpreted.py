"""The Triton sampling and quantized-GEMV kernels' own tests, run under Triton's interpreter in a
child process: CI has no GPU, and the interpreter is chosen when Triton is imported, so these
tests cannot share the suite's process (where they skip). On a CUDA machine, or with
TRITON_INTERPRET=1 already set, those files run directly instead. The three children start
together (the interpreter is one Python thread each, so on CI's two cores they overlap)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

from mtplx.kernels import fused

ROOT = Path(__file__).resolve().parent.parent
FILES = ["tests/test_sampling_kernels.py", "tests/test_quant_kernels_triton.py", "tests/test_cycle_kernels.py"]


@pytest.fixture(scope="module")
def children():
    """Each file's pytest run under the interpreter, all started at once: path -> (process, its
    output file)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, path in enumerate(FILES):
            out = open(Path(tmp) / f"{i}.log", "w+")
            runs[path] = (subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path],
                                           cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True), out)
        try:
            yield runs
        finally:
            for process, out in runs.values():
                process.kill()
                process.wait()
                out.close()


@pytest.mark.skipif(not fused.available(), reason="needs Triton")
@pytest.mark.skipif(torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1",
                    reason="the kernel tests run directly here")
@pytest.mark.parametrize("path", FILES)
def test_kernel_tests_pass_under_the_interpreter(path, children):
    process, out = children[path]
    code = process.wait(timeout=900)
    out.seek(0)
    log = out.read()
    assert code == 0, log[-6000:]
    assert " passed" in log.strip().splitlines()[-1]
