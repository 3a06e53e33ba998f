"""The Grafana dashboard and the Prometheus alerting rules in docs/: valid PromQL (promtool),
and every series they read is one slotgate serves."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from slotgate.main import Service
from slotgate.settings import Settings

from tests.support.tools import tool

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "docs" / "grafana" / "slotgate.json"
ALERTS = ROOT / "docs" / "prometheus" / "alerts.yml"
#: Series Prometheus makes itself, not slotgate.
PROMETHEUS_OWN = frozenset({"up"})
#: Grafana's variables, as a rule file may spell them.
_VARIABLES = {"$__rate_interval": "5m", "$instance": ".*", "${datasource}": ""}
#: A name right before a selector's `{` or a range's `[`, or one of slotgate's by its prefix.
_SELECTED = re.compile(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*[{\[]")
_PREFIXED = re.compile(r"\b((?:slotgate|process)_[a-z0-9_]+)")


def dashboard_queries() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    queries = [
        target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", ())
    ]
    queries.extend(
        variable["definition"]
        for variable in dashboard["templating"]["list"]
        if variable["type"] == "query"
    )
    return queries


def alert_queries() -> list[str]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


def served() -> set[str]:
    """Every series name slotgate's /metrics serves (with an upstream whose slots are known)."""
    service = Service(Settings(_env_file=None))
    service.upstream.pool.resize(2)
    names = set()
    for line in service.metrics.render().decode().splitlines():
        if line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def used(query: str) -> set[str]:
    names = set(_PREFIXED.findall(query))
    names.update(name for name in _SELECTED.findall(query) if name not in {"by", "without"})
    return names


def test_the_alerting_rules_pass_promtool() -> None:
    promtool = tool("promtool", "prometheus")
    check = subprocess.run(
        [promtool, "check", "rules", str(ALERTS)], capture_output=True, text=True, check=False
    )
    assert check.returncode == 0, check.stdout + check.stderr


def test_the_dashboards_queries_are_valid_promql(tmp_path: Path) -> None:
    promtool = tool("promtool", "prometheus")
    rules: list[dict[str, Any]] = []
    for index, query in enumerate(q for q in dashboard_queries() if "label_values" not in q):
        for variable, value in _VARIABLES.items():
            query = query.replace(variable, value)
        rules.append({"record": f"dashboard:query_{index}", "expr": query})
    written = tmp_path / "dashboard.yml"
    written.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    check = subprocess.run(
        [promtool, "check", "rules", str(written)], capture_output=True, text=True, check=False
    )
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.parametrize(
    ("where", "queries"),
    [("dashboard", dashboard_queries()), ("alerts", alert_queries())],
)
def test_every_series_the_dashboard_and_the_alerts_read_is_one_slotgate_serves(
    where: str, queries: list[str]
) -> None:
    assert queries, f"no queries found in the {where}"
    names = set().union(*(used(query) for query in queries))
    assert any(name.startswith("slotgate_") for name in names)
    missing = sorted(names - served() - PROMETHEUS_OWN)
    assert missing == [], f"the {where} reads series slotgate does not serve"


def test_a_series_slotgate_does_not_serve_is_caught() -> None:
    assert used('rate(slotgate_no_such_total{instance="a"}[5m])') == {"slotgate_no_such_total"}
    assert "slotgate_no_such_total" not in served()


def scraped(service: Service) -> list[str]:
    """slotgate's series now as promtool's input series, constant for 6 hours of 1 m scrapes,
    under one instance of job slotgate, beside Prometheus' own `up`."""
    series = ['{__name__="up",job="slotgate",instance="a"}']
    values = {series[0]: "1"}
    for line in service.metrics.render().decode().splitlines():
        if not line or line.startswith("#"):
            continue
        selector, value = line.rsplit(" ", 1)
        name, _, labels = selector.partition("{")
        labels = labels.rstrip("}")
        extra = f"{labels}," if labels else ""
        one = f'{{__name__="{name}",{extra}job="slotgate",instance="a"}}'
        series.append(one)
        values[one] = value
    return [f"{one} {values[one]}" for one in series]


def alerts_firing(tmp_path: Path, service: Service, at: str) -> set[str]:
    """The alerts of docs/prometheus/alerts.yml firing `at` (say "3h") into the scrapes, as
    promtool's rule tests find them: each is expected silent, and those that are not named."""
    promtool = tool("promtool", "prometheus")
    names = [rule["alert"] for group in yaml.safe_load(ALERTS.read_text())["groups"]
             for rule in group["rules"]]  # fmt: skip
    inputs = [
        {"series": line.rsplit(" ", 1)[0], "values": f"{line.rsplit(' ', 1)[1]}x360"}
        for line in scraped(service)
    ]
    test = {
        "rule_files": [str(ALERTS)],
        "evaluation_interval": "1m",
        "tests": [{
            "interval": "1m",
            "input_series": inputs,
            "alert_rule_test": [
                {"eval_time": at, "alertname": name, "exp_alerts": []} for name in names
            ],
        }],
    }  # fmt: skip
    written = tmp_path / "at_rest.yml"
    written.write_text(yaml.safe_dump(test))
    run = subprocess.run(
        [promtool, "test", "rules", str(written)], capture_output=True, text=True, check=False
    )
    said = run.stdout + run.stderr
    firing = set(re.findall(r"alertname: (\w+), time:", said))
    assert (run.returncode == 0) == (not firing), said  # failed for no alert: a misuse
    return firing


def test_no_alert_fires_on_an_idle_gate_whose_llama_server_is_ready(tmp_path: Path) -> None:
    service = Service(Settings(_env_file=None))
    service.upstream.ready = True
    service.upstream.pool.resize(2)
    assert alerts_firing(tmp_path, service, "5h") == set()


def test_a_pause_left_on_fires_its_alert_and_nothing_else(tmp_path: Path) -> None:
    service = Service(Settings(_env_file=None))
    service.upstream.ready = True
    service.upstream.pool.resize(2)
    service.gate.pause()
    assert alerts_firing(tmp_path, service, "1h") == {"SlotgatePausedTooLong"}
