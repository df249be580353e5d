"""Settling a delivered call with JetStream for good, confirmed: ack (answered) or term (never
to run again).

A plain ack (nats.py's ``ack()``, ``term()``) is a publish that nobody answers. Sent while the
consumer has no leader (its server killed, the survivors of a cluster electing a new one) it
is lost, and the call is delivered again after the ack wait: run a second time, its caller
long answered (seen in tests/test_chaos_cluster.py: 8 of 1,460 calls ended twice when a NATS
server was killed). So the final word on a call is a request the server answers once it has
applied it, sent again until it does, within a bound; past it, the call's fate is the
redelivery's, as for a worker that died. A hand-back (``nak``) is not confirmed: if it is
lost, the call comes back after the ack wait all the same.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time

import nats.errors
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

log = logging.getLogger(__name__)

_TRY_S = 1.0
"""How long one attempt waits for the server's answer: a leader answers in milliseconds."""
_PAUSE_S = 0.25
"""Between attempts: an election takes seconds, a reconnect up to two."""


class Settle(enum.Enum):
    ACK = b"+ACK"
    TERM = b"+TERM"


async def settle(nc: NATS, msg: Msg, how: Settle, *, bound_s: float) -> bool:
    """Send ``how`` for ``msg`` until the server confirms it, for at most ``bound_s``
    (best set to the ack wait: after it, the call is redelivered whatever this does).
    Whether it was confirmed; never raises for NATS being away."""
    if not msg.reply:
        raise ValueError("not a JetStream message: it has no reply subject to settle it on")
    give_up = time.monotonic() + bound_s
    attempts = 0
    while True:
        attempts += 1
        try:
            await nc.request(msg.reply, how.value, timeout=_TRY_S)
        except (
            nats.errors.TimeoutError,
            nats.errors.NoRespondersError,
            nats.errors.ConnectionReconnectingError,
        ) as exc:
            if time.monotonic() + _PAUSE_S >= give_up:
                log.warning(
                    "%s of a call not confirmed in %d attempts (%r): it will be redelivered",
                    how.name,
                    attempts,
                    exc,
                )
                return False
            await asyncio.sleep(_PAUSE_S)
            continue
        if attempts > 1:
            log.info("%s of a call confirmed at attempt %d", how.name, attempts)
        return True
