"""The Helm chart: `scripts/check_helm.sh` passes (helm lint --strict, helm template,
offline Kubernetes schema validation for the defaults and every example), and the
rendered manifests say what the values say: the --inference-shards string, GPU
requests, probes, preStop + grace periods, PDBs, non-root pods, and command lines
the real `splitserve` CLI accepts.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "splitserve"
EXAMPLES = sorted((ROOT / "deploy" / "helm" / "examples").glob("*.yaml"))
RELEASE, NAMESPACE = "demo", "splitserve"  # what check_helm.sh renders with
FULLNAME = f"{RELEASE}-splitserve"
SPLITSERVE_COMPONENTS = {"control-plane", "router", "gateway", "prefill-worker", "decode-worker"}


@pytest.fixture(scope="module")
def rendered(tmp_path_factory) -> dict[str, list[dict]]:
    """case name ("default", "tp-mismatched", ...) -> its rendered manifests."""
    out = tmp_path_factory.mktemp("rendered")
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "check_helm.sh")],
        # CI also calls check_helm.sh itself, with helm 4 and helm 3; here helm 4 is enough.
        env={"HELM_MAJORS": "4", **os.environ, "RENDER_DIR": str(out)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"check_helm.sh failed:\n{proc.stdout}\n{proc.stderr}"
    assert "chart OK" in proc.stdout
    return {p.stem: [d for d in yaml.safe_load_all(p.read_text()) if d] for p in out.glob("*.yaml")}


def values_of(case: str) -> dict:
    """The chart's defaults merged with the case's values file (as Helm merges: maps deep, lists replaced)."""
    merged = yaml.safe_load((CHART / "values.yaml").read_text())
    path = next((p for p in [*EXAMPLES, *CHART.glob("ci/*-values.yaml")] if _case_name(p) == case), None)
    if path is not None:
        _merge(merged, yaml.safe_load(path.read_text()))
    return merged


def _case_name(path: Path) -> str:
    return path.stem.removesuffix("-values")


def _merge(base: dict, override: dict) -> None:
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = value


def kinds(docs: list[dict], kind: str) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def workloads(docs: list[dict]) -> dict[str, dict]:
    return {**kinds(docs, "Deployment"), **kinds(docs, "StatefulSet")}


def component(workload: dict) -> str:
    return workload["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]


def workers(docs: list[dict]) -> dict[str, dict]:
    return {n: w for n, w in workloads(docs).items() if component(w).endswith("-worker")}


def main_container(workload: dict) -> dict:
    return workload["spec"]["template"]["spec"]["containers"][0]


def flag(container: dict, name: str) -> str | None:
    """The value of `--name=value` in the container's args."""
    for arg in container["args"]:
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
    return None


def config_map(docs: list[dict]) -> dict[str, str]:
    return kinds(docs, "ConfigMap")[f"{FULLNAME}-config"]["data"]


# -- what CI checks -------------------------------------------------------------------------------


def test_check_helm_renders_the_defaults_every_example_and_ci_scenario(rendered):
    expected = {
        "default",
        *(_case_name(p) for p in EXAMPLES),
        *(_case_name(p) for p in CHART.glob("ci/*-values.yaml")),
    }
    assert expected <= set(rendered)
    assert {"single-node", "tp-mismatched", "external-etcd"} <= expected


@pytest.mark.parametrize(
    ("case", "spec"),
    [
        ("default", "tp=2,pp=1,dp=1,role=prefill+tp=1,pp=1,dp=2,role=decode"),
        ("tp-mismatched", "tp=4,pp=1,dp=1,role=prefill+tp=2,pp=1,dp=2,role=decode"),
        ("etcd-auth-tls", "tp=1,pp=1,dp=1,role=prefill+tp=2,pp=2,dp=1,role=decode"),
    ],
)
def test_inference_shards_rendered_from_values(rendered, case, spec):
    docs = rendered[case]
    assert config_map(docs)["SPLITSERVE_INFERENCE_SHARDS"] == spec
    control_plane = main_container(workloads(docs)[f"{FULLNAME}-control-plane"])
    assert flag(control_plane, "inference-shards") == "$(SPLITSERVE_INFERENCE_SHARDS)"


