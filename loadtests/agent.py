"""The simulated agent: replays one session of a trace against a target and records what it saw.

Three modes, one client:

- ``direct``: vLLM's own OpenAI server, no admission (the tier becomes vLLM's ``priority``, as
  kvgate's workers set it, so the modes differ in admission only);
- ``kvgate-call``: kvgate with plain OpenAI calls, each admitted as a one-call session;
- ``kvgate-session``: kvgate with the session declared first (``POST /v1/sessions``: its widest
  turn as ``max_parallel``, its call count, its mean prompt and output lengths as the per-call
  estimates), every call named by ``X-Kvgate-Session``, closed at the end.

A refused answer (429/503) is retried as the session's client kind does it: polite clients
wait the ``Retry-After`` (scaled by a random 0.8-1.2) within a retry budget and the session
deadline; naive clients retry at once up to a larger budget. A polite agent opens and closes its
kvgate session with ``kvgate.client.kvgate_session``, the client kvgate ships for agents, so the
benchmark measures what users run (it gives up at once on a refusal without ``Retry-After``);
the calls themselves are sent by this module's own streaming client in every mode, so that the
modes differ in what serves them, not in how TTFT and TPOT are read. A call that still fails, or the
session deadline, ends the session: the agent gives up on the task, cancels what is in flight
and sends nothing more (those calls count as offered and not served).

Times: TTFT is from the call's first attempt to its first content token (retry waits
included); TPOT is the mean time per output token after the first. SSE is split on ``\\n``
only: the small model emits characters that ``str.splitlines()`` treats as line ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from openai import APIStatusError, AsyncOpenAI

from kvgate.client import SessionNotOpened, kvgate_session
from loadtests.workload import CallSpec, ClientKind, SessionTrace

REFUSED_STATUSES = frozenset({429, 503})
POLITE_RETRY_BUDGET = 6
NAIVE_RETRY_BUDGET = 20
DEFAULT_BACKOFF_S = 0.5
CLOSE_TIMEOUT_S = 5.0


class Mode(enum.StrEnum):
    DIRECT = "direct"
    KVGATE_CALL = "kvgate-call"
    KVGATE_SESSION = "kvgate-session"


class CallStatus(enum.StrEnum):
    OK = "ok"
    REFUSED = "refused"
    """Refused after the client's retries (429/503)."""
    FAILED = "failed"
    """Any other error answer, or a broken stream."""
    ABANDONED = "abandoned"
    """In flight when the agent gave up (session deadline, or another call failed)."""
    NOT_SENT = "not_sent"
    """The agent gave up before this call's turn."""


@dataclass
class CallOutcome:
    session_id: str
    call_id: str
    tier: str
    status: CallStatus = CallStatus.NOT_SENT
    sent_s: float | None = None
    """Seconds from the run's start to the first attempt."""
    ttft_s: float | None = None
    tpot_s: float | None = None
    e2e_s: float | None = None
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    """From the final usage; for a call cut short, the content chunks received (a lower
    bound when the server merged tokens into one chunk)."""
    retries: int = 0
    http_status: int | None = None
    code: str | None = None
    queue_wait_s: float | None = None
    """kvgate only: how long the answering attempt waited between its publish and its engine
    start (``X-Kvgate-Queue-Wait-Ms``); the rest of ``ttft_s`` is the front door, the engine
    and the relay."""


@dataclass
class SessionOutcome:
    session_id: str
    tier: str
    client: str
    arrival_s: float
    deadline_s: float
    calls: list[CallOutcome]
    admitted: bool = True
    """False when the session (or, per call, one of its calls) was refused for good."""
    refusal_code: str | None = None
    admission_wait_s: float = 0.0
    """kvgate-session: from arrival until the session was admitted."""
    session_retries: int = 0
    deferrals: int = 0
    """Refused answers to the session's creation, retried or not (a call's own refusals are
    its ``retries``, plus one if it ended refused)."""
    ended_s: float | None = None
    """Seconds from the run's start to the session's end (last call, or giving up)."""
    deadline_missed: bool = False

    @property
    def completed(self) -> bool:
        return all(c.status is CallStatus.OK for c in self.calls) and not self.deadline_missed


@dataclass
class Target:
    mode: Mode
    base_url: str
    model: str = "kvgate-dev"
    api_key: str = "unused"


class Refused(Exception):
    def __init__(self, status: int, code: str | None, retry_after: float | None) -> None:
        super().__init__(f"{status} {code}")
        self.status = status
        self.code = code
        self.retry_after = retry_after


