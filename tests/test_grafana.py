"""The Grafana dashboard and the Prometheus files in deploy/ query only what kvgate exports.

Nothing here runs Prometheus or Grafana (the test machines have no container runtime): the files
are parsed, their wiring in deploy/compose.yaml is followed, and every metric name their PromQL
queries is looked up in a real front door's /metrics. The text format lists a family (its HELP
and TYPE lines) from the moment it is registered, before its first sample, so a front door that
has served nothing lists every name it will ever export: a metric renamed in the code fails here.
"""

from __future__ import annotations

import json
import posixpath
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml  # type: ignore[import-untyped]
from prometheus_client.parser import text_string_to_metric_families

from broker.admission.tenants import DEFAULT_TIERS

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
COMPOSE = DEPLOY / "compose.yaml"
DASHBOARD = DEPLOY / "grafana/dashboards/kvgate.json"
DATASOURCES = DEPLOY / "grafana/provisioning/datasources/prometheus.yaml"
DASHBOARD_PROVIDERS = DEPLOY / "grafana/provisioning/dashboards/kvgate.yaml"
PROMETHEUS = DEPLOY / "prometheus/prometheus.yaml"
ALERTS = DEPLOY / "prometheus/alerts.yaml"

GRAFANA_PROVISIONING = "/etc/grafana/provisioning"
"""Where Grafana looks for provisioning files unless told otherwise (``GF_PATHS_PROVISIONING``)."""


def load(path: Path) -> Any:
    text = path.read_text()
    return json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)


# PromQL, as far as this test needs it: what is left of an expression once its strings, label
# matchers, ranges and grouping label lists are gone is numbers, operators, keywords, function
# and aggregation names (each followed by "(") and the names of the series it selects.
_STRINGS = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_GRAFANA_VARIABLES = re.compile(r"\$\{[^}]*\}|\$\w+")
_MATCHERS = re.compile(r"\{[^}]*\}")
_RANGES = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
# Not preceded by a word character or a dot: the "e3" of 1e3 and the "m" of "offset 5m" are
# parts of numbers and durations.
_IDENTIFIER = re.compile(r"(?<![\w.:])([A-Za-z_:][\w:]*)(\s*\()?")
_KEYWORDS = frozenset(
    {"and", "or", "unless", "bool", "offset", "inf", "nan"}
    | {"by", "without", "on", "ignoring", "group_left", "group_right"}
)


def queried_metrics(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (Grafana's ``$variables`` allowed)."""
    text = _GRAFANA_VARIABLES.sub("", _STRINGS.sub('""', expr))
    for pattern in (_MATCHERS, _RANGES, _GROUPING):
        text = pattern.sub(" ", text)
    return {
        match[1]
        for match in _IDENTIFIER.finditer(text)
        if match[2] is None and match[1].lower() not in _KEYWORDS
    }


_SERIES_SUFFIXES = {
    "counter": ("_total",),
    "gauge": ("",),
    "histogram": ("_bucket", "_sum", "_count"),
}


def exported_series(exposition: str) -> set[str]:
    """Every series name a query can select from this exposition: each family's samples, and
    the names its type gives it before its first sample (a labelled metric nobody has
    observed yet has none)."""
    names: set[str] = set()
    for family in text_string_to_metric_families(exposition):
        assert family.type in _SERIES_SUFFIXES, f"{family.name}: name the series of a {family.type}"
        names.update(family.name + suffix for suffix in _SERIES_SUFFIXES[family.type])
        names.update(sample.name for sample in family.samples)
    return names


def panels() -> list[dict[str, Any]]:
    """The dashboard's panels, those inside rows included; rows themselves are not panels."""
    found: list[dict[str, Any]] = []
    for panel in load(DASHBOARD)["panels"]:
        found.extend(panel.get("panels", []) if panel["type"] == "row" else [panel])
    return found


def rules() -> list[dict[str, Any]]:
    return [rule for group in load(ALERTS)["groups"] for rule in group["rules"]]


def queries() -> Iterator[tuple[str, set[str]]]:
    """Each dashboard panel and each alert rule, with the metric names it queries."""
    for panel in panels():
        names = set().union(*(queried_metrics(t["expr"]) for t in panel["targets"]))
        yield f"panel {panel['title']!r}", names
    for rule in rules():
        yield f"alert {rule['alert']} ({rule['expr']})", queried_metrics(rule["expr"])


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        (
            'histogram_quantile(0.99, sum by (le, tier) (rate(kvgate_ttft_seconds_bucket{tier="a",'
            ' worker=~"w.*"}[$__rate_interval])))',
            {"kvgate_ttft_seconds_bucket"},
        ),
        ("max(kvgate_workers_live) == 0 or absent(kvgate_workers_live)", {"kvgate_workers_live"}),
        ("sum(a:b) without (tier) / on (tier) group_left b offset 5m > bool 1e3", {"a:b", "b"}),
        ('label_replace(vector(1), "tier", "x{y}", "", "")', set()),
    ],
)
def test_promql_names_are_the_series_an_expression_selects(expr: str, names: set[str]) -> None:
    assert queried_metrics(expr) == names


