"""One tier's pull credit at the server, on the consumer of the model this worker serves: raw
JetStream pull requests that stay open.

nats.py's ``fetch(n)`` returns only when ``n`` messages arrived or its timeout ran out, so a
call that arrives alone waits for the timeout. This class sends the pull request itself and
hands every message over the moment it arrives, keeping count of the credit still open.

A request the consumer refuses because it holds as many waiting requests as it may
(``409 Exceeded MaxWaiting``: a fleet larger than the consumer's ``max_waiting``) is not sent
again at once: the worker would ask again the moment it learned of the refusal, and a fleet
past the limit spent the servers' CPU on some 12,000 refused requests a second (docs/scale.md).
The tier asks again after a back-off, doubled on each refusal in a row, with jitter so that
the refused workers do not come back together.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from schemas.vocab import Tier
from schemas.wire import STREAM_NAME, consumer_name

_STATUS_HEARTBEAT = "100"
_STATUS_NO_MESSAGES = "404"
_STATUS_TIMEOUT = "408"
_STATUS_CONFLICT = "409"
_HOLD_FIRST_S = 0.5
_HOLD_MAX_S = 8.0


@dataclass(slots=True)
class _PullRequest:
    remaining: int
    expires_at: float


class TierPuller:
    def __init__(
        self,
        nc: NATS,
        tier: Tier,
        model: str,
        on_message: Callable[[Tier, Msg], None],
        on_change: Callable[[], None],
        *,
        expires_s: float,
    ) -> None:
        self.tier = tier
        self._nc = nc
        self._on_message = on_message
        self._on_change = on_change
        self._expires_s = expires_s
        consumer = consumer_name(tier, model)
        self._next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{STREAM_NAME}.{consumer}"
        self._requests: deque[_PullRequest] = deque()
        self._sub: Subscription | None = None
        self._inbox = ""
        self.backlog = 0
        self.refused = 0
        """Requests refused for the consumer's ``max_waiting``, since the start."""
        self._held_until = 0.0
        self._hold_s = _HOLD_FIRST_S

    @property
    def outstanding(self) -> int:
        return sum(r.remaining for r in self._requests)

    async def start(self) -> None:
        self._inbox = self._nc.new_inbox()
        self._sub = await self._nc.subscribe(self._inbox, cb=self._receive)

    async def stop(self) -> None:
        """Withdraw interest: the server skips pull requests whose reply subject has none, so
        no call is delivered here after this returns."""
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
            await self._nc.flush()
        self._requests.clear()

    async def request(self, n: int) -> None:
        """Open ``n`` more credit; nothing while the tier is held back after a refusal (the
        tier's ``on_change`` is called when the hold ends)."""
        now = time.monotonic()
        if now < self._held_until:
            return
        body = {"batch": n, "expires": int(self._expires_s * 1e9)}
        self._requests.append(_PullRequest(n, now + self._expires_s))
        await self._nc.publish(self._next_subject, json.dumps(body).encode(), reply=self._inbox)

    def sweep(self, now: float) -> None:
        """Forget requests the server should have expired by now (their 408 may have been lost
        in a reconnect); credit that is not really open would starve the worker."""
        while self._requests and self._requests[0].expires_at + 1.0 < now:
            self._requests.popleft()

    async def _receive(self, msg: Msg) -> None:
        status = msg.headers.get("Status") if msg.headers else None
        if status is None:
            self._hold_s = _HOLD_FIRST_S
            if self._requests:
                head = self._requests[0]
                head.remaining -= 1
                if head.remaining <= 0:
                    self._requests.popleft()
            self.backlog = int(msg.metadata.num_pending or 0)
            self._on_message(self.tier, msg)
            return
        if status == _STATUS_HEARTBEAT:
            return
        if status in (_STATUS_TIMEOUT, _STATUS_NO_MESSAGES):
            # The oldest open request expired. Requests end in the order they were sent,
            # because they all carry the same expiry.
            self._hold_s = _HOLD_FIRST_S  # it had been let in
            if self._requests:
                self._requests.popleft()
        elif status == _STATUS_CONFLICT:
            description = (msg.headers or {}).get("Description", "")
            if "MaxWaiting" in description:
                if self._requests:
                    self._requests.pop()  # the request just sent was refused
                self._hold()
            else:
                # "Consumer Deleted", "Leadership Change", ...: nothing open survives.
                self._requests.clear()
        self.backlog = 0
        self._on_change()

    def _hold(self) -> None:
        self.refused += 1
        delay = self._hold_s * random.uniform(0.5, 1.5)
        self._hold_s = min(self._hold_s * 2, _HOLD_MAX_S)
        self._held_until = time.monotonic() + delay
        asyncio.get_running_loop().call_later(delay, self._on_change)
