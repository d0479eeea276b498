"""The checkout's generic folder names must not shadow installed libraries inside the tests."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_top_level_project_folders_are_not_importable_by_their_bare_names():
    for name in ("kernels", "router", "engine", "gateway", "client", "proto"):
        spec = importlib.util.find_spec(name)
        origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
        assert origin is None or origin.parent != ROOT / name, f"{name} resolves to the checkout: {origin}"


def test_the_project_is_still_importable_as_splitserve_and_tests_helpers_too():
    import splitserve.kernels
    from tests.fixtures import models

    assert Path(splitserve.kernels.__file__).resolve().parent == ROOT / "kernels"
    assert Path(models.__file__).resolve().parent == ROOT / "tests" / "fixtures"
