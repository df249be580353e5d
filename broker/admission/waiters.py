"""The calls on this replica waiting for one of their session's call slots: how many may wait,
who asks the state again, and who is woken when a slot is freed.

A call asks the admission state for a slot; told ``busy``, it waits here, in its session's
queue, until it is woken. Waiting must cost the shared state almost nothing (5,000 calls each
asking Redis 20 times a second once starved every tenant), so:

- A freed slot (a call of the session ended, here or, through the state's release feed, on
  another replica) wakes **one** waiter, the first in the queue: one question to the state per
  freed slot, not one per waiter.
- Only the queue's head asks again on its own (``poll_s``: slowly, with jitter, backing off),
  for the slots nobody announces: a message lost while the feed reconnected, the calls of a
  dead replica that hold their slots until their deadline.
- A session that ended wakes all its waiters (they learn it from the state and leave); a gap
  in the feed (``releases_missed``) wakes every head.

Invariant a reader must not break: a wake is never lost. A call joins its queue *before* its
first question, so a slot freed while it asks is seen when the answer is ``busy``; and a call
that leaves the queue having waited, or holding a wake, passes a wake to the next call, which
is how the next head learns it must now poll and how a second free slot is found.

Bounds: at most ``per_session`` calls of one session and ``total`` calls in all wait on this
replica; a call over either is refused at once (``429 too_many_waiting_calls``) rather than
held: a held call costs a connection, a task and, without the bound, its share of the polls.
"""

from __future__ import annotations

import asyncio
import random
from collections import deque

from broker.errors import TooManyWaitingCalls

POLL_S = 1.0
"""How long the queue's head first waits for a wake before asking the state again."""
POLL_MAX_S = 4.0
"""The head's wait doubles after each question that found the slots still busy, up to this:
the longest a slot freed without a message (a dead replica's call reaching its deadline) goes
unseen."""
POLL_JITTER = 0.25
"""Each wait is drawn within this fraction of its length, so that heads that began together
(a burst) do not ask together."""


class SlotWaiter:
    """One call asking for a slot. ``woken`` is set when it should ask the state again."""

    __slots__ = ("poll_s", "session_id", "waiting", "woken")

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.woken = asyncio.Event()
        self.waiting = False
        """Told ``busy`` at least once: counted against the bounds."""
        self.poll_s = POLL_S
        """The head's next wait before it asks again: doubles while it asks in vain."""


class SlotWaiters:
    def __init__(self, per_session: int, total: int, rng: random.Random | None = None) -> None:
        self.per_session = per_session
        self.total = total
        self._rng = rng or random.Random()
        self._queues: dict[str, deque[SlotWaiter]] = {}
        self._waiting_in: dict[str, int] = {}
        self._waiting = 0

    @property
    def waiting(self) -> int:
        """Calls on this replica waiting for a slot now."""
        return self._waiting

    def join(self, session_id: str) -> SlotWaiter:
        """Queue a call before it first asks for a slot; it must ``leave`` in all cases."""
        waiter = SlotWaiter(session_id)
        self._queues.setdefault(session_id, deque()).append(waiter)
        return waiter

    def wait(self, waiter: SlotWaiter) -> None:
        """The call was told ``busy``: count it as waiting, or raise ``TooManyWaitingCalls``
        (it must still ``leave``)."""
        if waiter.waiting:
            return
        session_waiting = self._waiting_in.get(waiter.session_id, 0)
        if session_waiting >= self.per_session:
            raise TooManyWaitingCalls(
                f"{session_waiting} calls of session {waiter.session_id} already wait for one "
                "of its call slots on this front door; send fewer calls at once, or ask for a "
                "higher max_parallel"
            )
        if self._waiting >= self.total:
            raise TooManyWaitingCalls(
                f"{self._waiting} calls already wait for a call slot on this front door"
            )
        waiter.waiting = True
        self._waiting_in[waiter.session_id] = session_waiting + 1
        self._waiting += 1

    def timeout_s(self, waiter: SlotWaiter) -> float | None:
        """How long ``waiter`` waits for a wake before asking again by itself: ``None`` (until
        woken) unless it is its session's head."""
        if self._head(waiter.session_id) is not waiter:
            waiter.poll_s = POLL_S
            return None
        wait_s = waiter.poll_s
        waiter.poll_s = min(wait_s * 2, POLL_MAX_S)
        return wait_s * self._rng.uniform(1 - POLL_JITTER, 1 + POLL_JITTER)

    def leave(self, waiter: SlotWaiter) -> None:
        """The call got its slot, or gave up, or was refused. One that waited or holds a wake
        passes a wake on: the next head must start polling, and another slot may be free."""
        queue = self._queues.get(waiter.session_id)
        if queue is None or waiter not in queue:
            return
        queue.remove(waiter)
        if waiter.waiting:
            self._waiting -= 1
            left = self._waiting_in[waiter.session_id] - 1
            if left:
                self._waiting_in[waiter.session_id] = left
            else:
                del self._waiting_in[waiter.session_id]
        if not queue:
            del self._queues[waiter.session_id]
        elif waiter.waiting or waiter.woken.is_set():
            self.call_ended(waiter.session_id)

    def call_ended(self, session_id: str) -> None:
        """One of the session's slots was freed: wake the first call not woken yet."""
        for waiter in self._queues.get(session_id, ()):
            if not waiter.woken.is_set():
                waiter.poll_s = POLL_S
                waiter.woken.set()
                return

    def session_ended(self, session_id: str) -> None:
        """The session was closed or expired: every waiter asks again, and leaves."""
        for waiter in self._queues.get(session_id, ()):
            waiter.woken.set()

    def releases_missed(self) -> None:
        """Releases may have gone unannounced (the feed broke off): every head asks again."""
        for session_id in self._queues:
            self.call_ended(session_id)

    def _head(self, session_id: str) -> SlotWaiter | None:
        for waiter in self._queues.get(session_id, ()):
            if waiter.waiting:
                return waiter
        return None