class CallFailed(Exception):
    def __init__(self, status: int | None, code: str | None) -> None:
        super().__init__(f"{status} {code}")
        self.status = status
        self.code = code


@dataclass
class RetryPolicy:
    """How a client of one kind waits after a refusal; None means give up."""

    kind: ClientKind
    rng: random.Random
    used: int = 0

    def wait_s(self, retry_after: float | None, remaining_s: float) -> float | None:
        budget = POLITE_RETRY_BUDGET if self.kind is ClientKind.POLITE else NAIVE_RETRY_BUDGET
        if self.used >= budget:
            return None
        if self.kind is ClientKind.NAIVE:
            wait = 0.0
        else:
            base = retry_after if retry_after is not None else DEFAULT_BACKOFF_S * 2**self.used
            wait = base * self.rng.uniform(0.8, 1.2)
        if wait >= remaining_s:
            return None  # an honest Retry-After past the deadline: no point waiting
        self.used += 1
        return wait


def prompt_text(call: CallSpec, words: list[str]) -> str:
    """About ``prompt_tokens`` tokens of text, different for every call (no shared prefix for
    the engine's prefix cache to reuse between calls)."""
    rng = random.Random(call.call_id)
    return " ".join(rng.choice(words) for _ in range(max(1, call.prompt_tokens - 8)))


