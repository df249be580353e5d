"""Mixed load for fault tests, and the accounting after it (issue 14's chaos suite).

``MixedLoad`` drives a front door (a real subprocess) the way a fleet of agents would: sessions
of several calls, some of them in parallel; plain calls; streamed and non-streamed calls; calls
whose client disconnects (a streamed one after its first token, a non-streamed one mid-way);
and a small batch, uploaded as a file (Files and Batches APIs). It records, per call, what its
caller saw. A test injects its fault while the load runs, stops the load, and then asks:

- ``check_answers``: every call was answered exactly once (one complete body, or one stream
  with one finish and one ``[DONE]``) or ended with a clear error its caller saw (an error code
  from kvgate's vocabulary, never a dropped connection or an ``internal_error``); no call id
  was handed out twice; every session the load opened was closed.
- ``check_batch``: the batch's results hold exactly one line per input line, in order.
- ``wait_for_zero``: the system returns to rest: no reservation, lease or call slot left in
  the admission store, nothing pending or unacknowledged in JetStream, nothing running,
  waiting or staged at the workers, no call followed by the front door, and every call ever
  published ended exactly once at a worker. It returns how long that took.

The bounds below are generous on purpose (a loaded 2-core machine); the times measured are
printed, for the report, not asserted tightly.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from broker import natsconn
from broker.procs import Proc
from schemas.vocab import ErrorCode
from schemas.wire import RESULTS_STREAM, STREAM_NAME, WorkerHeartbeat
from tests.batches import batch_results, wait_for_batch
from tests.calls import chat_body
from tests.polling import poll_until
from tests.procs import start_api
from tests.sampler import FleetSampler, sample_fleet
from tests.simworker import sim_worker
from tests.tenants import tenant, write_tenants_file
from workers.sim_engine import SimEngine, SimEngineConfig

CLIENT_TIMEOUT_S = 60.0
"""Longest a caller waits for one answer: calls here take well under a second on the simulated
engine, so only a call that was lost runs into it (and fails the accounting)."""
CLOSE_BOUND_S = 75.0
"""How long an agent keeps retrying to close its session while the front door answers 503
(the admission store being away for 30 s, then the front door reconnecting)."""
ZERO_BOUND_S = 45.0
"""For everything to be back to zero once the load stops: leases end at once when closed,
heartbeats come every 0.3 s, queue lag is read every 2 s."""
BATCH_BOUND_S = 120.0
"""For the load's small batch to end once its calls can run."""
LANE_PAUSE_S = 0.05
"""Between two iterations of one lane: keeps the load steady without saturating two cores."""
RETRY_AFTER_CAP_S = 1.0
"""An agent told to come back later waits for ``Retry-After``, but at most this long, so that
the load keeps probing the front door throughout a fault."""
MODEL = "kvgate-sim"
CALL_TOKENS = 24
"""Output tokens of a call that runs to its end (the simulated engine always runs to
``max_tokens``): a complete answer has exactly this many."""
LONG_TOKENS = 400
"""Output tokens of a call the client disconnects from: long enough to still run when it does."""

CLEAR_ERRORS = frozenset(ErrorCode) - {ErrorCode.INTERNAL_ERROR}
"""A clear error: a code from the vocabulary that tells the caller what happened. An
``internal_error`` is kvgate failing, not an answer."""


class Kind(enum.StrEnum):
    SESSION_OPEN = "session_open"
    SESSION_CALL = "session_call"
    SESSION_CLOSE = "session_close"
    PLAIN_CALL = "plain_call"


