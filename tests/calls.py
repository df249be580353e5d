"""Calls for tests: a chat completions body, a call envelope as the front door publishes it,
and one streamed chat call through a front door, timed."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from schemas.vocab import Endpoint, Tier
from schemas.wire import CallEnvelope

MODEL = "kvgate-dev"


def chat_body(content: str = "hello", max_tokens: int = 8, **extra: Any) -> dict[str, Any]:
    """A chat completions body with one user message, for the development model unless
    ``extra`` names another; ``extra`` adds or overrides fields (``stream``, ``model``...)."""
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        # The random-weight model can emit end-of-sequence early; exact lengths make the
        # usage assertions meaningful (the simulated engine always runs to max_tokens).
        "ignore_eos": True,
        **extra,
    }


def make_call(
    call_id: str,
    *,
    tier: Tier = Tier.STANDARD,
    deadline_in_s: float = 30,
    model: str = MODEL,
    session_id: str = "s1",
    content: str = "hi",
    max_tokens: int = 4,
    stream: bool = False,
) -> CallEnvelope:
    now_ms = int(time.time() * 1000)
    body: dict[str, Any] = {"model": model, "messages": [{"role": "user", "content": content}]}
    if stream:
        body["stream"] = True
    return CallEnvelope(
        call_id=call_id,
        session_id=session_id,
        tier=tier,
        model=model,
        endpoint=Endpoint.CHAT_COMPLETIONS,
        body=json.dumps(body).encode(),
        stream=stream,
        max_tokens=max_tokens,
        deadline_ms=now_ms + int(deadline_in_s * 1000),
        created_ms=now_ms,
    )


async def stream_call(
    client: httpx.AsyncClient, payload: dict[str, Any], *, tier: str | None = None
) -> dict[str, Any]:
    """Stream one call; returns its TTFT, usage and the error event if any."""
    headers = {"X-Kvgate-Tier": tier} if tier else {}
    started = time.monotonic()
    ttft: float | None = None
    usage = error = None
    async with client.stream("POST", "/v1/chat/completions", json=payload, headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        buffer = ""
        async for text in r.aiter_text():
            buffer += text
            *lines, buffer = buffer.split("\n")
            for line in lines:
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    error = chunk["error"]
                elif chunk.get("usage"):
                    usage = chunk["usage"]
                elif ttft is None and chunk["choices"][0]["delta"].get("content"):
                    ttft = time.monotonic() - started
    return {"ttft": ttft, "usage": usage, "error": error}
