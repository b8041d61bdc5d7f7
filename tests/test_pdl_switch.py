"""``kernels.pdl``: whether the Triton kernels use programmatic dependent launch. It must answer
(not raise) on every machine: CPU-only installs, GPUs without the feature, drivers it cannot read."""

from __future__ import annotations

import pytest
import torch

from mtplx import kernels


def test_pdl_answers_on_any_machine_and_is_off_on_the_cpu():
    assert kernels.pdl(torch.device("cpu")) is False
    assert isinstance(kernels.pdl(torch.device("cuda")), bool)
    assert isinstance(kernels._driver_version(), int) and kernels._driver_version() >= 0
    if not torch.cuda.is_available():
        assert kernels.pdl(torch.device("cuda")) is False  # no device, no driver to launch on


def test_pdl_switch_turns_it_off(monkeypatch):
    monkeypatch.setattr(kernels, "PDL", False)
    assert kernels.pdl(torch.device("cuda")) is False


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9
                    or kernels._driver_version() < 12030, reason="needs a Hopper-class GPU and a CUDA 12.3+ driver")
def test_pdl_is_on_for_hopper_with_a_recent_driver_and_triton(monkeypatch):
    monkeypatch.setattr(kernels, "PDL", True)  # whatever MTPLX_PDL says in this environment
    assert kernels._driver_version() >= 12030
    assert kernels.pdl(torch.device("cuda")) is kernels._supported()
    assert kernels.pdl(torch.device("cuda", 0)) is kernels._supported()