@dataclass
class Outcome:
    """What one request's caller saw."""

    kind: Kind
    tier: str
    started_s: float
    stream: bool = False
    disconnect: bool = False
    """The client disconnects from this call on purpose before it ends."""
    ended_s: float = 0.0
    status: int | None = None
    call_id: str | None = None
    session_id: str | None = None
    answers: int = 0
    """Complete answers received: 1 for a call answered once."""
    code: str | None = None
    """The error code the caller saw (HTTP body or stream event)."""
    reason: str | None = None
    """A session's admission reason (``admitted``, ``admitted_degraded``)."""
    retry_after: int | None = None
    problem: str | None = None
    """Anything the caller saw that is neither an answer nor a clear error."""
    disconnected: bool = False
    """The client did disconnect before the answer was complete."""

    def during(self, start_s: float, end_s: float) -> bool:
        return start_s <= self.started_s and self.ended_s <= end_s

    @property
    def ok(self) -> bool:
        return self.answers == 1 and self.code is None and self.problem is None


@dataclass
class LoadShape:
    """How many lanes of each kind run side by side; each lane runs its loop until stopped."""

    guaranteed_sessions: int = 1
    standard_sessions: int = 1
    plain: int = 1
    disconnects: int = 1
    batch_sessions: int = 3
    batch_calls_per_session: int = 3
    batch_tokens: int = CALL_TOKENS
    batch_tier: str = "besteffort"
    """The batch's tier; a test that parks a tier's consumer moves the batch off it, so that
    the parked calls are the tier's only ones."""


