"""`kvgate up`: one command starts NATS, a worker and the front door; Ctrl-C stops them all."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import openai
import pytest

from broker.procs import Proc, free_port, wait_http
from kvgate.cli import COMMAND
from tests.procs import alive


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(entry.name))
    found: set[int] = set()
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


SAID_BOUND_S = 30.0
"""From the front door's first 200 on /readyz to `up`'s banner: a probe every half second and a
GET of /v1/models, on a loaded 2-core machine."""


def poll_said(up: Proc, start: str, *, timeout_s: float) -> None:
    assert up.log_path is not None
    deadline = time.monotonic() + timeout_s
    while not any(x.startswith(start) for x in up.log_path.read_text().splitlines()):
        assert time.monotonic() < deadline, up.tail()
        assert up.alive(), up.tail()
        time.sleep(0.2)


def said_by_up(up: Proc, logs: Path, port: int) -> None:
    """What a newcomer reads: a line per component naming its log, a line per phase of the
    wait (the output is no terminal here), the banner; not one log line of the processes,
    which are in their files, and no health probe in the front door's."""
    assert up.log_path is not None
    said = up.log_path.read_text().splitlines()
    for component in ("nats", "worker", "api"):
        [line] = [x for x in said if x.startswith(f"  {component} ")]
        assert f"(log: {logs / component}.log)" in line
        assert (logs / f"{component}.log").stat().st_size > 0
    assert "  ... waiting for the worker's engine to load the model" in said
    base = f"http://127.0.0.1:{port}"
    ready = said.index(next(x for x in said if x.startswith("kvgate is ready in ")))
    banner = "\n".join(said[ready:])
    for url in (f"{base}/v1 ", f"{base}/dashboard ", f"{base}/metrics"):
        assert url in banner
    assert f"curl -s {base}/v1/chat/completions" in banner and '"model": "kvgate-dev"' in banner
    assert not [x for x in said if x.lstrip().startswith("{")], "a JSON log line on the terminal"
    api_log = (logs / "api.log").read_text()
    assert '"logger": "uvicorn.access"' in api_log  # the calls above were access-logged
    assert "/readyz" not in api_log  # probed twice a second while the engine loaded


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_up_serves_and_a_signal_stops_every_process(
    tmp_path: Path, dev_model: Path, sig: signal.Signals
) -> None:
    port = free_port()
    up = Proc(
        "up",
        [*COMMAND, "up", "--data-dir", str(tmp_path / "data"), "--model", str(dev_model),
         "--port", str(port)],
        {},
        tmp_path,
    )  # fmt: skip
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz", up, timeout=240)
        # Ready once `up` says so (its own probe, a moment after ours), so that its banner is
        # out before the stop below.
        poll_said(up, "kvgate is ready in ", timeout_s=SAID_BOUND_S)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused")
        reply = client.chat.completions.create(
            model="kvgate-dev", messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 4

        started = descendants(up.pid)
        assert len(started) >= 3  # nats-server, worker (+ its engine core), api
        # Ctrl-C in a terminal signals the whole foreground group, here `up`'s own (a
        # supervisor's SIGTERM too, here), while a call streams: the call still ends whole, so
        # NATS outlived the worker's drain.
        stream = client.chat.completions.create(
            model="kvgate-dev",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=64,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = iter(stream)
        next(chunks)  # the call is running
        os.killpg(up.pid, sig)
        usage = [chunk.usage for chunk in chunks if chunk.usage is not None]
        assert [u.completion_tokens for u in usage] == [64]
        client.close()
        assert up.wait(timeout=90) == 0, up.tail()
        deadline = time.monotonic() + 10
        while any(alive(p) for p in started) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in started if alive(p)], up.tail()
        assert "kvgate stopped" in up.tail()
        said_by_up(up, tmp_path / "data" / "logs", port)
    finally:
        if up.alive():
            os.killpg(up.pid, signal.SIGKILL)
        up.stop()


def test_model_build_is_deterministic(tmp_path: Path, dev_model: Path) -> None:
    again = tmp_path / "again"
    subprocess.run([*COMMAND, "model", "build", str(again)], check=True, capture_output=True)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (dev_model / name).read_bytes(), name
