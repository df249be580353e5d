"""kvgate on a three-server NATS JetStream cluster (issue 15): the layout provisioned with
replicas and placement, an R1 layout scaled to R3 in place, and clients that reach the cluster
through any server and follow it when theirs dies, credentials included."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import nats.errors
import pytest
from nats.js import api as js_api
from nats.js.errors import APIError, NoStreamResponseError

from broker import natsconn
from broker.natsauth import NatsRole, NatsUsers
from broker.natsconn import NatsClientSettings, connect_options
from broker.settings import StreamSettings
from broker.streams import provision_calls, provision_results, workers_bucket
from schemas.vocab import TIERS_BY_PRIORITY, Tier
from schemas.wire import RESULTS_STREAM, STREAM_NAME, WORKERS_BUCKET, call_subject, consumer_name
from tests.natscluster import NatsCluster, nats_cluster
from tests.polling import poll_until

MODEL = "kvgate-sim"
SCALE_BOUND_S = 60.0
"""For the servers to bring new replicas up to date (a second alone, here a handful of calls;
generous for a loaded 2-core machine)."""


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    with nats_cluster(tmp_path / "nats", tags={2: ("az:c",)}) as cluster:
        yield cluster


async def replicas_of(cluster: NatsCluster) -> dict[str, int]:
    """Replicas of every stream, consumer and the bucket, as the cluster reports them (the
    leader and its peers: what is actually replicated, not what was asked). 0 for one that
    reports no cluster: while it is scaled, a consumer can answer between two leaders (seen in
    CI), which is "not yet", not a failure."""
    async with cluster.client() as nc:
        js = nc.jetstream(timeout=5)
        found: dict[str, int] = {}
        for stream in (STREAM_NAME, RESULTS_STREAM, f"KV_{WORKERS_BUCKET}"):
            info = await js.stream_info(stream)
            found[stream] = 0 if info.cluster is None else 1 + len(info.cluster.replicas or [])
        for tier in TIERS_BY_PRIORITY:
            name = consumer_name(tier, MODEL)
            placed = (await js.consumer_info(STREAM_NAME, name)).cluster
            found[name] = 0 if placed is None else 1 + len(placed.replicas or [])
        return found


async def provision(cluster: NatsCluster, settings: StreamSettings) -> None:
    """What a worker does at start-up (the front door does a subset of it)."""
    async with cluster.client() as nc:
        js = nc.jetstream(timeout=10)
        await provision_calls(js, settings, MODEL)
        await provision_results(js, settings)
        await workers_bucket(js, settings)


async def test_an_r1_layout_is_scaled_to_three_replicas_in_place_keeping_its_calls(
    cluster: NatsCluster,
) -> None:
    await cluster.wait_ready()
    await provision(cluster, StreamSettings(replicas=1))
    assert set((await replicas_of(cluster)).values()) == {1}
    async with cluster.client() as nc:
        js = nc.jetstream(timeout=5)
        for i in range(5):
            await js.publish(call_subject(Tier.STANDARD, MODEL), f"call {i}".encode())

    # The next start-up with replicas=3 scales everything (the servers copy what is there
    # in the background); once more changes nothing.
    for _ in range(2):
        await provision(cluster, StreamSettings(replicas=3))
        found = await poll_until(
            lambda: replicas_of(cluster),
            lambda found: set(found.values()) == {3},
            timeout_s=SCALE_BOUND_S,
        )
        assert len(found) == 3 + len(TIERS_BY_PRIORITY)

    async with cluster.client() as nc:
        js = nc.jetstream(timeout=5)
        info = await js.stream_info(STREAM_NAME)
        assert info.state.messages == 5
        # Every call is still there to be served, once, by the tier's consumer.
        sub = await js.pull_subscribe_bind(consumer_name(Tier.STANDARD, MODEL), STREAM_NAME)
        got = await sub.fetch(10, timeout=5)
        assert sorted(m.data for m in got) == [f"call {i}".encode() for i in range(5)]
        for m in got:
            await m.ack_sync()


async def test_placement_tags_put_the_streams_on_the_tagged_server(cluster: NatsCluster) -> None:
    await cluster.wait_ready()
    settings = StreamSettings(replicas=1, placement_tags="az:c")  # type: ignore[arg-type]
    assert settings.placement_tags == ["az:c"]
    await provision(cluster, settings)
    for stream in (STREAM_NAME, RESULTS_STREAM):
        assert await cluster.leader(stream) == 2, stream
    # The bucket is created where nats.py puts it, then moved there by the servers.
    bucket = f"KV_{WORKERS_BUCKET}"
    await poll_until(lambda: cluster.leader(bucket), lambda at: at == 2, timeout_s=SCALE_BOUND_S)
    async with cluster.client() as nc:
        config = (await nc.jetstream().stream_info(STREAM_NAME)).config
    assert config.placement == js_api.Placement(tags=["az:c"])


async def test_a_client_given_every_server_follows_the_cluster_when_its_server_dies(
    tmp_path: Path,
) -> None:
    """With users, as production runs: the credentials are in the URL of one server only,
    yet the client reconnects to a server it was never given (discovered from the cluster)."""
    users = NatsUsers.generate()
    with nats_cluster(tmp_path / "nats", users=users) as cluster:
        await cluster.wait_ready()
        first = cluster.url_for(NatsRole.FRONT_DOOR).split(",")[0]
        reconnected = asyncio.Event()

        async def on_reconnect() -> None:
            reconnected.set()

        nc = await natsconn.connect(first, max_reconnect_attempts=-1, reconnected_cb=on_reconnect)
        try:
            js = nc.jetstream(timeout=5)
            await provision_calls(js, StreamSettings(replicas=3))
            assert nc.connected_url is not None
            was = nc.connected_url.port
            serving = next(i for i, n in enumerate(cluster.nodes) if n.port == was)
            cluster.kill(serving)
            await asyncio.wait_for(reconnected.wait(), 30)
            assert nc.connected_url is not None and nc.connected_url.port != was
            # Authenticated there as the front door, it may queue calls again (once the stream
            # has a leader: the killed server may have led it).

            async def publish() -> int:
                try:
                    ack = await js.publish(call_subject(Tier.STANDARD, MODEL), b"after")
                except (nats.errors.Error, NoStreamResponseError, APIError):
                    return 0
                return ack.seq

            assert await poll_until(publish, bool, timeout_s=SCALE_BOUND_S) >= 1
        finally:
            await nc.close()


def test_credentials_in_urls_become_options_for_every_server() -> None:
    settings = NatsClientSettings()
    options = connect_options("nats://u:p%40ss@a:4222, nats://b:4223", settings)
    assert options["servers"] == ["nats://a:4222", "nats://b:4223"]
    assert (options["user"], options["password"]) == ("u", "p@ss")
    token = connect_options("nats://s3cret@a:4222", settings)
    assert token["token"] == "s3cret" and "user" not in token
    with pytest.raises(ValueError, match="different users"):
        connect_options("nats://u:p@a:4222,nats://v:p@b:4222", settings)
    with pytest.raises(ValueError, match="empty server"):
        connect_options("nats://a:4222,,nats://b:4222", settings)
    with_creds = NatsClientSettings(creds_file=Path("/etc/kvgate/nats.creds"))
    assert connect_options("nats://a:4222", with_creds)["user_credentials"] == (
        "/etc/kvgate/nats.creds"
    )
    with pytest.raises(ValueError, match="use one of them"):
        connect_options("nats://u:p@a:4222", with_creds)
    with pytest.raises(ValueError, match="TLS_KEY_FILE"):
        NatsClientSettings(tls_cert_file=Path("/c.pem"))
