"""Settings of the front door and the stream layout both sides share, read from ``KVGATE_*``
environment variables (a worker's own are ``workers.settings``).

Built by the process entry points (``kvgate api``, ``kvgate worker``), never at import time, so
tests can build as many differently configured instances as they need.
"""

from __future__ import annotations

import ipaddress
import re
from pathlib import Path
from typing import Annotated, Self

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from broker.natsconn import NatsClientSettings
from schemas.vocab import Tier

# kvgate's development NATS port. Not 4222, so that `kvgate nats` never collides with a NATS
# server a developer already runs on the standard port.
DEFAULT_NATS_PORT = 4333

_USERINFO = re.compile(r"(^|//|,)[^/,]*@")


def is_loopback(host: str) -> bool:
    """Whether a bind address reaches this machine only. A name other than ``localhost`` is not
    resolved here, so it counts as reachable from the network."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def redacted_url(url: str) -> str:
    """``url`` fit for a log line, an error or a status page: any user, password or token in
    it (``nats://user:pass@host``, ``nats://token@host``) shown as ``***``; in a
    comma-separated list of servers, in each one."""
    return _USERINFO.sub(r"\1***@", url)


class StreamSettings(BaseSettings):
    """JetStream layout. Changing these on a live stream updates it at the next start-up."""

    model_config = SettingsConfigDict(env_prefix="KVGATE_STREAM_", extra="ignore")

    # Copies of every stream, consumer and the workers bucket on a NATS cluster: 1 for a single
    # server (development), 3 in production (one server may be lost, or restarted for an
    # upgrade, without losing a queued call or stopping the queue). Raised on a live R1 layout,
    # the next start-up scales it in place (broker/streams.py); the cluster needs at least as
    # many JetStream servers.
    replicas: int = Field(default=1, ge=1, le=5)
    # Where the cluster places the streams: only on servers carrying every one of these tags
    # (``server_tags`` in their configuration, such as ``az:eu-1a``), and in this cluster of a
    # super-cluster. Empty: anywhere.
    placement_tags: Annotated[list[str], NoDecode] = Field(default_factory=list)
    placement_cluster: str | None = None
    max_msgs: int = Field(default=100_000, ge=1)
    max_bytes: int = Field(default=1 << 30, ge=1 << 20)
    # Long enough for one in-progress heartbeat interval of the worker; workers refresh it
    # while generating, so a dead worker's calls come back after at most this long.
    ack_wait_s: float = Field(default=30.0, gt=0)
    max_deliver: int = Field(default=3, ge=1)
    max_ack_pending: int = Field(default=10_000, ge=1)
    # Pull requests a tier's consumer holds waiting at once, from every worker serving its model
    # (each keeps one or a few open per tier). The server's default, 512, refused the pulls of a
    # fleet past ~400 workers of one model (docs/scale.md). Set when the consumer is made: the
    # server will not change it on an existing one (broker/streams.py).
    max_waiting_pulls: int = Field(default=4096, ge=1)
    duplicate_window_s: float = Field(default=120.0, gt=0)
    # A worker's heartbeat entry expires this long after its last put, so a dead worker
    # leaves the fleet view on its own.
    worker_ttl_s: float = Field(default=10.0, ge=1.0)

    @field_validator("placement_tags", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        """``KVGATE_STREAM_PLACEMENT_TAGS=az:eu-1a,ssd``, as operators write lists."""
        if isinstance(value, str):
            return [tag.strip() for tag in value.split(",") if tag.strip()]
        return value


class ApiSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KVGATE_", extra="ignore")

    nats_url: str = f"nats://127.0.0.1:{DEFAULT_NATS_PORT}"
    host: str = "127.0.0.1"
    port: int = 8000
    # The model this front door expects even before any of its workers is up: calls to it
    # are deferred (503 no_workers), not refused as unknown. Every model a worker advertises
    # in its heartbeat is served too, each on its own queue.
    served_model_name: str = "kvgate-dev"
    default_tier: Tier = Tier.STANDARD
    default_deadline_s: float = Field(default=120.0, gt=0)
    max_deadline_s: float = Field(default=3600.0, gt=0)
    default_max_tokens: int = Field(default=256, ge=1)
    max_tokens_limit: int = Field(default=8192, ge=1)
    max_body_bytes: int = Field(default=1 << 20, ge=1024)
    # After the first event of a call, the longest silence tolerated from its worker.
    stream_idle_timeout_s: float = Field(default=60.0, gt=0)
    # A streaming client that takes none of what was sent to it for this long is cut off, and
    # its call cancelled (api/streaming.py): it would otherwise hold its task, its buffer and
    # its call's output for as long as the socket stays open.
    stream_send_timeout_s: float = Field(default=30.0, gt=0)
    # Connections (and requests in flight) one front door holds at once; beyond, uvicorn answers
    # 503 at once rather than taking on work it has no memory for. Each streaming call holds one
    # for its whole length.
    max_connections: int = Field(default=8192, ge=1)
    # How long an idle connection stays open after its last answer. Longer than clients keep
    # theirs (httpx, under OpenAI's SDK: 5 s; aiohttp: 15 s), so that a client never sends a
    # request on a connection the server is closing at that instant: uvicorn's own default, 5 s,
    # is httpx's, and that race loses the request (the connection resets under a POST, which a
    # client that does not retry by itself reports as a failed call). Idle connections count
    # toward `max_connections`.
    keep_alive_s: int = Field(default=75, ge=1)
    # A request's head (request line and headers) past this is refused, 431, and its connection
    # closed (api/http.py): the bytes a client sends before its headers end are held in memory.
    max_head_bytes: int = Field(default=64 << 10, ge=4096)
    # Health probes (/healthz, /readyz) in uvicorn's access log: off by default, as a load
    # balancer or `kvgate up` asks several times a second (api/routes/health.py).
    access_log_probes: bool = False
    heartbeat_max_age_s: float = Field(default=6.0, gt=0)
    # Bearer token for /v1/admin/*; not a tenant key. Unset: admin endpoints answer 401.
    admin_token: str | None = None
    # How often the dashboard (/dashboard, api/dashboard.py) samples what the front door keeps
    # current; it keeps an hour of samples in memory (1,800 at 2 s).
    dashboard_sample_s: float = Field(default=2.0, ge=0.25, le=60)
    # Admission. No tenants file: one open development tenant whose highest tier is
    # `dev_tenant_tier`. No Redis URL: in-process admission state (one replica only).
    tenants_file: Path | None = None
    dev_tenant_tier: Tier = Tier.STANDARD
    # Without a tenants file, a front door bound to any address but loopback would let anyone
    # on the network in as the development tenant: refused at start-up unless this says so.
    allow_open_network: bool = False
    redis_url: str | None = None
    redis_prefix: str = "{kvgate}"
    # A Redis operation slower than this is "admission state unavailable" (503, or the degraded
    # local budget for `degraded_tiers`): it bounds how long a blackholed Redis stalls callers.
    redis_timeout_s: float = Field(default=0.5, gt=0, le=30)
    # Connections to Redis one front door keeps at most. A decision beyond them waits for one
    # (up to `redis_timeout_s`) rather than failing: each holds a connection for one script.
    redis_max_connections: int = Field(default=64, ge=1, le=10_000)
    database_url: str = "sqlite:///.kvgate/ledger.db"
    ledger_queue: int = Field(default=10_000, ge=1)
    replica_id: str | None = None
    # Reservations may add up to this many times the fleet's KV capacity: above 1, admitted
    # sessions accept waiting in JetStream for their turn at the cache. It is the floor of the
    # learned factor per tier group (broker/admission/objectives.py), which rises towards
    # `admission_kv_overcommit_max` while admitted calls meet their tiers' objectives and falls
    # when they do not; set both equal to turn learning off.
    admission_kv_overcommit: float = Field(default=1.0, gt=0, le=100)
    admission_kv_overcommit_max: float = Field(default=16.0, gt=0, le=100)
    # The share of admitted sessions whose calls all met their objectives (TTFT and TPOT),
    # estimated as their calls end, that a tier must keep for its window to grow; below it the
    # window shrinks. Above the promised 95%: the windows learn from misses after the fact.
    admission_objective_target: float = Field(default=0.97, gt=0, le=1)
    # A tier's window shrinks only once at least this many of its recent sessions missed: one
    # lone miss is not a trend (broker/admission/objectives.py). 1: any miss below the target.
    admission_objective_min_missed: int = Field(default=2, ge=1)
    # How long `POST /v1/sessions` may hold a session that does not fit now, waiting for room,
    # before it answers 503 with Retry-After; a session may ask for less (`max_wait_s`), and is
    # never held for more than half its deadline.
    admission_max_wait_s: float = Field(default=2.0, ge=0, le=60)
    # A session is admitted only if it could finish within its deadline divided by this at the
    # fastest decode speed the fleet shows (1: only what cannot finish even at best is
    # rejected). 2 was measured in the CPU sweep and refused more without more good sessions.
    admission_deadline_margin: float = Field(default=1.0, ge=1, le=100)
    # Check 4 also predicts a session's duration from how long the sessions this replica admitted
    # recently took (seconds per declared output token of each round of calls, this quantile of
    # them; broker/admission/objectives.SessionPace), so that one admitted with too little of its
    # deadline left is rejected rather than run to a miss. 0 turns it off. 0.7: against 0.9, in
    # four alternating runs of the CPU sweep, as many good sessions at 1x and 4x and more at 2x
    # (3.6-4.1/s against 3.3-3.5), admitted sessions 98-100% good (loadtests/results/pace-q).
    admission_pace_quantile: float = Field(default=0.7, ge=0, le=1)
    # Redis down: these tiers are admitted against a local budget of `degraded_share` of the
    # fleet (set it to 1/replicas so replicas together cannot over-admit); others are refused.
    degraded_tiers: list[Tier] = Field(default_factory=lambda: [Tier.GUARANTEED])
    degraded_share: float = Field(default=0.5, gt=0, le=1)
    session_max_parallel: int = Field(default=256, ge=1)
    # Calls beyond a session's `max_parallel` wait on the front door for one of its slots; at
    # most this many per session on one front door (an agent's fan-out of 10-50 calls sent at
    # once, with room), and `max_waiting_calls` of all sessions together. A call over either
    # is refused at once, 429 `too_many_waiting_calls` with Retry-After, rather than held:
    # each waiting call holds a connection and a task. 0: no call waits.
    session_max_waiting_calls: int = Field(default=64, ge=0)
    max_waiting_calls: int = Field(default=2_000, ge=0)
    session_default_idle_timeout_s: float = Field(default=60.0, gt=0)
    # An ended session's record is kept this long (a late call on it is then 409/410, not 404),
    # in Redis or this process, whoever ended it: every record costs memory there until then.
    session_retention_s: float = Field(default=600.0, gt=0)
    # A session's calls in flight may weigh at most this many times its reservation (each call:
    # its prompt plus its output at the session's estimate; broker/admission/state.CallCharge).
    # Above 1 because declarations are means: a late turn's prompt is longer than the mean.
    # A call beyond it waits for one of the session's calls to end; one that alone is beyond
    # it is refused, 400 `call_exceeds_session`.
    session_overrun: float = Field(default=2.0, ge=1)
    session_default_prompt_tokens: int = Field(default=512, ge=1)
    session_default_output_tokens: int = Field(default=256, ge=1)
    # Batches: how often the runner looks for work to start, and how long a front door may be
    # silent before another takes over the batches it was running.
    # Off: this front door accepts and serves batches but leaves running them and collecting
    # their results to the other front doors on the same database.
    batch_runner: bool = True
    batch_tick_s: float = Field(default=0.5, gt=0)
    batch_runner_stale_s: float = Field(default=30.0, gt=0)
    batch_max_lines: int = Field(default=50_000, ge=1)
    # Batches of one tenant not yet ended (in progress or cancelling) at once; one more is
    # refused, 429 `too_many_open_batches`.
    batch_max_open: int = Field(default=100, ge=1)
    # How long an ended batch, its lines and results are kept; uploaded files are kept as
    # long, and then until no batch kept names them. Swept by the batch runner.
    batch_retention_s: float = Field(default=7 * 24 * 3600.0, gt=0)
    # Lines a results or output file download reads from the database at a time.
    batch_page_lines: int = Field(default=1000, ge=1)
    stream: StreamSettings = Field(default_factory=StreamSettings)
    nats: NatsClientSettings = Field(default_factory=NatsClientSettings)

    @model_validator(mode="after")
    def _closed_unless_meant(self) -> Self:
        if self.tenants_file is None and not self.allow_open_network and not is_loopback(self.host):
            raise ValueError(
                f"host {self.host!r} is reachable from the network and no tenants file is set"
                " (KVGATE_TENANTS_FILE), so every caller would be the open development tenant:"
                " set a tenants file, bind to 127.0.0.1, or set KVGATE_ALLOW_OPEN_NETWORK=true"
                " if an open front door is meant"
            )
        return self
