"""Chart smoke test: the commands and environment the chart renders, run as local
processes on loopback. etcd, the control plane, one prefill and one decode worker
(deploy/helm/examples/cpu-sim.yaml switched to the real torch engine on the
embedded tiny model, KV over NIXL) and a router start from
their rendered args (only addresses are rewritten: pod DNS names and the pod IP
become 127.0.0.1, ports become free ones); each passes the gRPC health check its
probe runs; a request through the router is served disaggregated; on SIGTERM
(what Kubernetes sends after preStop) every process drains and exits 0 within the
rendered terminationGracePeriodSeconds.

The workers read the embedded model's config.json and the gateway its tokenizer,
so a completion through the gateway's OpenAI API comes back as text.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

import splitserve.engine.default_model as default_model
from splitserve.proto.v1 import common_pb2, router_pb2, router_pb2_grpc
from tests.fixtures.etcd import free_port

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "deploy" / "helm" / "splitserve"
RELEASE, NAMESPACE = "smoke", "splitserve"
FULLNAME = f"{RELEASE}-splitserve"
# The real engine on the embedded tiny model (the issue asks for a completion on it).
MODEL = Path(default_model.__file__).parent / "files"
SETTINGS = [f"model.path={MODEL}", "engine.kind=torch", "engine.transport=nixl", "gateway.servedModelName=tiny",
            "prefill.bufferSizeGb=0.25",
            "decode.bufferSizeGb=0.25", "engine.graceSeconds=2", "engine.handoffLeaseSeconds=5",
            "router.gracePeriodSeconds=2", "gateway.gracePeriodSeconds=2"]  # fmt: skip

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None, reason="needs the etcd binary (etcd-server)")


def render() -> list[dict]:
    helm = os.environ.get("HELM") or str(Path(sys.prefix) / "bin" / "helm")
    if not Path(helm).exists():
        subprocess.run([sys.executable, str(ROOT / "deploy" / "tools" / "install_helm.py"), helm], check=True)
    args = [
        helm,
        "template",
        RELEASE,
        str(CHART),
        "-n",
        NAMESPACE,
        "-f",
        str(ROOT / "deploy/helm/examples/cpu-sim.yaml"),
    ]
    for setting in SETTINGS:
        args += ["--set", setting]
    out = subprocess.run(args, check=True, capture_output=True, text=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


class Local:
    """One rendered container as a local process."""

    def __init__(self, name: str, workload: dict, docs: list[dict], addresses: dict[str, str], workdir: Path):
        pod = workload["spec"]["template"]["spec"]
        container = pod["containers"][0]
        self.name = name
        self.grace_s = pod.get("terminationGracePeriodSeconds", 30)
        pre_stop = container.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        self.pre_stop_s = int(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0
        env = container_env(container, docs, pod_name=f"{workload['metadata']['name']}-0")
        env.update(
            {k: str(workdir / k.lower()) for k in ("HOME", "XDG_CACHE_HOME", "TRITON_CACHE_DIR") if k in env}
        )
        self.env = env
        argv = [localize(expand(a, env), addresses) for a in container.get("command", []) + container["args"]]
        if argv[0] == "splitserve":
            argv = [sys.executable, "-m", "splitserve", *argv[1:]]
        self.argv = argv
        self.log_path = workdir / f"{name}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                argv, env={**os.environ, **env, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
                stdout=log, stderr=subprocess.STDOUT, cwd=workdir, start_new_session=True,
            )  # fmt: skip

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def terminate(self) -> int:
        """SIGTERM, as the kubelet sends after preStop; the exit code, within the grace period."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(self.grace_s - self.pre_stop_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"{self.name} did not exit within its grace period:\n{self.log()}") from None


def container_env(container: dict, docs: list[dict], pod_name: str) -> dict[str, str]:
    """The container's environment as Kubernetes builds it, with the pod on 127.0.0.1."""
    maps = {d["metadata"]["name"]: d["data"] for d in docs if d["kind"] == "ConfigMap"}
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update({k: v for k, v in maps[source["configMapRef"]["name"]].items() if "." not in k})
    fields = {"status.podIP": "127.0.0.1", "metadata.name": pod_name, "metadata.namespace": NAMESPACE,
              "spec.nodeName": "localhost"}  # fmt: skip
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = expand(item["value"], env)
        else:
            env[item["name"]] = fields[item["valueFrom"]["fieldRef"]["fieldPath"]]
    return env


def expand(text: str, env: dict[str, str]) -> str:
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), text)


def localize(arg: str, addresses: dict[str, str]) -> str:
    """Rewrites HOST:PORT (and scheme://HOST:PORT) for the chart's ports to the local ones."""

    def sub(match: re.Match) -> str:
        return addresses.get(match.group(2), match.group(0))

    if arg == "--host=0.0.0.0":  # the gateway's bind address: loopback only here
        return "--host=127.0.0.1"
    if arg.startswith("--port=") and arg[7:] in addresses:
        return "--port=" + addresses[arg[7:]].rsplit(":", 1)[1]
    return re.sub(r"([A-Za-z0-9.-]+):(\d+)", sub, arg)


