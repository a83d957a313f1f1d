"""Offline validation of Kubernetes manifests against the published schemas kept in tests/fixtures/k8s/.

Core kinds (ConfigMap, batch/v1 Job, ObjectMeta) use Kubernetes' own OpenAPI v3 schemas; PyTorchJob, JobSet and
RayJob use the `openAPIV3Schema` their projects publish in their CRDs. Validated as the API server does for what a
schema can say: types, enums, required fields, and unknown fields rejected (the server prunes or, with kubectl's
default strict field validation, refuses them), plus metadata.name as an RFC 1123 label. Not checked: CEL rules
(x-kubernetes-validations), which only concern fields these manifests don't set.
"""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path

from jsonschema import Draft202012Validator

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "k8s"
CRDS = {("kubeflow.org/v1", "PyTorchJob"): "pytorchjob.json", ("jobset.x-k8s.io/v1alpha2", "JobSet"): "jobset.json",
        ("ray.io/v1", "RayJob"): "rayjob.json"}
CORE = {("v1", "ConfigMap"): "v1/ConfigMap", ("batch/v1", "Job"): "batch/v1/Job"}
NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")


def closed(node):
    """Structural-schema semantics: an object with declared properties accepts no others unless it says so."""
    if isinstance(node, list):
        return [closed(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: closed(v) for k, v in node.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


@functools.cache
def _core() -> dict:
    return json.loads((FIXTURES / "core.json").read_text())


def _core_validator(kind_key: str) -> Draft202012Validator:
    core = _core()
    schema = {"$ref": f"#/components/schemas/{core['kinds'][kind_key]}",
              "components": closed(core["components"])}
    return Draft202012Validator(schema)


@functools.cache
def validator(api_version: str, kind: str) -> Draft202012Validator:
    if (api_version, kind) in CORE:
        return _core_validator(CORE[(api_version, kind)])
    fixture = json.loads((FIXTURES / CRDS[(api_version, kind)]).read_text())
    return Draft202012Validator(closed(fixture["schema"]))


def _where(error) -> str:
    return ".".join(str(p) for p in error.absolute_path) or "(top level)"


def errors(doc: dict) -> list[str]:
    """Every problem found in one manifest, as 'path: message' lines (empty when it validates)."""
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key not in CRDS and key not in CORE:
        return [f"{key}: no schema kept for this kind"]
    found = [f"{_where(e)}: {e.message}" for e in validator(*key).iter_errors(doc)]
    meta = doc.get("metadata") or {}
    found += [f"metadata.{_where(e)}: {e.message}" for e in validator_meta().iter_errors(meta)]
    name = meta.get("name") or meta.get("generateName", "").rstrip("-")  # generateName: the server appends a suffix
    if not (NAME.match(name) and len(name) <= 63):
        found.append(f"metadata.name: {name!r} is not an RFC 1123 label (lowercase alphanumerics and '-', ≤ 63)")
    return found


@functools.cache
def validator_meta() -> Draft202012Validator:
    return _core_validator("meta/v1/ObjectMeta")
