"""grafana/rrfp_dashboard.json plots exactly the gauges the stage actors export."""

from __future__ import annotations

import json
import re
from pathlib import Path

from actors.dashboard import METRICS

DASHBOARD = Path(__file__).resolve().parents[1] / "grafana" / "rrfp_dashboard.json"


def test_every_plotted_metric_is_one_the_stage_actors_export_and_each_is_plotted():
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    plotted = {name for expr in exprs for name in re.findall(r"\bray_(\w+)\{", expr)}
    assert plotted and plotted <= METRICS.keys(), plotted - METRICS.keys()
    assert plotted == METRICS.keys(), f"exported but not plotted: {METRICS.keys() - plotted}"


def test_the_dashboard_is_in_the_shape_grafana_provisioning_reads():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"]
    names = {variable["name"] for variable in dashboard["templating"]["list"]}
    for panel in dashboard["panels"]:
        assert {"id", "title", "type", "gridPos", "targets"} <= panel.keys()
        used = set(re.findall(r"\$\{?(\w+)", panel["datasource"] + "".join(t["expr"] for t in panel["targets"])))
        assert used <= names, f"panel {panel['title']!r} uses undefined variables {used - names}"
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])
