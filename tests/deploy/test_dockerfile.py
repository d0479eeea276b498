"""deploy/docker/Dockerfile agrees with the chart and the package: targets named as
the chart's image flavors, the chart's uid, and a slim image whose requirement list
(computed from pyproject.toml by the Dockerfile's own snippet) has no GPU stack."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "deploy" / "docker" / "Dockerfile"
VALUES = yaml.safe_load((ROOT / "deploy" / "helm" / "splitserve" / "values.yaml").read_text())


def stages() -> dict[str, str]:
    """Stage name -> its text."""
    text = DOCKERFILE.read_text()
    parts = re.split(r"^FROM\s+\S+\s+AS\s+(\S+)\s*$", text, flags=re.MULTILINE | re.IGNORECASE)
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def test_targets_match_the_chart_image_flavors():
    assert {"slim", "cuda"} <= set(stages())
    assert set(VALUES["images"]) - {"pullPolicy", "pullSecrets"} == {"slim", "cuda"}


def test_images_run_as_the_charts_user_through_tini():
    uid, gid = VALUES["podSecurityContext"]["runAsUser"], VALUES["podSecurityContext"]["runAsGroup"]
    for name in ("slim", "cuda"):
        text = stages()[name]
        assert f"USER {uid}:{gid}" in text, name
        assert 'ENTRYPOINT ["/usr/bin/tini", "--"]' in text, name
        # The chart's args start with `splitserve`: it must be on PATH.
        assert "PATH=/opt/splitserve/bin:$PATH" in text, name


def test_slim_requirements_come_from_pyproject_without_the_gpu_stack():
    text = stages()["slim-build"]
    snippet = re.search(r"<<'EOF' > /tmp/requirements-slim.txt\n(.*?)\nEOF\n", text, flags=re.DOTALL).group(1)
    extras = re.search(r'ARG SLIM_EXTRAS="([^"]*)"', text).group(1)
    out = subprocess.run(
        [sys.executable, "-c", snippet],
        cwd=ROOT,
        env={"SLIM_EXTRAS": extras},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    names = {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in out}
    assert "torch" not in names and "triton" not in names
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for requirement in deps:
        name = re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower()
        assert (name in names) == (name != "torch"), name
    assert "torch" not in stages()["slim"]


def test_workers_image_installs_the_gpu_extras():
    cuda = stages()["cuda"]
    assert '"torch==${TORCH_VERSION}"' in cuda
    assert 'pip install ".[nixl,gpu]"' in cuda
