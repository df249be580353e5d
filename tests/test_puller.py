"""Raw pull credit against a real JetStream consumer."""

from __future__ import annotations

import asyncio
import time

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from broker.publisher import CallPublisher
from broker.settings import StreamSettings
from broker.streams import provision_calls
from schemas.vocab import Tier
from tests.calls import MODEL, make_call
from tests.polling import poll_until
from workers.puller import TierPuller


async def test_a_call_arrives_at_once_on_open_credit_and_credit_is_counted(nc: NATS) -> None:
    js = nc.jetstream()
    await provision_calls(js, StreamSettings(), MODEL)
    received: list[tuple[float, Msg]] = []
    arrived = asyncio.Event()

    def on_message(tier: Tier, msg: Msg) -> None:
        received.append((time.monotonic(), msg))
        arrived.set()

    puller = TierPuller(nc, Tier.STANDARD, MODEL, on_message, lambda: None, expires_s=30)
    await puller.start()
    await puller.request(3)
    await nc.flush()
    assert puller.outstanding == 3

    published = time.monotonic()
    call = make_call("c1")
    await CallPublisher(js).publish(call, "_INBOX.x", now_ms=call.created_ms)
    await asyncio.wait_for(arrived.wait(), 5)
    # Delivered on the open request, not after the request's 30 s expiry.
    assert received[0][0] - published < 1.0
    assert received[0][1].headers is not None
    assert received[0][1].headers["Kvgate-Call"] == "c1"
    assert puller.outstanding == 2
    await received[0][1].ack()
    await puller.stop()


async def test_expired_requests_release_their_credit(nc: NATS) -> None:
    js = nc.jetstream()
    await provision_calls(js, StreamSettings(), MODEL)
    changed = asyncio.Event()
    puller = TierPuller(nc, Tier.BESTEFFORT, MODEL, lambda t, m: None, changed.set, expires_s=0.3)
    await puller.start()
    await puller.request(4)
    assert puller.outstanding == 4
    await asyncio.wait_for(changed.wait(), 5)
    assert puller.outstanding == 0
    await puller.stop()


async def test_backlog_is_read_from_the_delivered_message(nc: NATS) -> None:
    js = nc.jetstream()
    await provision_calls(js, StreamSettings(), MODEL)
    publisher = CallPublisher(js)
    for i in range(5):
        call = make_call(f"c{i}", tier=Tier.GUARANTEED)
        await publisher.publish(call, "_INBOX.x", now_ms=call.created_ms)
    got: list[Msg] = []
    arrived = asyncio.Event()

    def on_message(tier: Tier, msg: Msg) -> None:
        got.append(msg)
        arrived.set()

    puller = TierPuller(nc, Tier.GUARANTEED, MODEL, on_message, lambda: None, expires_s=5)
    await puller.start()
    await puller.request(1)
    await asyncio.wait_for(arrived.wait(), 5)
    assert len(got) == 1
    assert puller.backlog == 4
    await puller.stop()


async def test_a_tier_refused_for_max_waiting_asks_again_only_after_a_back_off(nc: NATS) -> None:
    """A fleet larger than the consumer's ``max_waiting``: a refused worker asked again the
    moment it heard of the refusal, thousands of times a second across a fleet."""
    js = nc.jetstream()
    await provision_calls(js, StreamSettings(max_waiting_pulls=1), MODEL)
    sent: list[Msg] = []
    next_subject = "$JS.API.CONSUMER.MSG.NEXT.>"

    async def count(msg: Msg) -> None:
        sent.append(msg)

    counter = await nc.subscribe(next_subject, cb=count)
    first = TierPuller(nc, Tier.STANDARD, MODEL, lambda t, m: None, lambda: None, expires_s=30)
    await first.start()
    await first.request(1)
    await nc.flush()

    got: list[Msg] = []
    changed = asyncio.Event()
    second = TierPuller(
        nc, Tier.STANDARD, MODEL, lambda t, m: got.append(m), changed.set, expires_s=30
    )
    await second.start()

    async def intake() -> None:
        # As the worker's intake loop does: whenever told of a change, open what is missing.
        while True:
            if second.outstanding == 0:
                await second.request(1)
            await changed.wait()
            changed.clear()

    loop_task = asyncio.create_task(intake())
    try:
        await asyncio.sleep(2.0)
        assert second.refused >= 1
        # The first request and the second's: one at once, then one per back-off (0.25-0.75 s,
        # then 0.5-1.5 s, ...). Asked again at once, it was hundreds in these 2 s.
        assert len(sent) <= 6, len(sent)
        # Once there is room, the refused tier gets its credit back by itself.
        await first.stop()
        await asyncio.sleep(0)
        call = make_call("after-room")
        await CallPublisher(js).publish(call, "_INBOX.x", now_ms=call.created_ms)

        async def delivered() -> int:
            return len(got)

        await poll_until(delivered, lambda n: n == 1, timeout_s=30)
    finally:
        loop_task.cancel()
        await counter.unsubscribe()
        await second.stop()
