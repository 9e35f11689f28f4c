"""Every object the recipe renders is valid Kubernetes: core kinds against the Kubernetes schemas
(kubernetes-validate, strict: an unknown field is an error), the Prometheus Operator's kinds against
the part of their CRD schemas the recipe uses, and the rules through promtool where it is installed."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from deploy_manifests import KUSTOMIZATIONS, rendered

from harness.serve import prom

# The kubectl on the CI image; kubernetes-validate ships schemas up to its own version.
KUBERNETES_VERSION = "1.32.0"
CRD_GROUP = "monitoring.coreos.com/v1"

_STRINGS = {"type": "object", "additionalProperties": {"type": "string"}}
_DURATION = {"type": "string", "pattern": r"^((\d+)(ms|s|m|h|d|w|y))+$"}
_METADATA = {
    "type": "object",
    "required": ["name"],
    "properties": {"name": {"type": "string"}, "labels": _STRINGS, "annotations": _STRINGS},
    "additionalProperties": False,
}
# The Prometheus Operator's PrometheusRule and PodMonitor, as far as the recipe uses them: each
# field's type as in the CRDs, and no field they do not define.
CRD_SCHEMAS: dict[str, dict[str, Any]] = {
    "PrometheusRule": {
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"const": CRD_GROUP},
            "kind": {"const": "PrometheusRule"},
            "metadata": _METADATA,
            "spec": {
                "type": "object",
                "additionalProperties": False,
                "properties": {
                    "groups": {
                        "type": "array",
                        "items": {
                            "type": "object",
                            "required": ["name", "rules"],
                            "additionalProperties": False,
                            "properties": {
                                "name": {"type": "string", "minLength": 1},
                                "interval": _DURATION,
                                "rules": {
                                    "type": "array",
                                    "items": {
                                        "type": "object",
                                        "required": ["expr"],
                                        "oneOf": [{"required": ["alert"]}, {"required": ["record"]}],
                                        "additionalProperties": False,
                                        "properties": {
                                            "alert": {"type": "string"},
                                            "record": {"type": "string"},
                                            "expr": {"type": "string"},
                                            "for": _DURATION,
                                            "keep_firing_for": _DURATION,
                                            "labels": _STRINGS,
                                            "annotations": _STRINGS,
                                        },
                                    },
                                },
                            },
                        },
                    }
                },
            },
        },
        "additionalProperties": False,
    },
    "PodMonitor": {
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"const": CRD_GROUP},
            "kind": {"const": "PodMonitor"},
            "metadata": _METADATA,
            "spec": {
                "type": "object",
                "required": ["selector", "podMetricsEndpoints"],
                "additionalProperties": False,
                "properties": {
                    "selector": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {
                            "matchLabels": _STRINGS,
                            "matchExpressions": {
                                "type": "array",
                                "items": {
                                    "type": "object",
                                    "required": ["key", "operator"],
                                    "additionalProperties": False,
                                    "properties": {
                                        "key": {"type": "string"},
                                        "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                                        "values": {"type": "array", "items": {"type": "string"}},
                                    },
                                },
                            },
                        },
                    },
                    "podMetricsEndpoints": {
                        "type": "array",
                        "minItems": 1,
                        "items": {
                            "type": "object",
                            "required": ["port"],
                            "additionalProperties": False,
                            "properties": {
                                "port": {"type": "string"},
                                "path": {"type": "string"},
                                "interval": _DURATION,
                            },
                        },
                    },
                },
            },
        },
        "additionalProperties": False,
    },
}


def _objects() -> list[tuple[str, dict[str, Any]]]:
    return [(name, obj) for name in KUSTOMIZATIONS for obj in rendered(name)]


def test_every_kustomization_renders_objects_of_known_kinds() -> None:
    for name in KUSTOMIZATIONS:
        objects = rendered(name)
        assert objects, f"{name} rendered nothing"
        for obj in objects:
            known = obj["kind"] in CRD_SCHEMAS or not obj["apiVersion"].startswith("monitoring.coreos.com")
            assert known, f"{name}: no schema checks {obj['apiVersion']} {obj['kind']}"


def test_core_objects_validate_against_the_kubernetes_schemas() -> None:
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate not installed (pip install '.[test]')"
    )
    checked = 0
    for name, obj in _objects():
        if obj["kind"] in CRD_SCHEMAS:
            continue
        try:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{name}: {obj['kind']}/{obj['metadata']['name']}: {exc.message} at {list(exc.path)}")
        checked += 1
    assert checked >= 10  # 2 Deployments, Services, the router's RBAC; the llm-d pair; a ConfigMap


def test_prometheus_operator_objects_match_their_crd_schemas() -> None:
    import jsonschema

    kinds = []
    for _, obj in _objects():
        if obj["kind"] in CRD_SCHEMAS:
            jsonschema.validate(obj, CRD_SCHEMAS[obj["kind"]])
            kinds.append(obj["kind"])
    assert sorted(kinds) == ["PodMonitor", "PrometheusRule"]


@pytest.mark.parametrize(
    ("kind", "broken"),
    [
        ("PrometheusRule", lambda o: o["spec"]["groups"][0]["rules"][0].update(fore="1m")),
        ("PrometheusRule", lambda o: o["spec"]["groups"][0]["rules"][0].update({"for": "one minute"})),
        ("PodMonitor", lambda o: o["spec"]["podMetricsEndpoints"][0].update(port=8000)),
    ],
    ids=["misspelt-field", "bad-duration", "port-number"],
)
def test_the_crd_schemas_reject_a_broken_object(kind: str, broken: Any) -> None:
    import copy

    import jsonschema

    obj = copy.deepcopy(next(o for _, o in _objects() if o["kind"] == kind))
    broken(obj)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(obj, CRD_SCHEMAS[kind])


def test_promtool_accepts_the_prometheus_rule(tmp_path: Path) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip(f"promtool missing (Debian's prometheus package): {prom.INSTALL_HINT}")
    rule = next(o for _, o in _objects() if o["kind"] == "PrometheusRule")
    rules = tmp_path / "rules.yml"
    rules.write_text(yaml.safe_dump(rule["spec"]))
    done = subprocess.run(
        [promtool, "check", "rules", str(rules)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr
