"""The ``kvgate`` command.

::

    kvgate model build DIR     build the small local development model
    kvgate nats                run the embedded NATS server (JetStream, loopback only)
    kvgate worker --model DIR  run one worker (one per GPU) embedding vLLM
    kvgate api                 run the front door
    kvgate workers             list live workers (KV usage, running, waiting, age)
    kvgate lag [--watch]       JetStream consumer lag per tier
    kvgate up                  all of the above on one machine, for development
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from pathlib import Path
from types import FrameType

from broker.settings import DEFAULT_NATS_PORT
from workers.settings import add_flags as add_worker_flags
from workers.settings import from_flags as worker_settings_from_flags

COMMAND = [sys.executable, "-m", "kvgate.cli"]
"""This command, run as a child process on this interpreter (``kvgate up``, the tests and the
load harness start kvgate's processes so)."""

# Services log JSON lines (with trace ids); commands a person reads log text.
_SERVICES = ("api", "worker", "nats")

_STOP_POLL_S = 0.2
"""How often ``kvgate nats`` looks for a stop signal or its server's exit."""


def _configure_logging(level: str, fmt: str | None, command: str) -> None:
    from broker.telemetry import setup_logging

    setup_logging(level, fmt or ("json" if command in _SERVICES else "text"))


def cmd_model_build(args: argparse.Namespace) -> int:
    from workers.devmodel import DevModelSpec, build, is_built

    directory = Path(args.dir)
    if is_built(directory) and not args.force:
        print(f"model already built at {directory}")
        return 0
    build(directory, DevModelSpec())
    print(f"built the development model at {directory}")
    return 0


def cmd_nats(args: argparse.Namespace) -> int:
    import json

    from broker.natsauth import PASSWORD_ENV, NatsUsers
    from broker.natsserver import EmbeddedNats
    from broker.settings import is_loopback

    try:
        users = NatsUsers.from_env(os.environ)
    except ValueError as exc:
        print(f"kvgate nats: {exc}", file=sys.stderr)
        return 2
    if users is None and not is_loopback(args.host):
        names = " and ".join(PASSWORD_ENV.values())
        print(
            f"kvgate nats: host {args.host!r} is reachable from the network and no users are set:"
            f" anyone who reaches it could queue calls past admission; set {names}",
            file=sys.stderr,
        )
        return 2
    if args.print_config:
        if users is None:
            names = " and ".join(PASSWORD_ENV.values())
            print(f"kvgate nats: set {names} to print their users", file=sys.stderr)
            return 2
        print(json.dumps(users.config(), indent=2))
        return 0

    # The handler only notes the signal; the main thread stops the server. A handler that
    # stopped it waited on the child that the interrupted main thread was already waiting on,
    # and hung (the server a zombie) until the sender killed the command. Installed before the
    # start, so that no signal finds the server running under the default handler, which would
    # leave it behind in its own process group.
    stop: list[int] = []

    def on_signal(signum: int, _: FrameType | None) -> None:
        stop.append(signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    server = EmbeddedNats(
        Path(args.store_dir),
        host=args.host,
        port=args.port,
        users=users,
        max_store_bytes=args.max_store_bytes,
    )
    server.start()
    access = "users per role" if users else "no users: anyone who reaches it may do anything"
    print(
        f"NATS with JetStream on {server.url} ({access}; store {args.store_dir}); Ctrl-C stops it"
    )
    try:
        while not stop:
            code = server.returncode
            if code is not None:
                return code
            time.sleep(_STOP_POLL_S)
        return 0
    finally:
        server.stop()


def cmd_worker(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from workers.main import serve

    try:
        settings = worker_settings_from_flags(args)
    except ValidationError as exc:  # a bad flag or variable: named by the model, no traceback
        print(f"kvgate worker: {exc}", file=sys.stderr)
        return 2
    from broker.telemetry import setup_tracing, shutdown_tracing

    setup_tracing("kvgate-worker")
    try:
        # The event loop `vllm serve` runs on (and uvicorn picks for the front door): every
        # call crosses it several times before its first token (NATS, the serving layer, the
        # engine's output handler).
        import uvloop

        return uvloop.run(serve(settings))
    finally:
        shutdown_tracing()


def cmd_api(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from broker.settings import ApiSettings

    overrides = {k: v for k, v in {"host": args.host, "port": args.port}.items() if v is not None}
    try:
        settings = ApiSettings(**overrides)
    except ValidationError as exc:  # a bad flag or variable: named by the model, no traceback
        print(f"kvgate api: {exc}", file=sys.stderr)
        return 2
    import uvicorn

    from api.app import create_app
    from api.http import bounded_head_protocol
    from api.routes.health import ProbeAccessFilter
    from broker.telemetry import setup_tracing, shutdown_tracing

    setup_tracing("kvgate-api")
    if not settings.access_log_probes:
        logging.getLogger("uvicorn.access").addFilter(ProbeAccessFilter())
    # uvicorn shuts down gracefully on SIGTERM and SIGINT, then raises the signal again under
    # the handlers it found installed: under the defaults, a clean stop would end as "killed
    # by SIGTERM" (143) or a KeyboardInterrupt. This handler takes that second delivery (and
    # one before uvicorn took over, when nothing is running yet) and exits 0, as `kvgate
    # worker` and `kvgate nats` do.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_cleanly)
    try:
        uvicorn.run(
            create_app(settings),
            host=settings.host,
            port=settings.port,
            log_level=args.log_level.lower(),
            log_config=None,  # uvicorn's loggers go through kvgate's (JSON) handler
            timeout_graceful_shutdown=10,
            limit_concurrency=settings.max_connections,
            timeout_keep_alive=settings.keep_alive_s,
            http=bounded_head_protocol(settings.max_head_bytes),
        )
    finally:
        shutdown_tracing()
    return 0


def _exit_cleanly(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def cmd_workers(args: argparse.Namespace) -> int:
    import time

    from broker import natsconn
    from broker.fleet import read_fleet, workers_table
    from broker.settings import ApiSettings
    from broker.streams import workers_bucket

    settings = ApiSettings()

    async def show() -> int:
        nc = await natsconn.connect(
            args.nats_url or settings.nats_url, settings.nats, connect_timeout=3
        )
        try:
            kv = await workers_bucket(nc.jetstream(), settings.stream)
            view = await read_fleet(kv, settings.heartbeat_max_age_s)
        finally:
            await nc.close()
        now_ms = int(time.time() * 1000)
        live = view.live(now_ms)
        if args.json:
            import json

            import msgspec

            print(json.dumps([msgspec.to_builtins(hb) for hb in live]))
        elif live:
            print(workers_table(live, now_ms))
        else:
            print("no live workers")
        return 0

    return asyncio.run(show())


def cmd_lag(args: argparse.Namespace) -> int:
    from broker import natsconn
    from broker.lag import fleet_lag, lag_table
    from broker.settings import ApiSettings

    settings = ApiSettings()
    url = args.nats_url or settings.nats_url

    async def show() -> int:
        nc = await natsconn.connect(url, settings.nats, connect_timeout=3)
        try:
            while True:
                rows = await fleet_lag(nc.jetstream())
                if args.json:
                    import json

                    import msgspec

                    print(json.dumps(msgspec.to_builtins(rows)), flush=True)
                else:
                    if args.watch:
                        print("\033[H\033[2J", end="")  # clear the terminal
                    print(lag_table(rows), flush=True)
                if not args.watch:
                    return 0
                await asyncio.sleep(args.interval)
        finally:
            await nc.close()

    try:
        return asyncio.run(show())
    except KeyboardInterrupt:
        return 0


def cmd_key_hash(args: argparse.Namespace) -> int:
    """Print the ``key_sha256`` of an API key for the tenants file (the key is read from
    stdin when not given, so that it stays out of shell history)."""
    import sys

    from broker.admission.tenants import hash_key

    key = args.key if args.key is not None else sys.stdin.readline().strip()
    if not key:
        print("kvgate key hash: empty key", file=sys.stderr)
        return 2
    print(hash_key(key))
    return 0


def cmd_top(args: argparse.Namespace) -> int:
    from kvgate.top import run

    token = os.environ.get("KVGATE_ADMIN_TOKEN")
    return run(args.url, token, interval_s=args.interval, once=args.once)


def cmd_up(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from broker.natsauth import NatsUsers
    from broker.settings import ApiSettings
    from kvgate.supervisor import Supervisor

    try:  # the front door's own check and NATS's passwords, before any process is started
        ApiSettings(host=args.host, port=args.port)
        NatsUsers.from_env(os.environ)
    except (ValidationError, ValueError) as exc:
        print(f"kvgate up: {exc}", file=sys.stderr)
        return 2
    return Supervisor(
        data_dir=Path(args.data_dir),
        model_dir=Path(args.model) if args.model else None,
        host=args.host,
        port=args.port,
        nats_port=args.nats_port,
    ).run()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvgate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--log-level", default=os.environ.get("KVGATE_LOG_LEVEL", "INFO"))
    parser.add_argument(
        "--log-format",
        choices=("json", "text"),
        default=os.environ.get("KVGATE_LOG_FORMAT") or None,
        help="default: json for the services (api, worker, nats), text for the rest",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="development model").add_subparsers(
        dest="model_command", required=True
    )
    build = model.add_parser("build", help="build the small local model into DIR")
    build.add_argument("dir")
    build.add_argument("--force", action="store_true", help="rebuild even if present")
    build.set_defaults(func=cmd_model_build)

    key = sub.add_parser("key", help="tenant API keys").add_subparsers(
        dest="key_command", required=True
    )
    key_hash = key.add_parser("hash", help="print a key's sha256 for the tenants file")
    key_hash.add_argument("key", nargs="?", help="the key (default: read one line from stdin)")
    key_hash.set_defaults(func=cmd_key_hash)

    nats_p = sub.add_parser("nats", help="run the embedded NATS server")
    nats_p.add_argument("--port", type=int, default=DEFAULT_NATS_PORT, help="0 picks a free one")
    nats_p.add_argument("--store-dir", default=".kvgate/nats")
    nats_p.add_argument(
        "--host",
        default="127.0.0.1",
        help="another address than loopback only with users (KVGATE_NATS_*_PASSWORD)",
    )
    nats_p.add_argument(
        "--max-store-bytes",
        type=int,
        help="the most disk JetStream may use; past it calls get 503 queue_full (default: "
        "the server's own, most of the free disk); at least twice KVGATE_STREAM_MAX_BYTES",
    )
    nats_p.add_argument(
        "--print-config",
        action="store_true",
        help="print the users block for your own nats-server (from KVGATE_NATS_*_PASSWORD)",
    )
    nats_p.set_defaults(func=cmd_nats)

    worker = sub.add_parser("worker", help="run a worker (settings also from KVGATE_WORKER_*)")
    add_worker_flags(worker)
    worker.set_defaults(func=cmd_worker)

    api = sub.add_parser("api", help="run the front door (settings also from KVGATE_*)")
    api.add_argument("--host")
    api.add_argument("--port", type=int)
    api.set_defaults(func=cmd_api)

    workers = sub.add_parser("workers", help="list live workers from their heartbeats")
    workers.add_argument("--nats-url", help="default: KVGATE_NATS_URL")
    workers.add_argument("--json", action="store_true", help="print JSON instead of a table")
    workers.set_defaults(func=cmd_workers)

    lag = sub.add_parser("lag", help="JetStream consumer lag per tier")
    lag.add_argument("--nats-url", help="default: KVGATE_NATS_URL")
    lag.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
    lag.add_argument("--interval", type=float, default=2.0)
    lag.add_argument("--json", action="store_true")
    lag.set_defaults(func=cmd_lag)

    top = sub.add_parser("top", help="live view of a front door: workers, lag, admission")
    top.add_argument("--url", default="http://127.0.0.1:8000", help="the front door")
    top.add_argument("--interval", type=float, default=2.0)
    top.add_argument("--once", action="store_true", help="print one frame and exit")
    top.set_defaults(func=cmd_top)

    up = sub.add_parser("up", help="embedded NATS + one worker + the front door")
    up.add_argument("--data-dir", default=".kvgate")
    up.add_argument("--model", help="model directory (default: DATA_DIR/model, built if missing)")
    up.add_argument("--host", default="127.0.0.1")
    up.add_argument("--port", type=int, default=8000)
    up.add_argument("--nats-port", type=int, default=0, help="default: a free port")
    up.set_defaults(func=cmd_up)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _configure_logging(args.log_level, args.log_format, args.command)
    code: int = args.func(args)
    return code


if __name__ == "__main__":
    sys.exit(main())
