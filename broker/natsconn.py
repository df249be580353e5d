"""Connecting to NATS: one server or a cluster, with the credentials and TLS an operator gives.

``KVGATE_NATS_URL`` names one server or several, comma-separated
(``nats://nats-0:4222,nats://nats-1:4222``). nats.py takes them as its server pool, tries them
in turn, and learns the cluster's other servers from their INFO (``discovered servers``), so a
client reconnects to whichever survives.

Credentials written into a URL (``nats://user:pass@host``, ``nats://token@host``) are lifted
out of it and given to nats.py as connection options. nats.py reads a URL's user only when it
connects to that URL, so a discovered server (its URL comes from the cluster, without a user)
would refuse a client whose credentials were in the URL only, and a client that lost its
first server would be locked out of the rest: with the credentials as options, every server
gets them. The same user must then be on every URL that carries one.

The other ways in, ``KVGATE_NATS_*`` (``NatsClientSettings``): a ``.creds`` file (decentralised
JWT auth, as ``nsc`` writes it), and TLS with a CA and a client certificate.
"""

from __future__ import annotations

import ssl
from pathlib import Path
from typing import Any, Self
from urllib.parse import unquote, urlsplit, urlunsplit

import nats
from nats.aio.client import Client as NATS
from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class NatsClientSettings(BaseSettings):
    """How the front door and the workers authenticate to NATS and how fast they notice a
    server gone, besides the URL (``KVGATE_NATS_URL``, kept where it always was)."""

    model_config = SettingsConfigDict(env_prefix="KVGATE_NATS_", extra="ignore")

    creds_file: Path | None = Field(
        default=None, description="a user credentials file (JWT and seed), as nsc writes it"
    )
    tls_ca_file: Path | None = Field(
        default=None, description="CA bundle the servers' certificates are checked against"
    )
    tls_cert_file: Path | None = Field(default=None, description="client certificate (mTLS)")
    tls_key_file: Path | None = Field(default=None, description="the client certificate's key")
    # A server killed outright closes its sockets and is noticed at once; one cut off by the
    # network is noticed only when this many seconds pass twice without an answer to a ping
    # (nats.py's default, 120 s, would leave a worker pulling from nowhere for four minutes).
    ping_interval_s: int = Field(default=10, ge=1, le=600)
    connect_timeout_s: int = Field(default=5, ge=1, le=120)

    @model_validator(mode="after")
    def _certificate_with_its_key(self) -> Self:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError(
                "set both KVGATE_NATS_TLS_CERT_FILE and KVGATE_NATS_TLS_KEY_FILE, or neither"
            )
        return self


def server_urls(url: str) -> list[str]:
    """The servers of a comma-separated ``url``, in order; a ``ValueError`` for an empty one."""
    servers = [part.strip() for part in url.split(",")]
    if not all(servers):
        raise ValueError(f"an empty server in the NATS URL list {url!r}")
    return servers


def connect_options(url: str, settings: NatsClientSettings) -> dict[str, Any]:
    """nats.py's ``connect`` arguments for ``url`` and ``settings``: the server pool without
    credentials in it, the credentials as options (see the module's docstring), TLS. Pure: it
    reads no file, so a bad path fails where nats.py opens it."""
    servers: list[str] = []
    users: set[tuple[str, str | None]] = set()
    for server in server_urls(url):
        parts = urlsplit(server if "://" in server else f"nats://{server}")
        if parts.username is not None:
            users.add((unquote(parts.username), _unquoted(parts.password)))
        host = parts.hostname or ""
        netloc = f"[{host}]" if ":" in host else host
        if parts.port is not None:
            netloc += f":{parts.port}"
        servers.append(urlunsplit(parts._replace(netloc=netloc)))
    if len(users) > 1:
        raise ValueError(
            "the NATS URLs carry different users: give every server the same one, or one URL "
            "with the user and the others without"
        )
    options: dict[str, Any] = {
        "servers": servers,
        "ping_interval": settings.ping_interval_s,
        "connect_timeout": settings.connect_timeout_s,
    }
    if users:
        if settings.creds_file is not None:
            raise ValueError(
                "KVGATE_NATS_CREDS_FILE is set and a NATS URL carries a user too: use one of them"
            )
        ((user, password),) = users
        if password is None:
            options["token"] = user
        else:
            options["user"], options["password"] = user, password
    if settings.creds_file is not None:
        options["user_credentials"] = str(settings.creds_file)
    return options


def tls_context(settings: NatsClientSettings) -> ssl.SSLContext | None:
    """A client TLS context where the settings name a CA or a client certificate; ``None``
    otherwise (a ``tls://`` URL then gets nats.py's default context)."""
    if settings.tls_ca_file is None and settings.tls_cert_file is None:
        return None
    context = ssl.create_default_context(
        cafile=str(settings.tls_ca_file) if settings.tls_ca_file else None
    )
    if settings.tls_cert_file is not None and settings.tls_key_file is not None:
        context.load_cert_chain(str(settings.tls_cert_file), str(settings.tls_key_file))
    return context


async def connect(url: str, settings: NatsClientSettings | None = None, **options: Any) -> NATS:
    """Connect to ``url`` (one server or a comma-separated list) with ``settings``; further
    ``options`` go to nats.py as they are (``name``, callbacks, ``max_reconnect_attempts``)."""
    settings = settings or NatsClientSettings()
    given = connect_options(url, settings)
    context = tls_context(settings)
    if context is not None:
        given["tls"] = context
    return await nats.connect(**(given | options))


def _unquoted(value: str | None) -> str | None:
    return None if value is None else unquote(value)
