"""The Grafana dashboard only queries metrics the services define."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import REGISTRY

import lorafleet.scaler.metrics
import lorafleet.scheduler.metrics
import lorafleet.worker.metrics  # noqa: F401  (each registers its metrics on import)


def test_every_dashboard_query_names_a_defined_metric(repo_root: Path) -> None:
    dashboard = json.loads((repo_root / "docs" / "grafana-lorafleet.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    used = {name for expr in exprs for name in re.findall(r"\blorafleet_\w+", expr)}
    defined = {
        sample_name
        for family in REGISTRY.collect()
        for sample_name in (family.name, f"{family.name}_total", f"{family.name}_bucket")
    }
    # Jobs by state are collected from the ledger by a running scheduler.
    defined.add("lorafleet_jobs")
    assert used, "the dashboard has no queries"
    assert used - defined == set()
