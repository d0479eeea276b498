"""Programmatic dependent launch switch (kernels/_pdl.py): off where it cannot run, a clear error
for a bad setting; the kernels' results with it are covered by every kernel test on a GPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from splitserve.kernels._pdl import pdl_launch, pdl_mode  # noqa: E402


def test_off_the_gpu_no_launch_flag_is_passed(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_PDL", "2")
    assert pdl_mode(torch.device("cpu")) == 0
    assert pdl_launch(torch.device("cpu")) == {"PDL": 0}  # Triton's interpreter never sees launch_pdl


def test_a_bad_setting_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_PDL", "on")
    with pytest.raises(ValueError, match="SPLITSERVE_PDL must be 0"):
        pdl_mode(torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu_the_setting_decides(monkeypatch):
    cuda = torch.device("cuda")
    capable = torch.version.hip is None and torch.cuda.get_device_capability()[0] >= 9
    monkeypatch.setenv("SPLITSERVE_PDL", "0")
    assert pdl_launch(cuda) == {"PDL": 0}
    monkeypatch.setenv("SPLITSERVE_PDL", "1")
    assert pdl_launch(cuda) == ({"PDL": 1, "launch_pdl": True} if capable else {"PDL": 0})
