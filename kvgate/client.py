"""kvgate's client for agents: a session around the official ``openai`` client.

::

    from openai import OpenAI
    from kvgate.client import kvgate_session

    client = OpenAI(base_url="http://localhost:8000/v1", api_key="...")
    with kvgate_session(client, tier="standard", max_parallel=8, expected_calls=24) as s:
        s.chat.completions.create(model="...", messages=[...])

``async with kvgate_session(AsyncOpenAI(...), ...) as s`` is the same under asyncio.

What it does that an agent would otherwise write by hand:

- It opens the session (``POST /v1/sessions``) with one ``Idempotency-Key``, so a request
  retried after a lost answer cannot admit the session twice. A refusal that carries
  ``Retry-After`` (kvgate says waiting helps) is tried again after that wait, spread by
  ``jitter`` so that agents refused together do not come back together, while the retry budget
  and the session's deadline allow. It gives up with ``SessionNotOpened``, which says why
  (``GaveUp``), on what answer, after how many attempts and how long.
- Every call made through the session (``s.chat``, ``s.completions``, ... or ``s.client``
  handed to a framework) carries the session header. Calls are retried by the ``openai`` client
  itself (its ``max_retries``), which obeys kvgate's ``x-should-retry`` header: only where
  kvgate says waiting helps, after the ``Retry-After`` it named.
- It closes the session on leaving the block, on an error too. A close that fails is logged,
  not raised (it would hide the block's own error); the session then ends at its idle timeout.

It imports nothing but the standard library and ``openai`` (``tests/test_client.py`` checks):
an agent's process does not need kvgate's server dependencies.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import random
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Generic, TypeVar

from openai import APIConnectionError, APIStatusError, AsyncOpenAI, OpenAI

log = logging.getLogger(__name__)

SESSION_HEADER = "X-Kvgate-Session"
IDEMPOTENCY_HEADER = "Idempotency-Key"
REFUSED_STATUSES = frozenset({429, 503})
"""The statuses of admission's refusals; any other error answer is the caller's to fix, and is
raised as ``openai`` raises it."""
ENDED_STATUSES = frozenset({404, 409, 410})
"""Closing a session that already ended (not found, closed, expired): nothing to give back."""
EXCEEDS_CAPACITY = "exceeds_capacity"
CLOSE_TIMEOUT_S = 10.0
"""How long closing may take: past it the session is left to end at its idle timeout."""
UNREACHABLE_BACKOFF_S = 0.5
"""The first wait after a request that got no answer at all; doubled each time."""

C = TypeVar("C", OpenAI, AsyncOpenAI)


class GaveUp(enum.StrEnum):
    """Why a session was not opened."""

    WAITING_WILL_NOT_HELP = "waiting_will_not_help"
    """kvgate refused without ``Retry-After`` (``deadline_infeasible``), or the session is
    larger than the fleet could ever hold (``exceeds_capacity``: kvgate asks for a minute, in
    case the fleet grows; ``wait_for_fleet_growth=True`` waits)."""
    RETRY_BUDGET_SPENT = "retry_budget_spent"
    PAST_DEADLINE = "past_deadline"
    """The wait kvgate asked for would end after the session's own deadline."""
    UNREACHABLE = "unreachable"
    """No answer at all (connection refused, timeout) for the whole retry budget."""


class SessionNotOpened(Exception):
    """kvgate did not admit the session, and the client stopped trying."""

    def __init__(
        self,
        why: GaveUp,
        *,
        code: str | None,
        status: int | None,
        retry_after: float | None,
        attempts: int,
        refusals: int,
        waited_s: float,
    ) -> None:
        answer = f"{status} {code}" if status is not None else "no answer"
        super().__init__(
            f"session not opened ({why.value}): last answer {answer}, "
            f"after {attempts} attempt(s) and {waited_s:.1f} s"
        )
        self.why = why
        self.code = code
        """kvgate's error code of the last refusal (``tier_capacity``...), None if unreachable."""
        self.status = status
        self.retry_after = retry_after
        self.attempts = attempts
        self.refusals = refusals
        """Attempts kvgate answered with a refusal (the others got no answer)."""
        self.waited_s = waited_s


@dataclass(frozen=True)
class Session(Generic[C]):
    """An admitted session. Attributes of the ``openai`` client (``chat``, ``completions``,
    ``embeddings``, ``with_options`` ...) are read through it."""

    id: str
    tier: str
    max_parallel: int
    """What was granted: fewer than asked where the session did not fit as declared (down to
    its ``min_parallel``). Calls beyond it wait inside kvgate, up to a bound."""
    client: C
    """The caller's client with the session header set on every request: hand it to a
    framework (``OpenAIChatCompletionsModel(openai_client=s.client)``...)."""
    attempts: int
    """Requests it took to open, the admitting one included."""
    refusals: int
    """Attempts before it that kvgate refused (the others got no answer)."""
    waited_s: float
    answer: dict[str, Any] = field(repr=False)
    """kvgate's whole answer (``lease``, ``admission``...)."""

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):  # copy and pickle look for these before `client` is set
            raise AttributeError(name)
        return getattr(self.client, name)