@dataclass
class Agent:
    """Runs sessions against one target from one HTTP connection pool."""

    target: Target
    http: aiohttp.ClientSession
    words: list[str]
    started: float = field(default_factory=time.monotonic)
    _openai: AsyncOpenAI | None = None

    def now(self) -> float:
        return time.monotonic() - self.started

    def _sessions_client(self) -> AsyncOpenAI:
        """The ``openai`` client polite agents open their sessions with (one connection pool
        for all the agent's sessions, as an agent process would have)."""
        if self._openai is None:
            # No retries of its own (kvgate_session retries the opening) and, as this module's
            # own requests, no timeout: the session's deadline bounds the opening, and
            # kvgate_session bounds the close (close_timeout_s).
            self._openai = AsyncOpenAI(
                base_url=self.target.base_url + "/v1",
                api_key=self.target.api_key,
                max_retries=0,
                timeout=None,
            )
        return self._openai

    async def aclose(self) -> None:
        if self._openai is not None:
            await self._openai.close()

    async def run(self, trace: SessionTrace) -> SessionOutcome:
        outcome = SessionOutcome(
            session_id=trace.session_id,
            tier=trace.tier.value,
            client=trace.client.value,
            arrival_s=trace.arrival_s,
            deadline_s=trace.deadline_s,
            calls=[CallOutcome(trace.session_id, c.call_id, trace.tier.value) for c in trace.calls],
        )
        deadline = self.started + trace.arrival_s + trace.deadline_s
        retry = RetryPolicy(trace.client, random.Random(f"retry:{trace.session_id}"))
        # Outside the deadline's timeout: a session is closed after its calls, and a close that
        # ends past the deadline does not make a finished session a missed one.
        async with contextlib.AsyncExitStack() as closing:
            try:
                async with asyncio.timeout(deadline - time.monotonic()):
                    session_id = None
                    if self.target.mode is Mode.KVGATE_SESSION:
                        session_id = await self._open_session(
                            trace, outcome, retry, deadline, closing
                        )
                        if session_id is None:
                            return outcome
                    await self._turns(trace, outcome, retry, deadline, session_id)
            except TimeoutError:
                outcome.deadline_missed = True
            finally:
                for call in outcome.calls:
                    if call.status is CallStatus.NOT_SENT and call.sent_s is not None:
                        call.status = CallStatus.ABANDONED
                outcome.ended_s = self.now()
        return outcome

    async def _turns(
        self,
        trace: SessionTrace,
        outcome: SessionOutcome,
        retry: RetryPolicy,
        deadline: float,
        session_id: str | None,
    ) -> None:
        by_id = {c.call_id: c for c in outcome.calls}
        for turn in trace.turns:
            if turn.think_s:
                await asyncio.sleep(turn.think_s)
            failure: Refused | CallFailed | None = None
            try:
                async with asyncio.TaskGroup() as group:
                    for spec in turn.calls:
                        call = self._call(
                            trace, spec, by_id[spec.call_id], retry, deadline, session_id
                        )
                        group.create_task(call)
            except* (Refused, CallFailed) as failures:
                first = failures.exceptions[0]
                assert isinstance(first, Refused | CallFailed)
                failure = first
            if isinstance(failure, Refused):
                outcome.admitted = False
                outcome.refusal_code = failure.code
            if failure is not None:
                return  # the task failed: the agent gives up on the session

    async def _call(
        self,
        trace: SessionTrace,
        spec: CallSpec,
        out: CallOutcome,
        retry: RetryPolicy,
        deadline: float,
        session_id: str | None,
    ) -> None:
        if spec.offset_s:
            await asyncio.sleep(spec.offset_s)
        out.sent_s = self.now()
        first_attempt = time.monotonic()
        while True:
            try:
                await self._stream(trace, spec, out, first_attempt, deadline, session_id)
                out.status = CallStatus.OK
                return
            except Refused as refused:
                out.http_status, out.code = refused.status, refused.code
                wait = retry.wait_s(refused.retry_after, deadline - time.monotonic())
                if wait is None:
                    out.status = CallStatus.REFUSED
                    raise
                out.retries += 1
                await asyncio.sleep(wait)
            except CallFailed as failed:
                out.status = CallStatus.FAILED
                out.http_status, out.code = failed.status, failed.code
                raise
            except aiohttp.ClientError as exc:
                out.status = CallStatus.FAILED
                out.code = type(exc).__name__
                raise CallFailed(None, out.code) from exc

    def _body(self, trace: SessionTrace, spec: CallSpec) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.target.model,
            "messages": [{"role": "user", "content": prompt_text(spec, self.words)}],
            "max_tokens": spec.output_tokens,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.target.mode is Mode.DIRECT:
            body["priority"] = trace.tier.priority
        return body

    def _headers(
        self, trace: SessionTrace, deadline: float, session_id: str | None
    ) -> dict[str, str]:
        headers = {"Authorization": f"Bearer {self.target.api_key}"}
        if self.target.mode is Mode.DIRECT:
            return headers
        remaining = max(0.001, deadline - time.monotonic())
        headers["X-Kvgate-Timeout"] = f"{remaining:.3f}"
        if session_id is not None:
            headers["X-Kvgate-Session"] = session_id
        else:
            headers["X-Kvgate-Tier"] = trace.tier.value
        return headers

    async def _stream(
        self,
        trace: SessionTrace,
        spec: CallSpec,
        out: CallOutcome,
        first_attempt: float,
        deadline: float,
        session_id: str | None,
    ) -> None:
        url = self.target.base_url + "/v1/chat/completions"
        async with self.http.post(
            url,
            json=self._body(trace, spec),
            headers=self._headers(trace, deadline, session_id),
        ) as resp:
            if resp.status != 200:
                code, retry_after = await _error_of(resp)
                if resp.status in REFUSED_STATUSES:
                    raise Refused(resp.status, code, retry_after)
                raise CallFailed(resp.status, code)
            out.http_status = 200
            queue_wait_ms = resp.headers.get("X-Kvgate-Queue-Wait-Ms")
            if queue_wait_ms is not None:
                out.queue_wait_s = int(queue_wait_ms) / 1000
            first_token: float | None = None
            last_token: float | None = None
            chunks = 0
            usage: dict[str, Any] | None = None
            finished = False
            buffer = b""
            async for data in resp.content.iter_any():
                buffer += data
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if not line.startswith(b"data: "):
                        continue
                    payload = line[6:].strip()
                    if payload == b"[DONE]":
                        finished = True
                        continue
                    event = json.loads(payload)
                    if "error" in event:
                        error = event["error"]
                        raise CallFailed(
                            200, error.get("code") if isinstance(error, dict) else None
                        )
                    if event.get("usage"):
                        usage = event["usage"]
                    for choice in event.get("choices") or ():
                        if (choice.get("delta") or {}).get("content"):
                            now = time.monotonic()
                            if first_token is None:
                                first_token = now
                                out.ttft_s = now - first_attempt
                            last_token = now
                            chunks += 1
                            out.completion_tokens = chunks
            if not finished or usage is None:
                raise CallFailed(200, "stream_ended_early")
            out.prompt_tokens = int(usage.get("prompt_tokens") or 0)
            out.completion_tokens = int(usage.get("completion_tokens") or 0)
            out.e2e_s = time.monotonic() - first_attempt
            if first_token is not None and last_token is not None and out.completion_tokens > 1:
                out.tpot_s = (last_token - first_token) / (out.completion_tokens - 1)

    async def _open_session(
        self,
        trace: SessionTrace,
        outcome: SessionOutcome,
        retry: RetryPolicy,
        deadline: float,
        closing: contextlib.AsyncExitStack,
    ) -> str | None:
        """The session's id once admitted, its close put on ``closing``; None if refused."""
        if trace.client is ClientKind.POLITE:
            return await self._open_politely(trace, outcome, retry, deadline, closing)
        session_id = await self._open_at_once(trace, outcome, retry, deadline)
        if session_id is not None:
            closing.push_async_callback(self._close_session, session_id)
        return session_id

    async def _open_politely(
        self,
        trace: SessionTrace,
        outcome: SessionOutcome,
        retry: RetryPolicy,
        deadline: float,
        closing: contextlib.AsyncExitStack,
    ) -> str | None:
        """A polite agent opens (and closes) its session with kvgate's client."""
        opening = kvgate_session(
            self._sessions_client(),
            deadline_s=deadline - time.monotonic(),
            retry_budget=POLITE_RETRY_BUDGET,
            rng=random.Random(f"open:{trace.session_id}"),
            close_timeout_s=CLOSE_TIMEOUT_S,
            **_declared(trace),
        )
        try:
            session = await closing.enter_async_context(opening)
        except SessionNotOpened as refused:
            outcome.deferrals = refused.refusals
            outcome.session_retries = refused.attempts - 1
            outcome.admitted = False
            outcome.refusal_code = refused.code or refused.why.value
            return None
        except APIStatusError as error:  # an answer but no refusal (a 400): not retried
            outcome.deferrals += 1
            outcome.admitted = False
            outcome.refusal_code = error.code if isinstance(error.code, str) else None
            return None
        outcome.admission_wait_s = self.now() - trace.arrival_s
        outcome.deferrals = session.refusals
        outcome.session_retries = session.attempts - 1
        retry.used = session.attempts - 1  # one retry budget for the session, as before
        return session.id

    async def _open_at_once(
        self,
        trace: SessionTrace,
        outcome: SessionOutcome,
        retry: RetryPolicy,
        deadline: float,
    ) -> str | None:
        """A naive agent's opening: no kvgate client, retried at once."""
        url = self.target.base_url + "/v1/sessions"
        while True:
            remaining = deadline - time.monotonic()
            body = {**_declared(trace), "deadline_s": round(max(remaining, 0.001), 3)}
            headers = {"Authorization": f"Bearer {self.target.api_key}"}
            async with self.http.post(url, json=body, headers=headers) as resp:
                if resp.status in (200, 201):
                    outcome.admission_wait_s = self.now() - trace.arrival_s
                    return str((await resp.json())["id"])
                code, retry_after = await _error_of(resp)
            outcome.deferrals += 1
            wait = retry.wait_s(retry_after, deadline - time.monotonic())
            if resp.status not in REFUSED_STATUSES or wait is None:
                outcome.admitted = False
                outcome.refusal_code = code
                return None
            outcome.session_retries += 1
            await asyncio.sleep(wait)

    async def _close_session(self, session_id: str) -> None:
        url = f"{self.target.base_url}/v1/sessions/{session_id}"
        headers = {"Authorization": f"Bearer {self.target.api_key}"}
        timeout = aiohttp.ClientTimeout(CLOSE_TIMEOUT_S)
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with self.http.delete(url, headers=headers, timeout=timeout):
                pass


async def _error_of(resp: aiohttp.ClientResponse) -> tuple[str | None, float | None]:
    """The error code and Retry-After of a refused or failed answer."""
    header = resp.headers.get("Retry-After")
    retry_after = float(header) if header and header.replace(".", "", 1).isdigit() else None
    try:
        body = await resp.json(content_type=None)
    except (json.JSONDecodeError, aiohttp.ClientError, ValueError):
        return None, retry_after
    error = body.get("error") if isinstance(body, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return (str(code) if code is not None else None), retry_after


def _declared(trace: SessionTrace) -> dict[str, Any]:
    """What a session of ``trace`` declares (its deadline apart, which is what is left of it)."""
    return {
        "tier": trace.tier.value,
        "max_parallel": trace.max_parallel,
        # All or nothing: these agents judge each call's TTFT from its first attempt, so a call
        # waiting for one of a shaped session's slots would count as slow.
        "min_parallel": trace.max_parallel,
        "expected_calls": len(trace.calls),
        "est_prompt_tokens": trace.mean_prompt_tokens,
        "est_output_tokens": trace.mean_output_tokens,
        "idle_timeout_s": 10,
        "metadata": {"trace_session": trace.session_id},
    }
