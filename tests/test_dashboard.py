"""The dashboard (``/dashboard``): its history's arithmetic, then the page itself in a real
headless Chromium (Debian's ``/usr/bin/chromium``, driven by Playwright; no browser is ever
downloaded) against a real front door: it is refused without the admin token, signs in through
its form, shows the lag ``/v1/admin/lag`` serves, and follows calls that queue with no worker
pulling them and drain once one starts."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
from nats.aio.client import Client as NATS
from playwright.async_api import Browser, Page, async_playwright

from api.dashboard import History, Sample, WorkerState, decision_rates, quantile, worker_rows
from api.routes.dashboard import COOKIE_MAX_AGE_S, session_value, valid_cookie
from broker.natsserver import EmbeddedNats
from broker.procs import Proc
from loadtests.heartbeats import idle_heartbeat, keep_beating
from schemas.vocab import Decision, Reason
from schemas.wire import WORKERS_BUCKET
from tests.polling import poll_until, wait_ready
from tests.procs import start_api
from tests.simworker import sim_worker
from workers.sim_engine import SimEngine, SimEngineConfig

CHROMIUM = Path("/usr/bin/chromium")
ADMIN_TOKEN = "dashboard-test-admin-token"
API_ENV = {
    "KVGATE_ADMIN_TOKEN": ADMIN_TOKEN,
    "KVGATE_DASHBOARD_SAMPLE_S": "0.5",
    # A worker that stops heartbeating shows as stale soon after (the bucket forgets it after
    # `worker_ttl_s`, 10 s).
    "KVGATE_HEARTBEAT_MAX_AGE_S": "3",
    "KVGATE_BATCH_RUNNER": "false",
}
PAGE_BOUND_S = 30.0
"""How long the page may take to show a change: the lag is read every 2 s, sampled every
0.5 s and polled every 0.5 s; generous for a loaded 2-core machine."""
CALL_TIMEOUT_S = 120
QUEUED = 4
STREAMED = 6
BODY = {
    "model": "kvgate-dev",
    "messages": [{"role": "user", "content": "wait for me"}],
    "max_tokens": 8,
    "stream": False,
}

# -- the history's arithmetic, no server ----------------------------------------------------


def test_a_quantile_is_interpolated_within_its_bucket() -> None:
    buckets = [(0.1, 10.0), (0.5, 30.0), (1.0, 40.0), (float("inf"), 40.0)]
    assert quantile(buckets, 0.25) == pytest.approx(0.1 * 10 / 10)  # rank 10: top of the first
    assert quantile(buckets, 0.5) == pytest.approx(0.1 + 0.4 * (20 - 10) / 20)
    assert quantile(buckets, 0.99) == pytest.approx(0.5 + 0.5 * (39.6 - 30) / 10)
    assert quantile([(1.0, 0.0), (float("inf"), 0.0)], 0.5) is None
    # Past the last finite bound: that bound, as Prometheus answers.
    assert quantile([(1.0, 1.0), (float("inf"), 5.0)], 0.99) == 1.0


def test_the_ring_answers_only_what_a_page_lacks() -> None:
    history = History(span_s=5, interval_s=1)
    for seq in range(1, 10):
        history.append(_sample(seq))  # 1-4 fall out
    assert [s.seq for s in history.after(-1)] == [5, 6, 7, 8, 9]
    assert [s.seq for s in history.after(2)] == [5, 6, 7, 8, 9]
    assert [s.seq for s in history.after(7)] == [8, 9]
    assert history.after(9) == []
    assert history.after(42) == []  # a page that saw another front door's history


def test_a_worker_past_its_heartbeat_age_is_stale_not_idle() -> None:
    now_ms = 100_000
    beats = [
        idle_heartbeat("fresh", 2048),
        idle_heartbeat("old", 2048),
        msgspec.structs.replace(idle_heartbeat("leaving", 2048), draining=True),
    ]
    beats = [msgspec.structs.replace(hb, sent_ms=now_ms - 1000) for hb in beats]
    beats[1] = msgspec.structs.replace(beats[1], sent_ms=now_ms - 7000)
    rows = {row.worker_id: row for row in worker_rows(beats, now_ms, max_age_ms=6000)}
    assert {w: row.state for w, row in rows.items()} == {
        "fresh": WorkerState.SERVING,
        "old": WorkerState.STALE,
        "leaving": WorkerState.DRAINING,
    }
    assert rows["old"].heartbeat_age_s == 7.0


def test_decision_rates_are_per_second_since_the_last_sample() -> None:
    admit, defer = (Decision.ADMIT, Reason.ADMITTED), (Decision.DEFER, Reason.NO_WORKERS)
    rates = decision_rates({admit: 14.0, defer: 3.0}, {admit: 4.0, defer: 3.0}, 2.0)
    assert [(r.decision, r.reason, r.per_s) for r in rates] == [
        (*admit, 5.0),
        (*defer, 0.0),  # kept, at zero: its line falls rather than ends
    ]


def test_a_sign_in_cookie_is_good_for_its_token_and_its_age_only() -> None:
    issued = 1_800_000_000
    cookie = session_value("the-token", issued)
    assert valid_cookie(cookie, "the-token", issued + 60)
    assert not valid_cookie(cookie, "another-token", issued + 60)
    # A copy kept past its age is refused, whatever the browser was told.
    assert not valid_cookie(cookie, "the-token", issued + COOKIE_MAX_AGE_S + 1)
    assert not valid_cookie(cookie, "the-token", issued - 60)  # issued in the future
    later = cookie.replace(str(issued), str(issued + 3600), 1)  # its time moved: not signed
    assert not valid_cookie(later, "the-token", issued + 3600)
    assert not valid_cookie("not-a-cookie", "the-token", issued)


def _sample(seq: int) -> Sample:
    return Sample(
        seq=seq,
        t=float(seq),
        lag=None,
        lag_age_s=None,
        pressure="normal",
        overcommit=1.0,
        windows={},
        sessions={},
        decisions=[],
        latency=[],
        worker_kv={},
    )


# -- the page in a browser ----------------------------------------------------------------------


@pytest.fixture
def front_door(nats_server: EmbeddedNats, tmp_path: Path) -> Iterator[str]:
    proc: Proc
    proc, base = start_api(nats_server.url, tmp_path, **API_ENV)
    try:
        yield base
    finally:
        proc.stop()


@pytest.fixture
async def browser() -> AsyncIterator[Browser]:
    # No skip without it: a browser test that silently did not run would pass CI. Playwright
    # names the missing executable.
    async with async_playwright() as playwright:
        chromium = await playwright.chromium.launch(executable_path=str(CHROMIUM))
        try:
            yield chromium
        finally:
            await chromium.close()


async def _sign_in(page: Page, token: str) -> int:
    """Submit the sign-in form; the status of the answer to the post."""
    await page.fill("input[name=token]", token)
    async with page.expect_response(lambda r: r.url.endswith("/dashboard/login")) as posted:
        await page.click("button[type=submit]")
    await page.wait_for_load_state()
    return (await posted.value).status


async def test_the_page_needs_the_admin_token(front_door: str, browser: Browser) -> None:
    context = await browser.new_context()
    try:
        page = await context.new_page()
        await page.goto(front_door + "/dashboard")
        assert await page.locator("form#login").is_visible()
        assert await page.get_attribute("form#login", "method") == "post"  # never in a URL
        assert await page.locator("#dashboard").count() == 0
        refused = await page.request.get(front_door + "/dashboard/history")
        assert refused.status == 401
        error = (await refused.json())["error"]
        assert (error["code"], error["type"]) == ("unauthorized", "authentication_error")

        assert await _sign_in(page, "not-the-token") == 401
        assert await page.locator("form#login").is_visible()
        assert "not this front door's admin token" in await page.inner_text(".message")
        assert (await page.request.get(front_door + "/dashboard/history")).status == 401
        assert await context.cookies() == []

        assert await _sign_in(page, ADMIN_TOKEN) == 303
        await page.locator("#dashboard").wait_for()
        assert page.url == front_door + "/dashboard"  # the token never in a URL
        (cookie,) = await context.cookies()
        assert cookie["httpOnly"] and cookie["sameSite"] == "Strict"
        assert ADMIN_TOKEN not in cookie["value"]
        assert await page.evaluate("document.cookie") == ""  # out of the page's scripts' reach
        assert (await page.request.get(front_door + "/dashboard/history")).status == 200

        await page.click("header form button")
        await page.locator("form#login").wait_for()
        assert (await page.request.get(front_door + "/dashboard/history")).status == 401
    finally:
        await context.close()
    # Scripts may use the token itself; a wrong one is refused as a missing one is.
    async with httpx.AsyncClient(base_url=front_door) as client:
        for token, status in ((ADMIN_TOKEN, 200), ("nope", 401)):
            resp = await client.get(
                "/dashboard/history", headers={"Authorization": f"Bearer {token}"}
            )
            assert resp.status_code == status


async def _page_lag(page: Page) -> dict[str, dict[str, str]]:
    """The queue numbers the page shows, raw (``data-value``), by tier and field."""
    found: dict[str, dict[str, str]] = await page.evaluate(
        """() => {
            const out = {};
            for (const el of document.querySelectorAll('.metric[data-tier]')) {
                (out[el.dataset.tier] ??= {})[el.dataset.field] =
                    el.querySelector('.value').dataset.value;
            }
            return out;
        }"""
    )
    return found


async def _admin_lag(client: httpx.AsyncClient) -> dict[str, dict[str, Any]]:
    resp = await client.get("/v1/admin/lag", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"})
    resp.raise_for_status()
    return {row["tier"]: row for row in resp.json()["tiers"]}


def _matches(page: dict[str, dict[str, str]], admin: dict[str, dict[str, Any]]) -> bool:
    """Counts equal, tier by tier; the oldest call's age within what the page's sampling adds
    (the admin route reads the server now, the page a reading up to a few seconds old)."""
    if set(page) != set(admin):
        return False
    for tier, row in admin.items():
        shown = page[tier]
        for field in ("pending", "ack_pending", "redelivered"):
            if shown.get(field) != str(row[field]):
                return False
        age, shown_age = row["oldest_pending_age_s"], shown.get("oldest_pending_age_s")
        if (age is None) != (shown_age in ("", None)):
            return False
        if age is not None and abs(float(shown_age or 0) - age) > 10:
            return False
    return True


async def _latency(page: Page, tier: str = "standard") -> dict[str, str]:
    """A tier's row of the calls table, as shown, by field."""
    row: dict[str, str] = await page.evaluate(
        """(tier) => {
            const out = {};
            for (const td of document.querySelectorAll(
                `#latency-rows tr[data-tier="${tier}"] td[data-field]`)) {
                out[td.dataset.field] = td.textContent;
            }
            return out;
        }""",
        tier,
    )
    return row