def wait_serving(address: str, proc: Local, timeout_s: float = 90.0) -> None:
    """What the gRPC startup probe does: grpc.health.v1 Check("") until SERVING."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if proc.proc.poll() is not None:
                raise AssertionError(f"{proc.name} exited with {proc.proc.returncode}:\n{proc.log()}")
            try:
                if (
                    stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    == health_pb2.HealthCheckResponse.SERVING
                ):
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError(f"{proc.name} not SERVING within {timeout_s} s:\n{proc.log()}")
            time.sleep(0.2)


def wait_http_health(url: str, proc: Local, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if proc.proc.poll() is not None or time.monotonic() > deadline:
            raise AssertionError(f"{proc.name} not healthy at {url}:\n{proc.log()}")
        time.sleep(0.1)


def generate(router_address: str, timeout_s: float = 60.0) -> list:
    """A request through the router, retried while the topology fills in."""
    params = common_pb2.SamplingParams(num_tokens_to_generate=8, temperature=0.0)
    deadline = time.monotonic() + timeout_s
    attempt = 0
    with grpc.insecure_channel(router_address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)
        while True:
            attempt += 1
            request = router_pb2.GenerateRequest(
                request_id=f"smoke-{attempt}",
                token_ids=list(range(3, 67)),
                sampling_params=params,
                enforce_disagg=True,
            )
            try:
                return list(stub.Generate(request, timeout=30))
            except grpc.RpcError as e:
                if time.monotonic() > deadline:
                    raise AssertionError(f"router never served the request: {e.code()} {e.details()}") from e
                time.sleep(0.5)


def test_rendered_components_serve_a_request_on_loopback(tmp_path):
    docs = render()
    workloads = {d["metadata"]["name"]: d for d in docs if d["kind"] in ("Deployment", "StatefulSet")}
    etcd_client, etcd_peer, etcd_metrics = free_port(), free_port(), free_port()
    cp_port, router_port, gateway_port = free_port(), free_port(), free_port()
    base = {
        "2379": f"127.0.0.1:{etcd_client}", "2380": f"127.0.0.1:{etcd_peer}", "2381": f"127.0.0.1:{etcd_metrics}",
        "50051": f"127.0.0.1:{cp_port}", "50061": f"127.0.0.1:{router_port}", "8000": f"127.0.0.1:{gateway_port}",
    }  # fmt: skip
    started: list[Local] = []

    def start(name: str, addresses: dict[str, str] | None = None) -> Local:
        workdir = tmp_path / name
        workdir.mkdir()
        proc = Local(name, workloads[f"{FULLNAME}-{name}"], docs, {**base, **(addresses or {})}, workdir)
        started.append(proc)
        return proc

    try:
        etcd_workload = workloads[f"{FULLNAME}-etcd"]
        # The data dir is a volume in the pod; here a temporary folder.
        etcd_workload["spec"]["template"]["spec"]["containers"][0]["args"] = [
            f"--data-dir={tmp_path / 'etcd-data'}" if a.startswith("--data-dir=") else a
            for a in etcd_workload["spec"]["template"]["spec"]["containers"][0]["args"]
        ]
        etcd = start("etcd")
        wait_http_health(f"http://127.0.0.1:{etcd_metrics}/health", etcd)

        control_plane = start("control-plane")
        wait_serving(f"127.0.0.1:{cp_port}", control_plane)
        prefill_port, decode_port = free_port(), free_port()
        prefill = start("prefill-0", {"50070": f"127.0.0.1:{prefill_port}"})
        decode = start("decode-1", {"50070": f"127.0.0.1:{decode_port}"})
        wait_serving(f"127.0.0.1:{prefill_port}", prefill)
        wait_serving(f"127.0.0.1:{decode_port}", decode)
        router = start("router")
        wait_serving(f"127.0.0.1:{router_port}", router)

        chunks = generate(f"127.0.0.1:{router_port}")
        last = chunks[-1]
        assert sum(len(c.token_ids) for c in chunks) == 8
        assert last.usage.completion_tokens == 8
        assert last.routing.prefill_worker_id and last.routing.decode_worker_id  # disaggregated

        gateway = start("gateway")
        url = f"http://127.0.0.1:{gateway_port}"
        wait_http_health(f"{url}/health", gateway)
        with urllib.request.urlopen(f"{url}/v1/models", timeout=10) as response:
            assert [m["id"] for m in json.loads(response.read())["data"]] == ["tiny"]
        body = json.dumps({"model": "tiny", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0})
        request = urllib.request.Request(
            f"{url}/v1/completions", data=body.encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=60) as response:
            completion = json.loads(response.read())
        assert completion["usage"]["completion_tokens"] == 8, completion
        assert isinstance(completion["choices"][0]["text"], str)

        # Drain in the order a `helm uninstall` may well pick: every process exits cleanly in time.
        for proc in reversed(started):
            code = proc.terminate()
            # etcd and uvicorn (the gateway) re-raise SIGTERM on themselves once they have shut down cleanly.
            clean = (0, -signal.SIGTERM) if proc in (etcd, gateway) else (0,)
            assert code in clean, f"{proc.name} exited with {code}:\n{proc.log()}"
    finally:
        for proc in started:
            if proc.proc.poll() is None:
                proc.proc.kill()
                proc.proc.wait()