@dataclass
class MixedLoad:
    base_url: str
    api_key: str
    shape: LoadShape = field(default_factory=LoadShape)
    outcomes: list[Outcome] = field(default_factory=list)
    batch_id: str | None = None
    batch_custom_ids: list[str] = field(default_factory=list)
    _stop: asyncio.Event = field(default_factory=asyncio.Event)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _closers: list[asyncio.Task[None]] = field(default_factory=list)

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {self.api_key}"},
            timeout=CLIENT_TIMEOUT_S,
        )

    async def start(self) -> None:
        """Submit the batch, then start every lane."""
        self._client = self.client()
        await self._submit_batch()
        lanes: list[Callable[[], Any]] = []
        lanes += [lambda: self._session_lane("guaranteed")] * self.shape.guaranteed_sessions
        lanes += [lambda: self._session_lane("standard")] * self.shape.standard_sessions
        lanes += [self._plain_lane] * self.shape.plain
        lanes += [self._disconnect_lane] * self.shape.disconnects
        self._tasks = [asyncio.create_task(lane()) for lane in lanes]

    async def stop(self) -> None:
        """Let every lane finish what it is doing (closing its session), then return."""
        self._stop.set()
        try:
            await asyncio.gather(*self._tasks)
            await asyncio.gather(*self._closers)
        finally:
            await self._client.aclose()

    async def run_for(self, seconds: float) -> None:
        """Let the load run (it runs in its own tasks); fails early if a lane crashed."""
        done, _ = await asyncio.wait(self._tasks, timeout=seconds)
        for task in done:
            task.result()

    async def call(self, tier: str, *, stream: bool, session_id: str | None = None) -> Outcome:
        """One call besides the lanes (a test's own), plain or in ``session_id`` (a session
        of ``tier``), recorded with the load's outcomes so that the accounting covers it."""
        if session_id is None:
            headers = {"X-Kvgate-Tier": tier}
            return await self._call(Kind.PLAIN_CALL, tier, stream=stream, headers=headers)
        headers = {"X-Kvgate-Session": session_id}
        return await self._call(Kind.SESSION_CALL, tier, stream=stream, headers=headers)

    # Lanes.

    async def _session_lane(self, tier: str) -> None:
        while not self._stop.is_set():
            await self._one_session(tier)
            await asyncio.sleep(LANE_PAUSE_S)

    async def _one_session(self, tier: str) -> None:
        opened = Outcome(Kind.SESSION_OPEN, tier, time.monotonic())
        body = {
            "tier": tier,
            "max_parallel": 2,
            "expected_calls": 4,
            "est_prompt_tokens": 40,
            "est_output_tokens": CALL_TOKENS,
            "idle_timeout_s": 30,
            "max_wait_s": 0,
        }
        try:
            resp = await self._client.post("/v1/sessions", json=body)
        except httpx.HTTPError as exc:
            self._record(opened, problem=f"transport: {exc!r}")
            return
        self._record_response(opened, resp, expect=201)
        if resp.status_code != 201:
            await self._back_off(opened)
            return
        session = resp.json()
        opened.session_id = session["id"]
        opened.reason = session["admission"]["reason"]
        headers = {"X-Kvgate-Session": session["id"]}
        # Two calls side by side (one streamed, one not), then two one after the other.
        await asyncio.gather(
            self._call(Kind.SESSION_CALL, tier, stream=True, headers=headers),
            self._call(Kind.SESSION_CALL, tier, stream=False, headers=headers),
        )
        await self._call(Kind.SESSION_CALL, tier, stream=False, headers=headers)
        await self._call(Kind.SESSION_CALL, tier, stream=True, headers=headers)
        # Closed in the background: an agent told to retry its close later goes on with its
        # next session meanwhile.
        self._closers.append(asyncio.create_task(self._close(session["id"], tier)))

    async def _close(self, session_id: str, tier: str) -> None:
        """Close the session, retrying while the front door cannot (503): an agent that
        leaves its session open holds its reservation until it idles out."""
        give_up = time.monotonic() + CLOSE_BOUND_S
        while True:
            closed = Outcome(Kind.SESSION_CLOSE, tier, time.monotonic(), session_id=session_id)
            try:
                resp = await self._client.delete(f"/v1/sessions/{session_id}")
            except httpx.HTTPError as exc:
                self._record(closed, problem=f"transport: {exc!r}")
                return
            self._record_response(closed, resp, expect=200)
            if resp.status_code != 503 or time.monotonic() > give_up:
                return
            await self._back_off(closed)

    async def _plain_lane(self) -> None:
        shapes = [("standard", False), ("standard", True), ("guaranteed", False)]
        shapes.append(("guaranteed", True))
        i = 0
        while not self._stop.is_set():
            tier, stream = shapes[i % len(shapes)]
            i += 1
            outcome = await self._call(
                Kind.PLAIN_CALL, tier, stream=stream, headers={"X-Kvgate-Tier": tier}
            )
            await self._back_off(outcome)
            await asyncio.sleep(LANE_PAUSE_S)

    async def _disconnect_lane(self) -> None:
        stream = True
        while not self._stop.is_set():
            outcome = await self._call(
                Kind.PLAIN_CALL,
                "standard",
                stream=stream,
                headers={"X-Kvgate-Tier": "standard"},
                disconnect=True,
            )
            stream = not stream
            await self._back_off(outcome)
            await asyncio.sleep(LANE_PAUSE_S)

    async def _back_off(self, outcome: Outcome) -> None:
        if outcome.retry_after is not None:
            await asyncio.sleep(min(outcome.retry_after, RETRY_AFTER_CAP_S))

    # One call.

    async def _call(
        self,
        kind: Kind,
        tier: str,
        *,
        stream: bool,
        headers: dict[str, str],
        disconnect: bool = False,
    ) -> Outcome:
        outcome = Outcome(kind, tier, time.monotonic(), stream=stream, disconnect=disconnect)
        outcome.session_id = headers.get("X-Kvgate-Session")
        tokens = LONG_TOKENS if disconnect else CALL_TOKENS
        extra: dict[str, Any] = {"model": MODEL}
        if stream:
            extra |= {"stream": True, "stream_options": {"include_usage": True}}
        body = chat_body("plan the next step", tokens, **extra)
        try:
            if stream:
                await self._streamed(outcome, body, headers, tokens)
            elif disconnect:
                # The client gives up mid-way: the task is cancelled, its connection closed.
                try:
                    await asyncio.wait_for(self._plain(outcome, body, headers, tokens), 0.3)
                except TimeoutError:
                    outcome.disconnected = True
            else:
                await self._plain(outcome, body, headers, tokens)
        except httpx.HTTPError as exc:
            outcome.problem = f"transport: {exc!r}"
        self._record(outcome)
        return outcome

    async def _plain(
        self, outcome: Outcome, body: dict[str, Any], headers: dict[str, str], tokens: int
    ) -> None:
        resp = await self._client.post("/v1/chat/completions", json=body, headers=headers)
        self._read_ids(outcome, resp)
        if resp.status_code != 200:
            self._read_error(outcome, resp)
            return
        answer = resp.json()
        if answer.get("usage", {}).get("completion_tokens") != tokens:
            outcome.problem = f"incomplete answer: {resp.text[:300]}"
            return
        outcome.answers = 1

    async def _streamed(
        self, outcome: Outcome, body: dict[str, Any], headers: dict[str, str], tokens: int
    ) -> None:
        async with self._client.stream(
            "POST", "/v1/chat/completions", json=body, headers=headers
        ) as resp:
            self._read_ids(outcome, resp)
            if resp.status_code != 200:
                await resp.aread()
                self._read_error(outcome, resp)
                return
            finishes = dones = pieces = 0
            usage: dict[str, Any] | None = None
            buffer = ""
            async for text in resp.aiter_text():
                buffer += text
                *lines, buffer = buffer.split("\n")
                for line in lines:
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        dones += 1
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        outcome.code = chunk["error"].get("code") or "?"
                    elif chunk.get("usage"):
                        usage = chunk["usage"]
                    # The simulated engine sends one token a chunk: a complete answer has
                    # exactly ``tokens`` of them (vLLM's own streams end with usage instead).
                    pieces += bool(chunk.get("choices"))
                    if any(c.get("finish_reason") for c in chunk.get("choices", [])):
                        finishes += 1
                    elif outcome.disconnect and chunk.get("choices"):
                        outcome.disconnected = True
                        return  # leaving the block closes the connection mid-stream
        if dones != 1:
            outcome.problem = f"{dones} [DONE] markers"
        elif finishes > 1:
            outcome.answers = finishes
        elif outcome.code is None:
            got = usage["completion_tokens"] if usage else pieces
            if finishes == 1 and got == tokens:
                outcome.answers = 1
            else:
                outcome.problem = f"stream of {got} tokens, {finishes} finishes"

    def _read_ids(self, outcome: Outcome, resp: httpx.Response) -> None:
        outcome.status = resp.status_code
        outcome.call_id = resp.headers.get("x-kvgate-call")
        outcome.session_id = resp.headers.get("x-kvgate-session", outcome.session_id)

    def _read_error(self, outcome: Outcome, resp: httpx.Response) -> None:
        try:
            outcome.code = resp.json()["error"]["code"]
        except (ValueError, KeyError, TypeError):
            outcome.problem = f"HTTP {resp.status_code} without an error code: {resp.text[:200]}"
        if "retry-after" in resp.headers:
            outcome.retry_after = int(resp.headers["retry-after"])

    def _record_response(self, outcome: Outcome, resp: httpx.Response, *, expect: int) -> None:
        outcome.status = resp.status_code
        if resp.status_code == expect:
            outcome.answers = 1
        else:
            self._read_error(outcome, resp)
        self._record(outcome)

    def _record(self, outcome: Outcome, *, problem: str | None = None) -> None:
        outcome.ended_s = time.monotonic()
        if problem is not None:
            outcome.problem = problem
        self.outcomes.append(outcome)

    # The batch.

    async def _submit_batch(self) -> None:
        lines = []
        for s in range(self.shape.batch_sessions):
            for c in range(self.shape.batch_calls_per_session):
                custom_id = f"b{s}-{c}"
                self.batch_custom_ids.append(custom_id)
                body = chat_body(f"batch step {custom_id}", self.shape.batch_tokens, model=MODEL)
                lines.append(
                    json.dumps(
                        {
                            "custom_id": custom_id,
                            "session": f"b{s}",
                            "method": "POST",
                            "url": "/v1/chat/completions",
                            "body": body,
                        }
                    )
                )
        if not lines:
            return
        files = {"file": ("chaos.jsonl", "\n".join(lines).encode(), "application/jsonl")}
        uploaded = await self._client.post("/v1/files", data={"purpose": "batch"}, files=files)
        assert uploaded.status_code in (200, 201), uploaded.text
        created = await self._client.post(
            "/v1/batches",
            json={
                "input_file_id": uploaded.json()["id"],
                "endpoint": "/v1/chat/completions",
                "completion_window": "1h",
                "tier": self.shape.batch_tier,
            },
        )
        assert created.status_code == 201, created.text
        self.batch_id = created.json()["id"]


# The accounting.


def check_answers(outcomes: list[Outcome]) -> list[str]:
    """Every way in which the callers were not answered exactly once or told clearly why not;
    empty when all were."""
    faults = []
    for o in outcomes:
        what = f"{o.kind} {o.tier} stream={o.stream} call={o.call_id} session={o.session_id}"
        if o.problem is not None:
            faults.append(f"{what}: {o.problem}")
        elif o.answers > 1:
            faults.append(f"{what}: answered {o.answers} times")
        elif o.answers == 1 and o.code is not None:
            faults.append(f"{what}: answered and also told {o.code}")
        elif o.answers == 0 and o.code is None and not o.disconnected:
            faults.append(f"{what}: neither answered nor told why (HTTP {o.status})")
        elif o.code is not None and o.code not in CLEAR_ERRORS:
            faults.append(f"{what}: unclear error {o.code!r} (HTTP {o.status})")
    ids = Counter(o.call_id for o in outcomes if o.call_id is not None)
    faults += [f"call id {call_id} seen {n} times" for call_id, n in ids.items() if n > 1]
    opened = {o.session_id for o in outcomes if o.kind is Kind.SESSION_OPEN and o.ok}
    closed = {o.session_id for o in outcomes if o.kind is Kind.SESSION_CLOSE and o.ok}
    faults += [f"session {sid} never closed" for sid in sorted(opened - closed, key=str)]
    return faults


async def check_batch(load: MixedLoad, *, timeout_s: float = BATCH_BOUND_S) -> dict[str, Any]:
    """Wait for the load's batch to end; its object. Asserts one result per input line, in
    order, each completed."""
    assert load.batch_id is not None
    async with load.client() as client:
        batch = await wait_for_batch(client, load.batch_id, timeout_s=timeout_s)
        results = await batch_results(client, load.batch_id)
    assert batch["status"] == "completed", batch
    assert [r["custom_id"] for r in results] == load.batch_custom_ids, results
    bad = [r for r in results if r["status"] != "completed" or r.get("status_code") != 200]
    assert not bad, bad
    tokens = load.shape.batch_tokens
    assert all(r["body"]["usage"]["completion_tokens"] == tokens for r in results), results
    return batch


# Back to zero.


async def metrics(base_url: str) -> dict[str, float]:
    """The front door's unlabelled metric samples, by name."""
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as client:
        text = (await client.get("/metrics")).text
    return {
        sample.name: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if not sample.labels
    }


@contextlib.asynccontextmanager
async def redis_reader(url: str, prefix: str = "{kvgate}") -> AsyncIterator[RedisHoldings]:
    client = aioredis.Redis.from_url(url, decode_responses=True, socket_timeout=2)
    try:
        yield RedisHoldings(client, prefix)
    finally:
        await client.aclose()


@dataclass
class RedisHoldings:
    """What the admission store holds, read the way ``broker/admission/redis_store.py``
    documents its keys."""

    client: aioredis.Redis
    prefix: str

    async def describe(self) -> str:
        """The leases and call slots held, with their sessions: a leak's evidence."""
        p = self.prefix
        lines = [f"\nleases: {await self.client.hgetall(f'{p}:leases')}"]
        async for key in self.client.scan_iter(f"{p}:slots:*"):
            lines.append(f"{key}: {await self.client.zrange(key, 0, -1, withscores=True)}")
        for sid in await self.client.hkeys(f"{p}:leases"):
            lines.append(f"{sid!s}: {await self.client.hgetall(f'{p}:s:{sid!s}')}")
        return "\n".join(lines)

    async def read(self) -> dict[str, int]:
        p = self.prefix
        raw = await self.client.hgetall(f"{p}:totals")
        totals = [(str(k), int(v)) for k, v in raw.items()]
        # Slots count where their session still holds a lease: a closed session's slots key
        # holds no capacity and expires with its calls' deadlines.
        leased = {str(sid) for sid in await self.client.hkeys(f"{p}:leases")}
        slots = 0
        for sid in leased:
            slots += await self.client.zcard(f"{p}:slots:{sid}")

        def total(kind: str) -> int:
            return sum(v for k, v in totals if k.startswith(f"{kind}:"))

        return {
            "redis_leases": await self.client.hlen(f"{p}:leases"),
            "redis_expiries": await self.client.zcard(f"{p}:expiry"),
            "redis_reserved": total("tier"),
            "redis_tenant_sessions": total("sessions"),
            "redis_tenant_parallel": total("parallel"),
            "redis_call_slots": slots,
        }


async def jetstream_holdings(nats_url: str) -> dict[str, int]:
    nc = await natsconn.connect(nats_url)
    try:
        js = nc.jetstream()
        calls = await js.stream_info(STREAM_NAME)
        results = await js.stream_info(RESULTS_STREAM)
        consumers = await js.consumers_info(STREAM_NAME)
        collector = await js.consumers_info(RESULTS_STREAM)
        return {
            "js_calls_published": calls.state.last_seq,
            "js_calls_pending": calls.state.messages,
            "js_calls_ack_pending": sum(c.num_ack_pending or 0 for c in consumers),
            "js_results_pending": results.state.messages,
            "js_results_ack_pending": sum(c.num_ack_pending or 0 for c in collector),
        }
    finally:
        await nc.close()


def worker_holdings(live: list[WorkerHeartbeat]) -> dict[str, int]:
    return {
        "workers_live": len(live),
        "worker_running": sum(hb.num_running for hb in live),
        "worker_waiting": sum(hb.num_waiting for hb in live),
        "worker_staged": sum(hb.staged for hb in live),
        "worker_ended": sum(hb.ended for hb in live),
        "worker_completed": sum(hb.completed for hb in live),
        # Not checked: what a failure's message needs to tell how the ended calls ended.
        "worker_failed": sum(hb.failed for hb in live),
        "worker_faulted": sum(hb.faulted for hb in live),
    }


@dataclass
class Rest:
    """Everything that must come back to zero, read from where an operator would read it."""

    base_url: str
    nats_url: str
    fleet: FleetSampler
    redis_url: str | None = None
    other_doors: tuple[str, ...] = ()
    """Further front doors on the same NATS and Redis: their calls and ledgers count too."""
    gone_ended: tuple[int, int] = (0, 0)
    """Calls ended by workers that are gone (their counters no longer in any heartbeat), at
    least and at most: exact for a worker that drained and told its final counters; for a
    killed one, from its last heartbeat to that plus what it might still have ended before
    the kill."""
    may_expire: int = 0
    """Calls the server may have dropped from the stream unstarted at their deadline (their
    ``Nats-TTL``), never delivered to a worker: at most this many (``may_have_expired``)."""

    async def read(self) -> dict[str, int]:
        readings = await jetstream_holdings(self.nats_url)
        readings |= worker_holdings(self.fleet.workers())
        readings["gone_ended_min"], readings["gone_ended_max"] = self.gone_ended
        readings["may_expire"] = self.may_expire
        readings["door_calls_open"] = readings["door_ledger_queued"] = 0
        for base_url in (self.base_url, *self.other_doors):
            door = await metrics(base_url)
            readings["door_calls_open"] += int(door["kvgate_calls_open"])
            readings["door_ledger_queued"] += int(door["kvgate_ledger_queued"])
        if self.redis_url is not None:
            async with redis_reader(self.redis_url) as holdings:
                readings |= await holdings.read()
        return readings


MUST_BE_ZERO = (
    "js_calls_pending",
    "js_calls_ack_pending",
    "js_results_pending",
    "js_results_ack_pending",
    "worker_running",
    "worker_waiting",
    "worker_staged",
    "door_calls_open",
    "door_ledger_queued",
    "redis_leases",
    "redis_expiries",
    "redis_reserved",
    "redis_tenant_sessions",
    "redis_tenant_parallel",
    "redis_call_slots",
)


def at_rest(readings: dict[str, int]) -> bool:
    """Nothing held anywhere, one live worker, and every call ever published ended once at a
    worker (its heartbeat counters are cumulative, so a call ended twice shows as more): the
    calls the live workers did not end, the gone ones did (``Rest.gone_ended``), but for those
    the server may have dropped unstarted at their deadline (``Rest.may_expire``)."""
    held = any(readings.get(name, 0) != 0 for name in MUST_BE_ZERO)
    not_ended_live = readings["js_calls_published"] - readings["worker_ended"]
    least = readings.get("gone_ended_min", 0)
    most = readings.get("gone_ended_max", 0) + readings.get("may_expire", 0)
    return not held and readings["workers_live"] >= 1 and least <= not_ended_live <= most


def may_have_expired(outcomes: list[Outcome]) -> int:
    """At most how many of the calls behind ``outcomes`` the server may have dropped from the
    stream unstarted at their deadline, which the publisher sets as the message's TTL: none,
    unless a stall outlasted a deadline (here 30 s), and then callers that waited were told
    ``deadline_exceeded``. After such a stall, any call not known to have started may have
    expired: those told so, those whose publish was not confirmed (``broker_unavailable``:
    queued or not) and those whose caller left before a streamed token showed it started."""
    if not any(o.code == ErrorCode.DEADLINE_EXCEEDED for o in outcomes):
        return 0
    unstarted = {ErrorCode.DEADLINE_EXCEEDED, ErrorCode.BROKER_UNAVAILABLE}
    return sum(
        1
        for o in outcomes
        if o.kind in (Kind.SESSION_CALL, Kind.PLAIN_CALL)
        and (o.code in unstarted or (o.disconnected and not o.stream))
    )


async def wait_for_zero(
    rest: Rest, *, timeout_s: float = ZERO_BOUND_S
) -> tuple[float, dict[str, int]]:
    """Seconds until ``at_rest`` held, and the readings then. On timeout, an
    ``AssertionError`` with the last readings."""
    started = time.monotonic()
    last: dict[str, int] = {}

    async def read() -> dict[str, int]:
        nonlocal last
        last = await rest.read()
        return last

    try:
        readings = await poll_until(read, at_rest, timeout_s=timeout_s, interval_s=0.25)
    except TimeoutError:
        held = ""
        if rest.redis_url is not None:
            async with redis_reader(rest.redis_url) as holdings:
                held = await holdings.describe()
        raise AssertionError(f"not back to zero within {timeout_s} s: {last}{held}") from None
    return time.monotonic() - started, readings


async def time_until_admitted(base_url: str, api_key: str, tier: str, *, timeout_s: float) -> float:
    """Seconds until a fresh session of ``tier`` is admitted (``admitted``, not degraded), the
    session closed again at once."""
    started = time.monotonic()
    headers = {"Authorization": f"Bearer {api_key}"}
    body = {"tier": tier, "max_parallel": 1, "expected_calls": 1, "max_wait_s": 0}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=10) as client:

        async def probe() -> httpx.Response:
            resp = await client.post("/v1/sessions", json=body)
            if resp.status_code == 201:
                await client.delete(f"/v1/sessions/{resp.json()['id']}")
            return resp

        await poll_until(
            probe,
            lambda r: r.status_code == 201 and r.json()["admission"]["reason"] == "admitted",
            timeout_s=timeout_s,
            interval_s=0.1,
        )
    return time.monotonic() - started


async def readyz(base_url: str) -> int:
    async with httpx.AsyncClient(base_url=base_url, timeout=5) as client:
        try:
            return (await client.get("/readyz")).status_code
        except httpx.HTTPError:
            return 0


async def time_until_answered(load: MixedLoad, *, timeout_s: float) -> float:
    """Seconds until a plain call is answered in full again."""
    started = time.monotonic()
    body = chat_body("are you back", CALL_TOKENS, model=MODEL)
    async with load.client() as client:

        async def call() -> httpx.Response:
            try:
                return await client.post("/v1/chat/completions", json=body)
            except httpx.HTTPError:
                return httpx.Response(599)

        await poll_until(call, lambda r: r.status_code == 200, timeout_s=timeout_s, interval_s=0.2)
    return time.monotonic() - started


def summary(outcomes: list[Outcome]) -> str:
    """One line per kind, tier and what the caller saw: for the printed report."""

    def seen(o: Outcome) -> str:
        if o.ok:
            return "ok" + (f" ({o.reason})" if o.reason else "")
        return o.code or ("disconnected" if o.disconnected else str(o.problem))

    counts = Counter((o.kind.value, o.tier, seen(o)) for o in outcomes)
    return "\n".join(f"  {n:4d} {k} {tier} {what}" for (k, tier, what), n in sorted(counts.items()))


# The system under load.

API_KEY = "chaos-key"


@dataclass
class ChaosStack:
    base_url: str
    nats_url: str
    fleet: FleetSampler
    rest: Rest
    log: Path

    def load(self, shape: LoadShape | None = None) -> MixedLoad:
        return MixedLoad(self.base_url, API_KEY, shape or LoadShape())


@contextlib.asynccontextmanager
async def chaos_stack(
    tmp_path: Path,
    nats_url: str,
    *,
    redis_url: str,
    database_url: str | None = None,
    worker: dict[str, Any] | None = None,
    **env: str,
) -> AsyncIterator[ChaosStack]:
    """A front door (``chaos_front_door``), and one in-process worker on the simulated engine
    (``worker``: further settings of it)."""
    with chaos_front_door(tmp_path, nats_url, redis_url, database_url, **env) as (proc, base):
        engine = SimEngine(SimEngineConfig(step_s=0.005, kv_capacity_tokens=8192))
        async with (
            sim_worker(engine, nats_url, "sim-chaos", ready_at=base, **(worker or {})),
            sample_fleet(nats_url) as fleet,
        ):
            rest = Rest(base, nats_url, fleet, redis_url)
            assert proc.log_path is not None
            yield ChaosStack(base, nats_url, fleet, rest, proc.log_path)


@contextlib.contextmanager
def chaos_front_door(
    tmp_path: Path, nats_url: str, redis_url: str, database_url: str | None = None, **env: str
) -> Iterator[tuple[Proc, str]]:
    """A front door (subprocess) on ``nats_url`` with its admission state in Redis at
    ``redis_url`` and its database at ``database_url`` (an SQLite file in ``tmp_path`` unless
    given), and a tenant that may use every tier; the process and its base URL."""
    tenants = write_tenants_file(tmp_path, tenant("chaos", API_KEY, max_tier="guaranteed"))
    proc, base = start_api(
        nats_url,
        tmp_path,
        KVGATE_TENANTS_FILE=str(tenants),
        KVGATE_SERVED_MODEL_NAME=MODEL,
        KVGATE_REDIS_URL=redis_url,
        KVGATE_DATABASE_URL=database_url or f"sqlite:///{tmp_path}/kvgate.db",
        KVGATE_BATCH_TICK_S="0.1",
        **env,
    )
    try:
        yield proc, base
    finally:
        proc.stop()
