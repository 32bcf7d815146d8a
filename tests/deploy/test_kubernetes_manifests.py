"""deploy/kubernetes/ without a cluster: every Kubernetes object against the offline schemas of
`kubernetes-validate` (strict: unknown fields are errors), the InferencePool against its CRD's
schema (vendored beside this test, source in its `$comment`), and the wiring between them: the
pool selects the loraplex pods on their port, points at the picker's Service, and the picker's
engine mapping names metrics that loraplex's /metrics renders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from loraplex.platform.api.metrics.gie_metrics import LORA_INFO
from loraplex.platform.api.metrics.server_metrics import _ENGINE_SERIES

DEPLOY = Path(__file__).parents[2] / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.33.0"  # the oldest release the manifests are checked against
ENGINE_LABEL = "inference.networking.k8s.io/engine-type"


def _objects() -> list[dict]:
    return [doc for path in sorted(DEPLOY.glob("*.yaml"))
            for doc in yaml.safe_load_all(path.read_text()) if doc]  # fmt: skip


def _one(kind: str, name: str) -> dict:
    [found] = [o for o in _objects() if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


@pytest.mark.parametrize(
    "obj", [o for o in _objects() if o["kind"] != "InferencePool"],
    ids=lambda o: f"{o['kind']}/{o['metadata']['name']}",
)  # fmt: skip
def test_core_objects_match_the_kubernetes_schemas(obj):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)  # raises when invalid


def test_inference_pool_matches_its_crd_schema():
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads((Path(__file__).parent / "inferencepool-v1.json").read_text())
    pool = _one("InferencePool", "loraplex")
    assert pool["apiVersion"] == "inference.networking.k8s.io/v1"
    jsonschema.validate(pool, schema)
    broken = {**pool, "spec": {k: v for k, v in pool["spec"].items() if k != "selector"}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def test_the_pool_selects_the_loraplex_pods_and_points_at_the_picker():
    pool = _one("InferencePool", "loraplex")["spec"]
    pods = _one("Deployment", "loraplex")["spec"]["template"]
    labels = pods["metadata"]["labels"]
    assert pool["selector"]["matchLabels"].items() <= labels.items()
    ports = [p["containerPort"] for c in pods["spec"]["containers"] for p in c["ports"]]
    assert [p["number"] for p in pool["targetPorts"]] == ports
    picker = _one("Service", pool["endpointPickerRef"]["name"])
    assert pool["endpointPickerRef"]["port"]["number"] in [
        p["port"] for p in picker["spec"]["ports"]
    ]
    epp = _one("Deployment", pool["endpointPickerRef"]["name"])["spec"]["template"]
    assert picker["spec"]["selector"].items() <= epp["metadata"]["labels"].items()
    args = epp["spec"]["containers"][0]["args"]
    assert f"--pool-name={_one('InferencePool', 'loraplex')['metadata']['name']}" in args


def test_the_engine_mapping_names_metrics_loraplex_renders():
    config_map = _one("ConfigMap", "loraplex-epp")
    config = yaml.safe_load(config_map["data"]["epp-config.yaml"])
    assert config["kind"] == "EndpointPickerConfig"
    [extractor] = [p for p in config["plugins"] if p["type"] == "model-server-protocol-metrics"]
    params = extractor["parameters"]
    pods = _one("Deployment", "loraplex")["spec"]["template"]["metadata"]["labels"]
    assert pods[params["engineLabelKey"]] == params["defaultEngine"] == "loraplex"
    [engine] = [e for e in params["engineConfigs"] if e["name"] == "loraplex"]
    ours = {name for _, name, _, _ in _ENGINE_SERIES} | {LORA_INFO}
    specs = ("queuedRequestsSpec", "runningRequestsSpec", "kvUsageSpec", "loraSpec")
    assert {engine[s] for s in specs} <= ours
    scorers = {p["pluginRef"] for p in config["schedulingProfiles"][0]["plugins"]}
    assert "lora-affinity-scorer" in scorers
    defined = {p.get("name", p["type"]) for p in config["plugins"]}
    source = config["data"]["sources"][0]
    assert {source["pluginRef"], *(e["pluginRef"] for e in source["extractors"])} <= defined
    assert scorers <= defined
    mount = _one("Deployment", "loraplex-epp")["spec"]["template"]["spec"]["containers"][0]
    assert "--config-file=/config/epp-config.yaml" in mount["args"]


def test_the_picker_reads_the_lora_gauge_without_a_key():
    """GIE's metrics source sends no credentials, and on a server with tenants /metrics names no
    tenant's adapter without a key: the replicas let the LoRA gauge name them for the picker's
    affinity scorer, and take the metrics key for everything else from a Secret."""
    from loraplex.cli import build_parser
    from loraplex.entrypoints.serve_cli import resolve_options as resolve
    from loraplex.entrypoints.serve_cli import server_settings

    config = yaml.safe_load(_one("ConfigMap", "loraplex-epp")["data"]["epp-config.yaml"])
    [source] = [p for p in config["plugins"] if p["type"] == "metrics-data-source"]
    assert source["parameters"]["path"] == "/metrics"
    assert set(source["parameters"]) <= {"scheme", "path", "insecureSkipVerify"}  # no key
    [container] = _one("Deployment", "loraplex")["spec"]["template"]["spec"]["containers"]
    settings = server_settings(resolve(build_parser().parse_args(container["args"])))
    assert settings.metrics_public_adapter_names
    env = {e["name"]: e for e in container["env"]}
    assert env["LORAPLEX_METRICS_KEY"]["valueFrom"]["secretKeyRef"]["optional"] is True
