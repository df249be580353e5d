"""``kvgate top``: the fleet at a glance in a terminal, for an operator on a server with no
browser. It reads what the dashboard reads, over HTTP from one front door: ``/v1/admin/lag``
and ``/v1/admin/workers`` (behind the admin token) and ``/metrics`` (admission's decisions,
pressure and over-commit factor). Rates are the change between two frames.

Reading (``Frame.read``) and drawing (``render``) are apart, so a frame can be drawn from any
readings; ``rich`` draws it, full-screen and refreshed, or once (``--once``)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

PRESSURE = {0: "normal", 1: "elevated", 2: "saturated"}
"""``kvgate_admission_pressure``'s values (``broker.admission.pressure.Pressure``)."""


class TopError(Exception):
    """The front door could not be read: its message says what to do."""


@dataclass
class Frame:
    """One reading of a front door."""

    taken_s: float
    tiers: list[dict[str, Any]]
    workers: list[dict[str, Any]]
    decisions: dict[tuple[str, str], float] = field(default_factory=dict)
    """Decisions made so far by (decision, reason), all tiers."""
    pressure: str | None = None
    overcommit: float | None = None

    @classmethod
    def read(cls, base_url: str, token: str | None) -> Frame:
        taken_s = time.monotonic()
        lag = _get_json(base_url + "/v1/admin/lag", token)
        workers = _get_json(base_url + "/v1/admin/workers", token)
        frame = cls(taken_s, lag["tiers"], workers["workers"])
        text = _get(base_url + "/metrics", None).decode()
        decisions: dict[tuple[str, str], float] = defaultdict(float)
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == "kvgate_admission_decisions_total":
                    decisions[sample.labels["decision"], sample.labels["reason"]] += sample.value
                elif sample.name == "kvgate_admission_pressure":
                    frame.pressure = PRESSURE.get(int(sample.value), str(sample.value))
                elif sample.name == "kvgate_admission_overcommit":
                    frame.overcommit = sample.value
        frame.decisions = dict(decisions)
        return frame


def _get(url: str, token: str | None) -> bytes:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as r:
            return bytes(r.read())
    except urllib.error.HTTPError as error:
        if error.code == 401:
            raise TopError(f"{url}: 401; set KVGATE_ADMIN_TOKEN to the front door's") from error
        raise TopError(f"{url}: {error.code} {error.reason}") from error
    except (urllib.error.URLError, OSError) as error:
        raise TopError(f"{url}: {error}") from error


def _get_json(url: str, token: str | None) -> dict[str, Any]:
    found: dict[str, Any] = json.loads(_get(url, token))
    return found


def _rates(now: Frame, before: Frame | None) -> dict[tuple[str, str], float] | None:
    if before is None or now.taken_s <= before.taken_s:
        return None
    span = now.taken_s - before.taken_s
    return {
        key: (count - before.decisions.get(key, 0.0)) / span
        for key, count in now.decisions.items()
        if count > before.decisions.get(key, 0.0)
    }


def _age(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds:.1f}s"


def render(base_url: str, now: Frame, before: Frame | None) -> Group:
    """A frame: admission, the queue per tier, a row per worker (stale ones in red)."""
    title = Text(f"kvgate top  {base_url}  {time.strftime('%H:%M:%S')}", style="bold")
    rates = _rates(now, before)
    admission = Text("admission: pressure ")
    admission.append(now.pressure or "-", style="red" if now.pressure == "saturated" else "")
    factor = "-" if now.overcommit is None else f"{now.overcommit:.2f}"
    admission.append(f"  over-commit {factor}  decisions/s: ")
    if rates is None:
        admission.append("(next frame)")
    else:
        shown = sorted(rates.items(), key=lambda kv: -kv[1])
        admission.append(", ".join(f"{d} {r} {v:.1f}" for (d, r), v in shown) if shown else "none")

    queue = Table(title="queue per tier", title_justify="left", expand=True)
    for column in ("tier", "pending", "ack pending", "redelivered", "oldest pending"):
        queue.add_column(column, justify="left" if column == "tier" else "right")
    for row in now.tiers:
        queue.add_row(
            str(row["tier"]),
            str(row["pending"]),
            str(row["ack_pending"]),
            str(row["redelivered"]),
            _age(row.get("oldest_pending_age_s")),
        )

    live = sum(1 for w in now.workers if not w.get("stale"))
    workers = Table(title=f"workers ({live} live)", title_justify="left", expand=True)
    columns = ("worker", "kv", "running/max", "waiting", "staged", "preempted", "state", "beat")
    for column in columns:
        workers.add_column(column, justify="left" if column in ("worker", "state") else "right")
    for w in sorted(now.workers, key=lambda w: str(w["worker_id"])):
        usage = w.get("kv_cache_usage")
        stale = bool(w.get("stale"))
        workers.add_row(
            str(w["worker_id"]),
            "-" if usage is None else f"{usage:.0%}",
            f"{w['num_running']}/{w['max_num_seqs']}",
            str(w["num_waiting"]),
            str(w.get("staged", 0)),
            str(w.get("num_preemptions", 0)),
            "stale" if stale else "draining" if w.get("draining") else "serving",
            _age(w.get("age_s")),
            style="red" if stale else None,
        )
    return Group(title, admission, queue, workers)


def run(base_url: str, token: str | None, *, interval_s: float, once: bool) -> int:
    """Draws until Ctrl-C (0), or once; 1 with the reason when the front door cannot be read."""
    console = Console()
    base_url = base_url.rstrip("/")
    try:
        now = Frame.read(base_url, token)
        if once:
            console.print(render(base_url, now, None))
            return 0
        with Live(render(base_url, now, None), console=console, screen=True) as live:
            while True:
                time.sleep(interval_s)
                before, now = now, Frame.read(base_url, token)
                live.update(render(base_url, now, before))
    except TopError as error:
        console.print(f"kvgate top: {error}", style="red")
        return 1
    except KeyboardInterrupt:
        return 0