@dataclass
class _Opening:
    """The retry rule of opening, apart from how the requests are sent and the clock."""

    body: dict[str, Any]
    deadline_s: float | None
    retry_budget: int
    jitter: float
    rng: random.Random
    started: float
    wait_for_fleet_growth: bool = False
    attempts: int = 0
    refusals: int = 0

    def request_body(self, now: float) -> dict[str, Any]:
        self.attempts += 1
        body = dict(self.body)
        if self.deadline_s is not None:
            # The deadline counts from entering the block: time spent waiting is spent.
            body["deadline_s"] = round(max(self.deadline_s - (now - self.started), 0.001), 3)
        return body

    def wait_after(self, error: APIStatusError | APIConnectionError, now: float) -> float:
        """Seconds to wait before the next attempt; raises ``SessionNotOpened`` to give up and
        re-raises ``error`` when it is an answer but no refusal."""
        if isinstance(error, APIConnectionError):
            return self._wait_after_silence(error, now)
        if error.status_code not in REFUSED_STATUSES:
            raise error
        self.refusals += 1
        retry_after = _retry_after(error)
        code = error.code if isinstance(error.code, str) else None

        def give_up(why: GaveUp) -> SessionNotOpened:
            return SessionNotOpened(
                why,
                code=code,
                status=error.status_code,
                retry_after=retry_after,
                attempts=self.attempts,
                refusals=self.refusals,
                waited_s=now - self.started,
            )

        if retry_after is None or (code == EXCEEDS_CAPACITY and not self.wait_for_fleet_growth):
            raise give_up(GaveUp.WAITING_WILL_NOT_HELP) from error
        if self.attempts > self.retry_budget:
            raise give_up(GaveUp.RETRY_BUDGET_SPENT) from error
        wait = retry_after * self.rng.uniform(1 - self.jitter, 1 + self.jitter)
        if self.deadline_s is not None and now + wait - self.started >= self.deadline_s:
            raise give_up(GaveUp.PAST_DEADLINE) from error
        log.debug(
            "kvgate deferred the session (%s): attempt %d of %d in %.1f s",
            code,
            self.attempts + 1,
            self.retry_budget + 1,
            wait,
        )
        return wait

    def _wait_after_silence(self, error: APIConnectionError, now: float) -> float:
        if self.attempts > self.retry_budget:
            raise SessionNotOpened(
                GaveUp.UNREACHABLE,
                code=None,
                status=None,
                retry_after=None,
                attempts=self.attempts,
                refusals=self.refusals,
                waited_s=now - self.started,
            ) from error
        base = UNREACHABLE_BACKOFF_S * 2.0 ** (self.attempts - 1)
        return base * self.rng.uniform(1 - self.jitter, 1 + self.jitter)

    def admitted(self, client: C, answer: object, now: float) -> Session[C]:
        if not isinstance(answer, dict) or not isinstance(answer.get("id"), str):
            raise ValueError(f"kvgate's answer to POST /sessions names no session: {answer!r}")
        lease = answer.get("lease") or {}
        return Session(
            id=answer["id"],
            tier=str(answer.get("tier", self.body["tier"])),
            max_parallel=int(lease.get("max_parallel", self.body["max_parallel"])),
            client=client.with_options(default_headers={SESSION_HEADER: answer["id"]}),
            attempts=self.attempts,
            refusals=self.refusals,
            waited_s=now - self.started,
            answer=answer,
        )


def _retry_after(error: APIStatusError) -> float | None:
    value: str | None = error.response.headers.get("retry-after")
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None  # an HTTP date: kvgate never sends one


@contextlib.contextmanager
def _closing_quietly(session_id: str) -> Iterator[None]:
    """A close that fails is logged, never raised: raised from ``__exit__``, it would replace
    the error that ended the block."""
    try:
        yield
    except APIStatusError as error:
        if error.status_code not in ENDED_STATUSES:
            log.warning("could not close kvgate session %s: %s", session_id, error)
    except Exception:
        log.warning("could not close kvgate session %s", session_id, exc_info=True)


