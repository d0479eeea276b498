"""No pickle anywhere: scripts/check_no_pickle.py passes on the source, and catches what it must."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("check_no_pickle", ROOT / "scripts" / "check_no_pickle.py")
check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(check)


def test_the_source_has_no_unsafe_deserialization():
    assert check.problems() == []


@pytest.mark.parametrize(
    "source, rule",
    [
        ("import pickle", "pickle"),
        ("from cloudpickle import loads", "pickle"),
        ("import dill.settings", "pickle"),
        ("import torch\ntorch.load(f)", "torch.load"),
        ("import torch\ntorch.load(f, weights_only=False)", "torch.load"),
        ("import numpy as np\nnp.load(f, allow_pickle=True)", "allow_pickle"),
        ("import yaml\nyaml.load(text)", "yaml"),
        ("import yaml\nyaml.load(text, Loader=yaml.FullLoader)", "yaml"),
        ("m = AutoModel.from_pretrained(p, use_safetensors=False)", "bin-weights"),
        ("state = load_state_dict('pytorch_model.bin')", "bin-weights"),
    ],
)
def test_unsafe_constructs_are_found(source, rule):
    assert [r for _, r, _ in check.findings(source)] == [rule]


@pytest.mark.parametrize(
    "source",
    [
        "import torch\ntorch.load(f, weights_only=True)",
        "import yaml\nyaml.safe_load(text)",
        "import yaml\nyaml.load(text, Loader=yaml.SafeLoader)",
        "from safetensors.torch import load_file\nload_file('model.safetensors')",
        "pickles = sorted(path.glob('*.bin'))  # refusing them is fine",
    ],
)
def test_safe_constructs_pass(source):
    assert check.findings(source) == []
