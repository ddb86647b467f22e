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