class kvgate_session(Generic[C]):  # noqa: N801 - used like contextlib's closing()
    """Opens a kvgate session on entering, closes it on leaving: ``with`` for an ``OpenAI``
    client, ``async with`` for an ``AsyncOpenAI`` one.

    ``deadline_s`` counts from entering the block (each attempt asks for what is left of it);
    the session's other fields are those of ``POST /v1/sessions`` (``extra`` for any other).
    ``retry_budget`` is the number of attempts after the first; ``jitter`` spreads each wait
    over ``Retry-After`` times 1 ± jitter. ``wait_for_fleet_growth``: wait out
    ``exceeds_capacity`` too (kvgate asks for a minute, in case workers join). Closing waits at
    most ``close_timeout_s``, with no retry of its own."""

    def __init__(
        self,
        client: C,
        *,
        tier: str = "standard",
        max_parallel: int = 1,
        min_parallel: int | None = None,
        expected_calls: int | None = None,
        est_prompt_tokens: int | None = None,
        est_output_tokens: int | None = None,
        deadline_s: float | None = None,
        idle_timeout_s: float | None = None,
        max_wait_s: float | None = None,
        metadata: dict[str, str | int | float | bool] | None = None,
        extra: dict[str, Any] | None = None,
        retry_budget: int = 6,
        jitter: float = 0.2,
        rng: random.Random | None = None,
        wait_for_fleet_growth: bool = False,
        close_timeout_s: float = CLOSE_TIMEOUT_S,
    ) -> None:
        if not 0 <= jitter < 1:
            raise ValueError(f"jitter must be in [0, 1), not {jitter}")
        if retry_budget < 0:
            raise ValueError(f"retry_budget must be 0 or more, not {retry_budget}")
        declared: dict[str, Any] = {
            "tier": tier,
            "max_parallel": max_parallel,
            "min_parallel": min_parallel,
            "expected_calls": expected_calls,
            "est_prompt_tokens": est_prompt_tokens,
            "est_output_tokens": est_output_tokens,
            "idle_timeout_s": idle_timeout_s,
            "max_wait_s": max_wait_s,
            "metadata": metadata,
            **(extra or {}),
        }
        self._client: C = client
        self._body = {name: value for name, value in declared.items() if value is not None}
        self._deadline_s = deadline_s
        self._retry_budget = retry_budget
        self._jitter = jitter
        self._rng = rng or random.Random()
        self._wait_for_fleet_growth = wait_for_fleet_growth
        self._close_timeout_s = close_timeout_s
        self._session: Session[C] | None = None

    def _opening(self) -> tuple[_Opening, str]:
        opening = _Opening(
            self._body,
            self._deadline_s,
            self._retry_budget,
            self._jitter,
            self._rng,
            time.monotonic(),
            self._wait_for_fleet_growth,
        )
        return opening, uuid.uuid4().hex

    def __enter__(self) -> Session[C]:
        client = self._client
        if not isinstance(client, OpenAI):
            raise TypeError("an AsyncOpenAI client opens its session with `async with`")
        opening, key = self._opening()
        # Retries are this class's (with jitter, and a reason when it stops), not openai's.
        once = client.with_options(max_retries=0)
        while True:
            try:
                answer = once.post(
                    "/sessions",
                    body=opening.request_body(time.monotonic()),
                    cast_to=object,
                    options={"headers": {IDEMPOTENCY_HEADER: key}},
                )
            except (APIStatusError, APIConnectionError) as error:
                time.sleep(opening.wait_after(error, time.monotonic()))
            else:
                session = opening.admitted(client, answer, time.monotonic())
                self._session = session
                return session

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        session, self._session = self._session, None
        if session is None:
            return
        assert isinstance(session.client, OpenAI)
        closer = session.client.with_options(timeout=self._close_timeout_s, max_retries=0)
        with _closing_quietly(session.id):
            closer.delete(f"/sessions/{session.id}", cast_to=object)

    async def __aenter__(self) -> Session[C]:
        # __enter__ under asyncio: kept apart, as openai keeps OpenAI and AsyncOpenAI apart.
        client = self._client
        if not isinstance(client, AsyncOpenAI):
            raise TypeError("an OpenAI client opens its session with `with`")
        opening, key = self._opening()
        once = client.with_options(max_retries=0)
        while True:
            try:
                answer = await once.post(
                    "/sessions",
                    body=opening.request_body(time.monotonic()),
                    cast_to=object,
                    options={"headers": {IDEMPOTENCY_HEADER: key}},
                )
            except (APIStatusError, APIConnectionError) as error:
                await asyncio.sleep(opening.wait_after(error, time.monotonic()))
            else:
                session = opening.admitted(client, answer, time.monotonic())
                self._session = session
                return session

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        session, self._session = self._session, None
        if session is None:
            return
        assert isinstance(session.client, AsyncOpenAI)
        closer = session.client.with_options(timeout=self._close_timeout_s, max_retries=0)
        with _closing_quietly(session.id):
            # Shielded: a block cancelled by its caller's timeout still gives its room back.
            await asyncio.shield(closer.delete(f"/sessions/{session.id}", cast_to=object))
