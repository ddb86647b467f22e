"""The cluster's operations kit: the KubeRay manifest builds the app, the dashboard and the
alerts select and keep replicas apart. No cluster needed."""

import json
from pathlib import Path

import pytest
import yaml

from slimkv.config import Config

DEPLOY = Path(__file__).resolve().parents[1] / "deploy"


def test_rayservice_manifest_builds_the_slimkv_application():
    pytest.importorskip("ray")
    from ray import serve

    from slimkv.cluster.launch import build

    service = yaml.safe_load((DEPLOY / "rayservice.yaml").read_text())
    assert service["kind"] == "RayService"
    [app] = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    assert app["import_path"] == "slimkv.cluster.launch:build"
    config = Config.from_dict(app["args"]["config"])  # validated like any slimkv YAML
    assert config.cluster.replicas > 1 and config.cluster.router == "slimkv"
    assert isinstance(build(app["args"]), serve.Application)


def test_grafana_has_a_replica_selector_on_every_series():
    dashboard = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    assert "replica" in {v["name"] for v in dashboard["templating"]["list"]}
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            assert 'replica=~"$replica"' in target["expr"], target["expr"]
            assert "sum by (" not in target["expr"] or "replica)" in target["expr"]


def test_alerts_keep_replicas_apart():
    rules = yaml.safe_load((DEPLOY / "alerts.yml").read_text())
    exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    assert all("replica" in e for e in exprs if " on(" in e or "sum by" in e)


def test_merged_exposition_labels_every_replica_and_keeps_types():
    from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from slimkv.cluster.exposition import merge_expositions

    def replica(hits: int, ttft: float) -> bytes:
        r = CollectorRegistry()
        Counter("slimkv:prefix_cache_hits", "h", ["model_name"], registry=r).labels("m").inc(hits)
        Histogram("slimkv:time_to_first_token_seconds", "t", ["model_name"],
                  registry=r).labels("m").observe(ttft)
        return generate_latest(r)

    ingress = CollectorRegistry()
    Counter("slimkv:router_decisions", "d", ["reason"], registry=ingress).labels("session").inc(3)
    text = merge_expositions({"a": replica(5, 0.2), "b": replica(7, 3.0)},
                             generate_latest(ingress)).decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert families["slimkv:prefix_cache_hits"].type == "counter"
    assert families["slimkv:time_to_first_token_seconds"].type == "histogram"
    hits = {s.labels["replica"]: s.value for s in families["slimkv:prefix_cache_hits"].samples
            if s.name.endswith("_total")}
    assert hits == {"a": 5.0, "b": 7.0}
    counts = {s.labels["replica"]: s.value
              for s in families["slimkv:time_to_first_token_seconds"].samples
              if s.name.endswith("_count")}
    assert counts == {"a": 1.0, "b": 1.0}
    [decision] = [s for s in families["slimkv:router_decisions"].samples if s.name.endswith("_total")]
    assert decision.labels == {"reason": "session"} and decision.value == 3