@pytest.mark.parametrize(
    "case", ["default", "tp-mismatched", "single-node", "external-etcd", "etcd-auth-tls"]
)
def test_one_worker_deployment_per_shard_group_sized_from_the_spec(rendered, case):
    """The real spec parser's groups map one-to-one onto worker Deployments:
    replicas = dp, --tp/--pp = the group's, GPUs per pod = tp x pp (requests = limits)."""
    from splitserve.control_plane.shard_spec import parse_inference_shards

    docs = rendered[case]
    values = values_of(case)
    spec = parse_inference_shards(config_map(docs)["SPLITSERVE_INFERENCE_SHARDS"])
    pools = workers(docs)
    assert len(pools) == len(spec.groups) == len(values["inferenceShards"])
    for group, group_values in zip(spec.groups, values["inferenceShards"], strict=True):
        name = group_values.get("name") or f"{group.role.value}-{group.index}"
        workload = pools[f"{FULLNAME}-{name}"]
        container = main_container(workload)
        assert component(workload) == f"{group.role.value}-worker"
        assert container["args"][:2] == ["splitserve", f"{group.role.value}-worker"]
        assert workload["spec"]["replicas"] == group.dp
        assert (flag(container, "tp"), flag(container, "pp")) == (str(group.tp), str(group.pp))
        resources = container["resources"]
        assert resources["requests"]["nvidia.com/gpu"] == group.tp * group.pp
        assert resources["limits"]["nvidia.com/gpu"] == group.tp * group.pp
        # A surplus worker would find no free slot: never surge.
        assert workload["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0


def test_gpu_pools_tolerate_gpu_taints_and_sim_pools_request_no_gpus(rendered):
    for workload in workers(rendered["default"]).values():
        tolerations = workload["spec"]["template"]["spec"]["tolerations"]
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in tolerations
    for workload in workers(rendered["cpu-sim"]).values():
        container = main_container(workload)
        assert flag(container, "engine") == "sim"
        assert "nvidia.com/gpu" not in container["resources"].get("requests", {})
        assert "nvidia.com/gpu" not in container["resources"].get("limits", {})
    tp = workers(rendered["tp-mismatched"])
    pod = tp[f"{FULLNAME}-prefill-tp4"]["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert pod["runtimeClassName"] == "nvidia"
    assert main_container(tp[f"{FULLNAME}-prefill-tp4"])["resources"]["limits"]["rdma/ib"] == 1


@pytest.mark.parametrize("case", ["default", "tp-mismatched", "cpu-sim"])
def test_grpc_probes_on_the_serving_port(rendered, case):
    for name, workload in workloads(rendered[case]).items():
        if component(workload) not in SPLITSERVE_COMPONENTS:
            continue
        container = main_container(workload)
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if component(workload) == "gateway":
                # Readiness follows the router (/health); startup and liveness only the port.
                check = container[probe]["httpGet" if probe == "readinessProbe" else "tcpSocket"]
                assert check["port"] == "http", name
            else:
                assert container[probe]["grpc"]["port"] == ports["grpc"], name
        listen = flag(container, "listen")
        if component(workload).endswith("-worker"):
            # The worker registers this address in etcd: the pod IP, never a wildcard or loopback.
            assert listen == f"$(POD_IP):{ports['grpc']}", name
        elif component(workload) == "gateway":
            assert (flag(container, "host"), flag(container, "port")) == ("0.0.0.0", str(ports["http"])), name
        else:
            assert listen == f"0.0.0.0:{ports['grpc']}", name


@pytest.mark.parametrize("case", ["default", "tp-mismatched", "single-node"])
def test_prestop_drain_fits_in_the_termination_grace_period(rendered, case):
    values = values_of(case)
    for name, workload in workloads(rendered[case]).items():
        if component(workload) not in SPLITSERVE_COMPONENTS:
            continue
        pod = workload["spec"]["template"]["spec"]
        container = main_container(workload)
        command = container["lifecycle"]["preStop"]["exec"]["command"]
        assert command[0] == "sleep", name
        pre_stop = int(command[1])
        grace = pod["terminationGracePeriodSeconds"]
        if component(workload).endswith("-worker"):
            drain = float(flag(container, "grace-s")) + float(flag(container, "handoff-lease-s"))
            w = values["workers"]
            assert pre_stop == w["preStopDelaySeconds"]
            assert grace == pre_stop + math.ceil(drain) + w["shutdownMarginSeconds"], name
        elif component(workload) in ("control-plane", "router"):
            assert grace > pre_stop + float(flag(container, "grace-period")), name
        else:
            assert grace > pre_stop + values["gateway"]["gracePeriodSeconds"], name


def test_worker_grace_period_follows_engine_values(rendered):
    # tp-mismatched: grace 30 s + lease 20 s + preStop 5 s + margin 15 s.
    for workload in workers(rendered["tp-mismatched"]).values():
        assert workload["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == 70


@pytest.mark.parametrize("case", ["default", "tp-mismatched", "single-node", "external-etcd", "cpu-sim"])
def test_every_workload_has_a_pdb_selecting_only_its_pods(rendered, case):
    docs = rendered[case]
    pdbs = kinds(docs, "PodDisruptionBudget")
    pods = {name: w["spec"]["template"]["metadata"]["labels"] for name, w in workloads(docs).items()}

    def selects(pdb: dict, labels: dict) -> bool:
        return pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()

    for name, labels in pods.items():
        matching = [p for p in pdbs.values() if selects(p, labels)]
        assert len(matching) == 1, f"{name}: {len(matching)} PDBs select its pods"
        assert matching[0]["metadata"]["name"] == name
        assert matching[0]["spec"]["maxUnavailable"] == 1
    assert len(pdbs) == len(pods)


def test_pdbs_can_be_turned_off(rendered):
    assert not kinds(rendered["minimal"], "PodDisruptionBudget")


@pytest.mark.parametrize("case", ["default", "tp-mismatched", "etcd-auth-tls", "cpu-sim"])
def test_pods_run_as_non_root_without_privilege_escalation(rendered, case):
    docs = rendered[case]
    pods = [(n, w["spec"]["template"]["spec"]) for n, w in workloads(docs).items()]
    pods += [(n, j["spec"]["template"]["spec"]) for n, j in kinds(docs, "Job").items()]
    assert pods
    for name, pod in pods:
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["runAsUser"] != 0, name
        assert pod["automountServiceAccountToken"] is False, name
        for container in pod.get("initContainers", []) + pod["containers"]:
            ctx = container["securityContext"]
            assert ctx["allowPrivilegeEscalation"] is False, name
            assert ctx["readOnlyRootFilesystem"] is True, name
            assert ctx["capabilities"]["drop"] == ["ALL"], name


def test_images_slim_for_light_components_cuda_for_workers(rendered):
    for workload in workloads(rendered["default"]).values():
        image = main_container(workload)["image"]
        if component(workload).endswith("-worker"):
            assert image.endswith("-cuda"), image
        elif component(workload) in SPLITSERVE_COMPONENTS:
            assert image.endswith("-slim"), image


def test_external_etcd_replaces_the_statefulset(rendered):
    docs = rendered["external-etcd"]
    assert not kinds(docs, "StatefulSet")
    assert config_map(docs)["SPLITSERVE_ETCD"] == "etcd-client.infra.svc:2379"
    assert config_map(docs)["SPLITSERVE_CLUSTER"] == "team-a"
    assert config_map(rendered["default"])["SPLITSERVE_ETCD"] == f"{FULLNAME}-etcd.{NAMESPACE}.svc:2379"


def test_etcd_members_auth_and_tls(rendered):
    docs = rendered["etcd-auth-tls"]
    etcd = kinds(docs, "StatefulSet")[f"{FULLNAME}-etcd"]
    assert etcd["spec"]["replicas"] == 3
    assert etcd["spec"]["podManagementPolicy"] == "Parallel"
    args = main_container(etcd)["args"]
    cluster = next(a for a in args if a.startswith("--initial-cluster="))
    assert cluster.count("https://") == 3
    assert "--client-cert-auth" in args and "--peer-client-cert-auth" in args
    job = kinds(docs, "Job")[f"{FULLNAME}-etcd-auth"]
    assert job["metadata"]["annotations"]["helm.sh/hook"] == "post-install"
    steps = [c["command"][1:3] for c in job["spec"]["template"]["spec"]["initContainers"]]
    steps += [c["command"][1:3] for c in job["spec"]["template"]["spec"]["containers"]]
    assert steps == [["user", "add"], ["user", "grant-role"], ["auth", "enable"]]
    assert "root-password" in kinds(docs, "Secret")[f"{FULLNAME}-etcd-auth"]["data"]
    # Default: one member with a persistent volume.
    default = kinds(rendered["default"], "StatefulSet")[f"{FULLNAME}-etcd"]
    assert default["spec"]["replicas"] == 1
    assert default["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "8Gi"


def test_otel_environment(rendered):
    on = config_map(rendered["tp-mismatched"])
    assert on["OTEL_SDK_DISABLED"] == "false"
    assert on["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability.svc:4317"
    assert on["OTEL_TRACES_SAMPLER_ARG"] == "0.05"
    assert config_map(rendered["default"])["OTEL_SDK_DISABLED"] == "true"
    router = main_container(workloads(rendered["tp-mismatched"])[f"{FULLNAME}-router"])
    env = {e["name"]: e.get("value") for e in router["env"]}
    assert env["OTEL_SERVICE_NAME"] == "splitserve-router"
    assert "deployment.environment=production" in env["OTEL_RESOURCE_ATTRIBUTES"]


def test_gateway_args_override_and_ingress(rendered):
    gateway = main_container(workloads(rendered["gateway-args"])[f"{FULLNAME}-gateway"])
    assert gateway["args"] == [
        "splitserve", "gateway", "--router=demo-splitserve-router:50061", "--host=$(POD_IP)", "--port=8000",
        "--model=/models/tiny", "--served-model-name=tiny",
    ]  # fmt: skip
    env = {e["name"]: e for e in gateway["env"]}
    assert env["SPLITSERVE_API_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "splitserve-api-keys",
        "key": "api-keys",
    }
    default = main_container(workloads(rendered["default"])[f"{FULLNAME}-gateway"])
    assert flag(default, "router") == f"{FULLNAME}-router.{NAMESPACE}.svc:50061"
    assert "SPLITSERVE_API_KEY" not in {e["name"] for e in default["env"]}
    ingress = kinds(rendered["single-node"], "Ingress")[f"{FULLNAME}-gateway"]
    assert ingress["spec"]["rules"][0]["host"] == "llm.local"
    assert not kinds(rendered["minimal"], "Ingress") and f"{FULLNAME}-gateway" not in workloads(
        rendered["minimal"]
    )


# -- the chart cannot drift from the CLI ------------------------------------------------------------


def _container_env(docs: list[dict], container: dict) -> dict[str, str]:
    """The environment Kubernetes would give the container (downward API values made up)."""
    env: dict[str, str] = {}
    maps = kinds(docs, "ConfigMap")
    for source in container.get("envFrom", []):
        env.update(maps[source["configMapRef"]["name"]]["data"])
    fields = {"status.podIP": "10.1.2.3", "metadata.name": "pod-0", "metadata.namespace": NAMESPACE,
              "spec.nodeName": "node-0"}  # fmt: skip
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = _expand(item["value"], env)
        elif "fieldRef" in item.get("valueFrom", {}):
            env[item["name"]] = fields[item["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[item["name"]] = "secret"
    return env


def _expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion; an unknown $(VAR) stays as written (and would fail the parse below)."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def _parse_with_real_cli(argv: list[str], env: dict[str, str], monkeypatch) -> argparse.Namespace:
    """Parses as `splitserve.cli.main` does, in the container's environment (every
    subcommand reads SPLITSERVE_<OPTION> variables, so the ConfigMap must convert too)."""
    from splitserve import cli

    name = argv[0]
    module = importlib.import_module(cli.SUBCOMMANDS[name][0])
    with monkeypatch.context() as m:
        for key in [k for k in os.environ if k.startswith("SPLITSERVE_")]:
            m.delenv(key)
        for key, value in env.items():
            m.setenv(key, value)
        parser = argparse.ArgumentParser(prog=f"splitserve {name}", exit_on_error=False)
        module.add_arguments(parser)
        try:
            if hasattr(cli, "apply_config_sources"):
                cli.add_config_option(parser)
                cli.apply_config_sources(parser, argv[1:])
            return parser.parse_args(argv[1:])
        except (argparse.ArgumentError, SystemExit, ValueError) as e:
            raise AssertionError(f"splitserve rejects the chart's command line {argv}: {e}") from e


@pytest.mark.parametrize(
    "case",
    ["default", "tp-mismatched", "single-node", "external-etcd", "cpu-sim", "etcd-auth-tls", "gateway-args"],
)
def test_rendered_command_lines_parse_with_the_real_cli(rendered, case, monkeypatch):
    from splitserve import cli
    from splitserve.control_plane.shard_spec import parse_inference_shards

    docs = rendered[case]
    checked = set()
    for name, workload in workloads(docs).items():
        container = main_container(workload)
        if not container.get("args") or container["args"][0] != "splitserve":
            continue
        env = _container_env(docs, container)
        argv = [_expand(a, env) for a in container["args"][1:]]
        assert not [a for a in argv if "$(" in a], f"{name}: unexpanded variable in {argv}"
        assert argv[0] in cli.SUBCOMMANDS, f"{name}: unknown subcommand {argv[0]!r}"
        args = _parse_with_real_cli(argv, env, monkeypatch)
        checked.add(argv[0])
        if argv[0] == "control-plane":
            parse_inference_shards(args.inference_shards)
            assert args.etcd == config_map(docs)["SPLITSERVE_ETCD"]
            assert args.advertise_address == "10.1.2.3:50051"
        if argv[0].endswith("-worker"):
            assert args.listen == "10.1.2.3:50070"
            assert args.etcd == config_map(docs)["SPLITSERVE_ETCD"]
            assert args.cluster == config_map(docs)["SPLITSERVE_CLUSTER"]
        if argv[0] == "gateway":
            assert args.router.endswith(":50061")
    assert {"control-plane", "router", "prefill-worker", "decode-worker"} <= checked
    if case != "minimal":
        assert "gateway" in checked


# -- values.schema.json refuses bad values before anything is created ---------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["etcd.replicas=2"], "etcd/replicas"),
        (["inferenceShards[0].role=prefil"], "inferenceShards/0/role"),
        (["inferenceShards[0].tp=0"], "inferenceShards/0/tp"),
        (["router.polcy=scored"], "polcy"),
        (["etcd.enabled=false"], "etcd/external/endpoint"),
        (["engine.transport=rdma"], "engine/transport"),
    ],
)
def test_schema_rejects_bad_values(rendered, overrides, message):
    helm = os.environ.get("HELM") or str(Path(sys.prefix) / "bin" / "helm")  # where check_helm.sh put it
    args = [helm, "template", RELEASE, str(CHART)]
    for override in overrides:
        args += ["--set", override]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert message in proc.stderr, proc.stderr
