"""Validate rendered Kubernetes manifests offline.

    python deploy/tools/validate_manifests.py [-k 1.29.0 -k 1.37.0] FILE...   ('-' reads stdin)

Every document is checked against the Kubernetes OpenAPI schemas that the
`kubernetes-validate` package ships, in strict mode (an unknown field is an
error, as `kubectl apply --validate=strict` would make it), for each version
given. Custom resources the chart may render (ServiceMonitor) have no schema
there; they are checked against the small structural schema below instead.
A kind with neither is an error, so a new template cannot slip through
unvalidated. Also checked: names are DNS-1123 labels where Kubernetes requires
it, and no kind/namespace/name appears twice.

Exit status 0 if everything is valid, 1 otherwise (one line per problem).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml

DEFAULT_VERSIONS = ("1.29.0", "1.37.0")

# Kinds whose metadata.name becomes a DNS label (Service) or a pod-name prefix.
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_LABEL_KINDS = {"Service": 63, "Deployment": 63, "StatefulSet": 52, "Job": 63}

_LABELS = {"type": "object", "additionalProperties": {"type": "string"}}
_RELABEL = {"type": "array", "items": {"type": "object"}}
# The fields of monitoring.coreos.com/v1 ServiceMonitor that the chart renders
# (prometheus-operator API reference); unknown fields are errors, like strict mode.
SERVICE_MONITOR = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string"},
                "namespace": {"type": "string"},
                "labels": _LABELS,
                "annotations": _LABELS,
            },
        },
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "jobLabel": {"type": "string"},
                "namespaceSelector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "any": {"type": "boolean"},
                        "matchNames": {"type": "array", "items": {"type": "string"}},
                    },
                },
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": _LABELS,
                        "matchExpressions": {"type": "array", "items": {"type": "object"}},
                    },
                },
                "endpoints": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "port": {"type": "string"},
                            "targetPort": {"type": ["string", "integer"]},
                            "path": {"type": "string", "pattern": "^/"},
                            "scheme": {"enum": ["http", "https"]},
                            "interval": {
                                "type": "string",
                                "pattern": "^(0|(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$",
                            },
                            "scrapeTimeout": {"type": "string"},
                            "honorLabels": {"type": "boolean"},
                            "relabelings": _RELABEL,
                            "metricRelabelings": _RELABEL,
                        },
                    },
                },
            },
        },
    },
}
CUSTOM_SCHEMAS = {("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR}


def load_documents(paths: list[str]) -> list[tuple[str, dict]]:
    """(source, document) for every non-empty YAML document in the files."""
    out = []
    for path in paths:
        text = sys.stdin.read() if path == "-" else Path(path).read_text()
        for index, doc in enumerate(yaml.safe_load_all(text)):
            if doc is None:
                continue
            if not isinstance(doc, dict):
                raise SystemExit(f"{path}: document {index + 1} is not a mapping")
            out.append((f"{path}#{index + 1}", doc))
    return out


def describe(doc: dict) -> str:
    meta = doc.get("metadata") or {}
    return f"{doc.get('kind')}/{meta.get('name')}"


def validate(doc: dict, versions: tuple[str, ...]) -> list[str]:
    """The problems with one document (empty if valid)."""
    kind, api = doc.get("kind"), doc.get("apiVersion")
    if not kind or not api or not (doc.get("metadata") or {}).get("name"):
        return ["missing apiVersion, kind or metadata.name"]
    problems = []
    custom = CUSTOM_SCHEMAS.get((api, kind))
    for version in versions:
        if custom is not None:
            errors = sorted(jsonschema.Draft7Validator(custom).iter_errors(doc), key=lambda e: list(e.path))
            problems += [f"{'/'.join(map(str, e.path)) or '<root>'}: {e.message}" for e in errors]
            break  # one schema, whatever the Kubernetes version
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.SchemaNotFoundError:
            problems.append(f"no schema for {api} {kind} in Kubernetes {version} (and no custom schema)")
        except kubernetes_validate.ValidationError as e:
            where = "/".join(map(str, e.path)) or "<root>"
            problems.append(f"Kubernetes {version}: {where}: {e.message}")
    name = doc["metadata"]["name"]
    limit = _LABEL_KINDS.get(kind)
    if limit is not None and (len(name) > limit or not _DNS_LABEL.match(name)):
        problems.append(f"name {name!r} is not a DNS-1123 label of at most {limit} characters")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="rendered manifests ('-' = stdin)")
    parser.add_argument(
        "-k",
        "--kubernetes-version",
        action="append",
        dest="versions",
        help=f"validate against this version (repeatable; default {', '.join(DEFAULT_VERSIONS)})",
    )
    args = parser.parse_args(argv)
    versions = tuple(args.versions or DEFAULT_VERSIONS)
    documents = load_documents(args.files)
    failures = 0
    for source, doc in documents:
        for problem in validate(doc, versions):
            print(f"INVALID {source} {describe(doc)}: {problem}")
            failures += 1
    ids = Counter(
        (d.get("kind"), (d.get("metadata") or {}).get("namespace"), (d.get("metadata") or {}).get("name"))
        for _, d in documents
    )
    for (kind, namespace, name), count in ids.items():
        if count > 1:
            print(f"DUPLICATE {kind}/{name} in namespace {namespace}: {count} times")
            failures += 1
    kinds = Counter(d.get("kind") for _, d in documents)
    summary = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
    status = "invalid" if failures else "valid"
    print(f"{len(documents)} manifests {status} against Kubernetes {', '.join(versions)} (strict): {summary}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
