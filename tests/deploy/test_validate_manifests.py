"""deploy/tools/validate_manifests.py: what makes a rendered manifest invalid."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "validate_manifests", ROOT / "deploy" / "tools" / "validate_manifests.py"
)
vm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vm)

VERSIONS = ("1.29.0", "1.37.0")


def deployment(**pod_extra) -> dict:
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": "demo-router"},
        "spec": {
            "selector": {"matchLabels": {"app": "r"}},
            "template": {
                "metadata": {"labels": {"app": "r"}},
                "spec": {
                    "containers": [{"name": "c", "image": "i", "readinessProbe": {"grpc": {"port": 1}}}],
                    **pod_extra,
                },
            },
        },
    }


def service_monitor(**endpoint_extra) -> dict:
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "ServiceMonitor",
        "metadata": {"name": "demo"},
        "spec": {
            "selector": {"matchLabels": {"a": "b"}},
            "endpoints": [{"port": "http", "path": "/metrics", **endpoint_extra}],
        },
    }


def test_a_valid_deployment_passes_on_every_version():
    assert vm.validate(deployment(), VERSIONS) == []


def test_an_unknown_field_fails_in_strict_mode():
    problems = vm.validate(deployment(terminationGracePeriod=30), VERSIONS)
    assert len(problems) == 2 and all("terminationGracePeriod" in p for p in problems)


def test_a_wrong_type_fails():
    doc = deployment()
    doc["spec"]["replicas"] = "two"
    assert vm.validate(doc, ("1.37.0",))


def test_service_monitor_uses_the_local_schema():
    assert vm.validate(service_monitor(interval="30s"), VERSIONS) == []
    assert vm.validate(service_monitor(interval="30 seconds"), VERSIONS)
    assert vm.validate(service_monitor(portt="http"), VERSIONS)


def test_a_kind_without_any_schema_fails():
    doc = {"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w"}, "spec": {}}
    assert "no schema" in vm.validate(doc, ("1.37.0",))[0]


def test_names_must_be_dns_labels():
    doc = deployment()
    doc["metadata"]["name"] = "Demo_Router"
    assert any("DNS-1123" in p for p in vm.validate(doc, ("1.37.0",)))


@pytest.mark.parametrize(("docs", "status"), [([deployment()], 0), ([deployment(), deployment()], 1)])
def test_exit_status_and_duplicates(tmp_path, capsys, docs, status):
    path = tmp_path / "rendered.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    assert vm.main(["-k", "1.37.0", str(path)]) == status
    if status:
        assert "DUPLICATE Deployment/demo-router" in capsys.readouterr().out