async def _pending(page: Page, tier: str = "standard") -> int | None:
    value = (await _page_lag(page)).get(tier, {}).get("pending")
    return int(value) if value not in (None, "", "unknown") else None


async def _sessions(page: Page, tier: str = "standard") -> int | None:
    """The live sessions of ``tier`` the page shows."""
    text = await page.evaluate(
        """(tier) => {
            const cell = document.querySelector(`#session-rows tr[data-tier=${tier}] td.num`);
            return cell ? cell.textContent : null;
        }""",
        tier,
    )
    return int(text) if isinstance(text, str) and text.isdigit() else None


async def test_the_page_follows_calls_queued_then_served(
    front_door: str, nats_server: EmbeddedNats, nc: NATS, browser: Browser, tmp_path: Path
) -> None:
    started = time.monotonic()
    kv = await nc.jetstream().key_value(WORKERS_BUCKET)
    # A worker that heartbeats but never pulls: calls are admitted, then wait in the queue.
    stuck = asyncio.create_task(keep_beating(kv, "stuck", 2048, max_num_seqs=16, interval_s=0.5))
    calls: list[asyncio.Task[httpx.Response]] = []
    context = await browser.new_context(viewport={"width": 1400, "height": 1000})
    try:
        page = await context.new_page()
        # A script error, or anything the page's content policy blocked, is a failure.
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.on("console", lambda msg: errors.append(msg.text) if msg.type == "error" else None)
        await page.goto(front_door + "/dashboard")
        await _sign_in(page, ADMIN_TOKEN)
        await page.locator(".metric[data-tier=standard][data-field=pending]").wait_for()
        await wait_ready(front_door)
        # Ready says nothing of the lag's first reading: the page may show it unknown at first.
        await poll_until(lambda: _pending(page), lambda n: n == 0, timeout_s=PAGE_BOUND_S)

        async with httpx.AsyncClient(base_url=front_door, timeout=CALL_TIMEOUT_S + 30) as client:
            for _ in range(QUEUED):
                calls.append(
                    asyncio.create_task(
                        client.post(
                            "/v1/chat/completions",
                            json=BODY,
                            headers={"X-Kvgate-Timeout": str(CALL_TIMEOUT_S)},
                        )
                    )
                )
            await poll_until(lambda: _pending(page), lambda n: n == QUEUED, timeout_s=PAGE_BOUND_S)
            # Each queued call is a one-call session holding its lease (read every 5 s).
            await poll_until(lambda: _sessions(page), lambda n: n == QUEUED, timeout_s=PAGE_BOUND_S)
            # The same numbers as the admin API, once the page has caught up with the server.
            await poll_until(
                lambda: _both(page, client),
                lambda both: _matches(*both),
                timeout_s=PAGE_BOUND_S,
            )

            engine = SimEngine(
                SimEngineConfig(
                    served_model_name="kvgate-dev", step_s=0.005, kv_capacity_tokens=8192
                )
            )
            async with sim_worker(engine, nats_server.url, "sim-1", ready_at=front_door):
                await poll_until(lambda: _pending(page), lambda n: n == 0, timeout_s=PAGE_BOUND_S)
                answers = await asyncio.wait_for(asyncio.gather(*calls), PAGE_BOUND_S)
                assert [r.status_code for r in answers] == [200] * QUEUED, answers[0].text
                await poll_until(lambda: _sessions(page), lambda n: n == 0, timeout_s=PAGE_BOUND_S)
                # Streamed calls, served at once: their time per output token is measured too.
                streamed = [
                    client.post(
                        "/v1/chat/completions", json={**BODY, "stream": True, "max_tokens": 16}
                    )
                    for _ in range(STREAMED)
                ]
                answers = await asyncio.wait_for(asyncio.gather(*streamed), PAGE_BOUND_S)
                assert [r.status_code for r in answers] == [200] * STREAMED, answers[0].text
                await poll_until(
                    lambda: _latency(page),
                    lambda row: (
                        row.get("calls") == str(QUEUED + STREAMED)
                        and any(c.isdigit() for c in row.get("tpot_p50_s", ""))
                    ),
                    timeout_s=PAGE_BOUND_S,
                )
                # The worker that never pulled stops heartbeating: the page marks it stale.
                stuck.cancel()
                stale = page.locator("tr.stale[data-worker=stuck]")
                await stale.wait_for(timeout=PAGE_BOUND_S * 1000)
                await page.locator("tr.serving[data-worker=sim-1]").wait_for()
                shot = tmp_path / "dashboard.png"
                await page.screenshot(path=str(shot), full_page=True)
                print(f"dashboard screenshot: {shot}")
                if dest := _keep_screenshot_at():
                    shutil.copy(shot, dest)
        assert await _pending(page) == 0
        assert errors == []
    finally:
        stuck.cancel()
        for call in calls:
            call.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(stuck, *calls, return_exceptions=True)
        await context.close()
    print(f"browser test took {time.monotonic() - started:.1f} s")


async def _both(
    page: Page, client: httpx.AsyncClient
) -> tuple[dict[str, dict[str, str]], dict[str, dict[str, Any]]]:
    return await _page_lag(page), await _admin_lag(client)


def _keep_screenshot_at() -> Path | None:
    """``KVGATE_DASHBOARD_SCREENSHOT``: where to copy the screenshot too (``docs/`` keeps one
    for the README)."""
    value = os.environ.get("KVGATE_DASHBOARD_SCREENSHOT")
    return Path(value) if value else None
