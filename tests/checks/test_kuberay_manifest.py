"""deploy/kuberay/raycluster.yaml against a JSON schema of the RayCluster fields it uses (ray.io/v1, the KubeRay CRD's
names and types: rayStartParams values are strings, quantities are strings or integers, a pod template needs named
containers with an image), and the placement edge serve --ray relies on."""

from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")
jsonschema = pytest.importorskip("jsonschema")

MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "kuberay" / "raycluster.yaml"
QUANTITY = {"anyOf": [{"type": "integer"}, {"type": "string", "pattern": r"^[0-9.]+([KMGTPE]i?|[mkMGTPE])?$"}]}
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
CONTAINER = {"type": "object", "required": ["name", "image"], "properties": {
    "name": {"type": "string"}, "image": {"type": "string", "minLength": 1},
    "ports": {"type": "array", "items": {"type": "object", "required": ["containerPort"], "properties": {
        "containerPort": {"type": "integer", "minimum": 1, "maximum": 65535}, "name": {"type": "string"}}}},
    "resources": {"type": "object", "additionalProperties": False, "properties": {
        "requests": {"type": "object", "additionalProperties": QUANTITY},
        "limits": {"type": "object", "additionalProperties": QUANTITY}}},
    "volumeMounts": {"type": "array", "items": {"type": "object", "required": ["name", "mountPath"]}}}}
TEMPLATE = {"type": "object", "required": ["spec"], "properties": {"spec": {
    "type": "object", "required": ["containers"], "properties": {
        "containers": {"type": "array", "minItems": 1, "items": CONTAINER},
        "volumes": {"type": "array", "items": {"type": "object", "required": ["name"]}}}}}}
SCHEMA = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"], "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "ray.io/v1"}, "kind": {"const": "RayCluster"},
        "metadata": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"}, "labels": STRING_MAP}},
        "spec": {"type": "object", "required": ["headGroupSpec"], "additionalProperties": False, "properties": {
            "rayVersion": {"type": "string"},
            "enableInTreeAutoscaling": {"type": "boolean"},
            "headGroupSpec": {"type": "object", "required": ["rayStartParams", "template"], "additionalProperties": False,
                              "properties": {"rayStartParams": STRING_MAP, "template": TEMPLATE,
                                             "serviceType": {"type": "string"}, "enableIngress": {"type": "boolean"}}},
            "workerGroupSpecs": {"type": "array", "items": {
                "type": "object", "required": ["groupName", "rayStartParams", "template"], "additionalProperties": False,
                "properties": {"groupName": {"type": "string"}, "replicas": {"type": "integer", "minimum": 0},
                               "minReplicas": {"type": "integer", "minimum": 0},
                               "maxReplicas": {"type": "integer", "minimum": 0},
                               "rayStartParams": STRING_MAP, "template": TEMPLATE}}}}}}}


def manifest() -> dict:
    return yaml.safe_load(MANIFEST.read_text())


def test_the_raycluster_manifest_matches_the_schema():
    jsonschema.validate(manifest(), SCHEMA)


def test_the_schema_catches_what_kuberay_would_refuse():
    bad = manifest()
    bad["spec"]["workerGroupSpecs"][0]["rayStartParams"]["num-cpus"] = 16  # must be a string
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad, SCHEMA)


def test_the_groups_place_what_edge_serve_asks_for():
    spec = manifest()["spec"]
    assert spec["rayVersion"] == "2.60.0"  # the ray extra's pin
    assert spec["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # the head runs no workers or engines
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    decode = groups["decode-gpu"]
    limits = decode["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert decode["rayStartParams"]["num-gpus"] == limits["nvidia.com/gpu"] == "1"
    assert int(groups["prefill-cpu"]["rayStartParams"]["num-cpus"]) >= 1
    for group in groups.values():
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
