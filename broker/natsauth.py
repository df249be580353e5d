"""NATS users, one per role, each allowed only what its role does (issue 14, item 1).

Without users, anyone who reaches NATS could publish straight onto ``kvgate.calls.guaranteed``
past admission, forge results, cancel others' calls or read token streams on ``_INBOX.>``.
With them:

- the **front door** publishes calls (``kvgate.calls.>``) and cancels, and nothing into the
  results stream; it subscribes only to inboxes;
- a **worker** publishes replies (``_INBOX.>``), results (``kvgate.results.>``) and its
  heartbeat (the workers bucket), and neither calls nor cancels; it may create its streams and
  set their configuration (a worker may start first, and provisions what it needs) but not
  delete or purge them, remove their messages or delete consumers;
- a connection without a user is refused.

Both use JetStream's API (``$JS.API.>``) and acknowledge messages (``$JS.ACK.>``). The lists
are allow-lists: a subject a role does not use is refused, whatever a library might try.
``kvgate up`` always runs its embedded NATS with these users, under secrets it makes at start;
``kvgate nats`` does where ``KVGATE_NATS_FRONTDOOR_PASSWORD`` and ``KVGATE_NATS_WORKER_PASSWORD``
are set. An operator's own NATS gets the same blocks from ``kvgate nats --print-config``.
"""

from __future__ import annotations

import enum
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from schemas.wire import (
    CALL_SUBJECT_PREFIX,
    CANCEL_SUBJECT_PREFIX,
    INBOX_PREFIX,
    RESULT_SUBJECT_PREFIX,
    WORKERS_BUCKET,
)

INBOXES = f"{INBOX_PREFIX}>"
"""nats.py's inboxes: replies, token streams, JetStream's answers, probes."""
_JETSTREAM = ("$JS.API.>", "$JS.ACK.>")


class NatsRole(enum.StrEnum):
    FRONT_DOOR = "frontdoor"
    WORKER = "worker"


PERMISSIONS: Mapping[NatsRole, Mapping[str, Any]] = {
    NatsRole.FRONT_DOOR: {
        "publish": {
            "allow": [f"{CALL_SUBJECT_PREFIX}>", f"{CANCEL_SUBJECT_PREFIX}>", INBOXES, *_JETSTREAM]
        },
        "subscribe": {"allow": [INBOXES]},
    },
    NatsRole.WORKER: {
        "publish": {
            "allow": [
                INBOXES,
                f"{RESULT_SUBJECT_PREFIX}>",
                f"$KV.{WORKERS_BUCKET}.>",
                *_JETSTREAM,
            ],
            "deny": [
                "$JS.API.STREAM.DELETE.>",
                "$JS.API.STREAM.PURGE.>",
                "$JS.API.STREAM.MSG.DELETE.>",
                "$JS.API.CONSUMER.DELETE.>",
            ],
        },
        "subscribe": {"allow": [INBOXES, f"{CANCEL_SUBJECT_PREFIX}*"]},
    },
}

PASSWORD_ENV: Mapping[NatsRole, str] = {
    NatsRole.FRONT_DOOR: "KVGATE_NATS_FRONTDOOR_PASSWORD",
    NatsRole.WORKER: "KVGATE_NATS_WORKER_PASSWORD",
}
_URL_SAFE = re.compile(r"^[A-Za-z0-9_.~-]{16,}$")
"""A password goes into a NATS URL as it is (nats.py does not unquote it)."""


@dataclass(frozen=True, slots=True)
class NatsUsers:
    passwords: Mapping[NatsRole, str]

    @classmethod
    def generate(cls) -> NatsUsers:
        """Fresh secrets, for a server and the children started with it (``kvgate up``)."""
        return cls({role: secrets.token_urlsafe(24) for role in NatsRole})

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> NatsUsers | None:
        """The passwords the environment sets; ``None`` where it sets neither. ``ValueError``
        where it sets one without the other, or one that cannot go into a URL as it is."""
        given = {role: environ.get(name) for role, name in PASSWORD_ENV.items()}
        if not any(given.values()):
            return None
        passwords: dict[NatsRole, str] = {}
        for role, password in given.items():
            name = PASSWORD_ENV[role]
            if not password:
                raise ValueError(f"{name} is not set: set both NATS passwords, or neither")
            if not _URL_SAFE.match(password):
                raise ValueError(
                    f"{name} must be at least 16 characters of A-Z a-z 0-9 _ . ~ - (it goes "
                    "into the NATS URL as it is)"
                )
            passwords[role] = password
        return cls(passwords)

    def config(self) -> dict[str, Any]:
        """The ``authorization`` block of a nats-server configuration (JSON is valid there)."""
        users = [
            {"user": role.value, "password": self.passwords[role], "permissions": PERMISSIONS[role]}
            for role in NatsRole
        ]
        return {"authorization": {"users": users}}

    def url(self, base_url: str, role: NatsRole) -> str:
        """``base_url`` with ``role``'s user and password in it."""
        parts = urlsplit(base_url)
        netloc = f"{role.value}:{self.passwords[role]}@{parts.hostname}:{parts.port}"
        return urlunsplit(parts._replace(netloc=netloc))