@pytest.mark.parametrize(
    "path",
    [DASHBOARD, DATASOURCES, DASHBOARD_PROVIDERS, PROMETHEUS, ALERTS, COMPOSE],
    ids=lambda path: str(path.relative_to(DEPLOY)),
)
def test_each_file_parses(path: Path) -> None:
    assert isinstance(load(path), dict)


def test_every_panel_and_rule_queries_a_metric() -> None:
    """Else the next test would pass on a query this module's parser failed to read."""
    assert [where for where, names in queries() if not names] == []


def test_every_metric_queried_is_one_a_front_door_exports(lonely_api: str) -> None:
    exported = exported_series(httpx.get(lonely_api + "/metrics").text)
    unknown = {where: sorted(names - exported) for where, names in queries() if names - exported}
    assert unknown == {}


def test_panels_query_the_provisioned_datasource() -> None:
    (source,) = load(DATASOURCES)["datasources"]
    for panel in panels():
        assert panel["datasource"]["uid"] == source["uid"], panel["title"]
        for target in panel["targets"]:
            assert target["datasource"]["uid"] == source["uid"], panel["title"]
    ids = [panel["id"] for panel in load(DASHBOARD)["panels"]]
    assert len(ids) == len(set(ids))


def test_each_alert_says_how_long_how_bad_and_what() -> None:
    for rule in rules():
        assert re.fullmatch(r"(\d+[smhdwy])+", rule["for"]), rule
        assert rule["labels"]["severity"] in {"critical", "warning"}, rule
        assert rule["annotations"]["summary"], rule
        assert rule["annotations"]["description"], rule


def test_objectives_drawn_and_alerted_on_are_the_configured_ones() -> None:
    """The objective lines and the queue-wait thresholds read ``kvgate_tier_objective_seconds``
    (what the front door is configured with), never a number written into the files."""
    drawn = [
        target["expr"]
        for panel in panels()
        for target in panel["targets"]
        if target["legendFormat"].endswith(" objective")
    ]
    assert len(drawn) == 3  # oldest pending age, TTFT, TPOT
    assert all(queried_metrics(expr) == {"kvgate_tier_objective_seconds"} for expr in drawn)
    queue_wait = [r for r in rules() if r["alert"] == "KvgateQueueWaitOverTtftObjective"]
    assert {re.search(r'tier="(\w+)"', r["expr"])[1] for r in queue_wait} == {  # type: ignore[index]
        tier.value for tier in DEFAULT_TIERS
    }
    for rule in queue_wait:
        assert 'kvgate_tier_objective_seconds{tier="' in rule["expr"], rule
        assert 'objective="ttft"' in rule["expr"], rule


def host_path(service: dict[str, Any], container_path: str) -> Path | None:
    """The file in deploy/ a container reads at ``container_path``, through one of its bind
    mounts (``./here:/there[:ro]``, relative to the compose file)."""
    volumes: list[str] = service["volumes"]
    for volume in volumes:
        source, target, *_ = volume.split(":")
        if source.startswith(".") and (container_path + "/").startswith(target + "/"):
            return (DEPLOY / source / posixpath.relpath(container_path, target)).resolve()
    return None


def container_ports(service: dict[str, Any]) -> set[str]:
    return {port.rsplit(":", 1)[1] for port in service["ports"]}


def test_compose_mounts_what_prometheus_and_grafana_read() -> None:
    services = load(COMPOSE)["services"]
    prometheus, grafana = services["prometheus"], services["grafana"]

    (config,) = [arg.split("=", 1)[1] for arg in prometheus["command"] if "--config.file=" in arg]
    assert host_path(prometheus, config) == PROMETHEUS
    config_dir = posixpath.dirname(config)
    rule_files = {
        host_path(prometheus, posixpath.join(config_dir, f)) for f in load(PROMETHEUS)["rule_files"]
    }
    assert rule_files == {ALERTS}

    assert host_path(grafana, f"{GRAFANA_PROVISIONING}/datasources/prometheus.yaml") == DATASOURCES
    assert (
        host_path(grafana, f"{GRAFANA_PROVISIONING}/dashboards/kvgate.yaml") == DASHBOARD_PROVIDERS
    )
    (provider,) = load(DASHBOARD_PROVIDERS)["providers"]
    assert host_path(grafana, provider["options"]["path"] + "/kvgate.json") == DASHBOARD
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert host_path(grafana, home) == DASHBOARD


def test_prometheus_scrapes_the_front_door_and_grafana_reads_prometheus() -> None:
    services = load(COMPOSE)["services"]
    for scrape in load(PROMETHEUS)["scrape_configs"]:
        assert scrape["metrics_path"] == "/metrics"
        for config in scrape["static_configs"]:
            for target in config["targets"]:
                host, port = target.split(":")
                assert host == "api"
                assert port in container_ports(services[host])
    (source,) = load(DATASOURCES)["datasources"]
    url = urlsplit(source["url"])
    assert url.hostname == "prometheus"
    assert str(url.port) in container_ports(services["prometheus"])
