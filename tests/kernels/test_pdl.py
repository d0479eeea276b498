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


def test_a_kernel_can_keep_its_dependents_until_it_exits(monkeypatch):
    """`signal_early=False` takes mode 2 as 1 for that launch (its dependents launch as it exits);
    modes 0 and 1 are left as they are."""
    from splitserve.kernels import _pdl

    cpu = torch.device("cpu")
    for mode, expected in ((2, {"PDL": 1, "launch_pdl": True}), (1, {"PDL": 1, "launch_pdl": True}), (0, {"PDL": 0})):
        monkeypatch.setattr(_pdl, "pdl_mode", lambda device, mode=mode: mode)
        assert pdl_launch(cpu, signal_early=False) == expected
    monkeypatch.setattr(_pdl, "pdl_mode", lambda device: 2)
    assert pdl_launch(cpu) == {"PDL": 2, "launch_pdl": True}


def test_unsplit_decode_attention_is_told_apart_only_where_pdl_signals_early(monkeypatch):
    from splitserve.kernels import paged_decode

    kv = torch.empty(2, 4, 8, 16, 8)  # [2, blocks, kv heads, block size, head dim]
    assert not paged_decode.decode_attention_unsplit(64, kv, 3)  # no PDL off CUDA: nothing to steer
    monkeypatch.setattr(paged_decode, "pdl_mode", lambda device: 2)
    assert paged_decode.decode_attention_unsplit(64, kv, 3)  # a big batch, short contexts: one launch
    assert not paged_decode.decode_attention_unsplit(1, kv, 512)  # one long sequence: split
    monkeypatch.setattr(paged_decode, "pdl_mode", lambda device: 1)
    assert not paged_decode.decode_attention_unsplit(64, kv, 3)
