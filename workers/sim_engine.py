"""A simulated engine with the ``Engine`` interface: no model, no GPU, deterministic text.

For tests of the worker shell that must make the engine misbehave on purpose (a vLLM engine
cannot be made to fail one chosen call), and for load-harness dry runs. It keeps the parts of
the real engine's behaviour the worker depends on: a KV cache of fixed size that fills with
prompt and generated tokens, at most ``max_num_seqs`` running at once (the rest wait), and a
steady per-step token rate.

A prompt containing ``FAIL_MARKER`` fails with a retryable ``EngineError`` on every attempt.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

from schemas.vocab import Endpoint, ErrorCode, FinishReason
from workers.engine import (
    EngineError,
    EngineOutput,
    EngineRequest,
    EngineRequestError,
    EngineStats,
    PreparedRequest,
)

FAIL_MARKER = "[[kvgate-sim-fail]]"


@dataclass(frozen=True)
class SimEngineConfig:
    served_model_name: str = "kvgate-sim"
    max_num_seqs: int = 8
    kv_capacity_tokens: int = 4096
    block_size: int = 16
    max_model_len: int = 2048
    step_s: float = 0.005
    """Time per decode step; every running sequence gains one token per step."""


def _prompt_text(request: EngineRequest) -> str:
    body = request.body
    if request.endpoint is Endpoint.COMPLETIONS:
        prompt = body.get("prompt", "")
        return prompt if isinstance(prompt, str) else json.dumps(prompt)
    return " ".join(
        m["content"] if isinstance(m.get("content"), str) else json.dumps(m.get("content"))
        for m in body.get("messages", [])
        if isinstance(m, dict)
    )


class SimEngine:
    def __init__(self, config: SimEngineConfig | None = None) -> None:
        self.config = config or SimEngineConfig()
        self._running: dict[str, int] = {}  # request id -> KV tokens held
        self._waiting = 0
        self._slots = asyncio.Semaphore(self.config.max_num_seqs)
        self._generated = 0

    @property
    def model_name(self) -> str:
        return self.config.served_model_name

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    def stats(self) -> EngineStats:
        used = sum(self._running.values())
        return EngineStats(
            kv_cache_usage=min(1.0, used / self.config.kv_capacity_tokens),
            num_running=len(self._running),
            num_waiting=self._waiting,
            kv_capacity_tokens=self.config.kv_capacity_tokens,
            max_num_seqs=self.config.max_num_seqs,
            block_size=self.config.block_size,
            generated_tokens=self._generated,
        )

    async def prepare(self, request: EngineRequest) -> PreparedRequest:
        body = request.body
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens")
        max_tokens = int(max_tokens or request.max_tokens)
        prompt_tokens = len(_prompt_text(request).split()) + 4  # role markers, generation prompt
        if prompt_tokens + max_tokens > self.config.max_model_len:
            raise EngineRequestError(
                ErrorCode.CONTEXT_LENGTH_EXCEEDED, "prompt plus max_tokens exceeds the context"
            )
        return PreparedRequest(request, prompt_tokens, max_tokens)

    async def generate(self, prepared: PreparedRequest) -> AsyncGenerator[EngineOutput, None]:
        request = prepared.request
        if FAIL_MARKER in _prompt_text(request):
            raise EngineError("simulated engine failure")
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        rid = request.request_id
        self._running[rid] = prepared.prompt_tokens
        stream = bool(request.body.get("stream"))
        text: list[str] = []
        try:
            for n in itertools.count(1):
                await asyncio.sleep(self.config.step_s)
                self._running[rid] += 1
                self._generated += 1
                last = n >= prepared.max_tokens
                piece = f" t{n}"
                text.append(piece)
                finish = FinishReason.LENGTH if last else None
                yield EngineOutput(
                    sse=_chunk(request, piece, finish) if stream else "",
                    new_tokens=1,
                    prompt_tokens=prepared.prompt_tokens,
                    completion_tokens=n,
                    finish_reason=finish,
                    body=None
                    if stream or not last
                    else _body(request, "".join(text), prepared.prompt_tokens, n),
                )
                if last:
                    return
        finally:
            self._running.pop(rid, None)
            self._slots.release()

    async def discard(self, prepared: PreparedRequest) -> None:
        return None

    def shutdown(self) -> None:
        return None


def _chunk(request: EngineRequest, text: str, finish: FinishReason | None) -> str:
    """One server-sent event in OpenAI's chunk shape."""
    if request.endpoint is Endpoint.CHAT_COMPLETIONS:
        choice: dict[str, Any] = {"index": 0, "delta": {"content": text}}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text}
        kind = "text_completion"
    choice["finish_reason"] = finish.value if finish else None
    chunk = {
        "id": request.request_id,
        "object": kind,
        "created": int(time.time()),
        "model": request.body.get("model"),
        "choices": [choice],
    }
    return f"data: {json.dumps(chunk)}\n\n"


def _body(request: EngineRequest, text: str, prompt_tokens: int, completion_tokens: int) -> bytes:
    """A whole response in OpenAI's shape."""
    if request.endpoint is Endpoint.CHAT_COMPLETIONS:
        choice: dict[str, Any] = {"index": 0, "message": {"role": "assistant", "content": text}}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text}
        kind = "text_completion"
    choice["finish_reason"] = FinishReason.LENGTH.value
    return json.dumps(
        {
            "id": request.request_id,
            "object": kind,
            "created": int(time.time()),
            "model": request.body.get("model"),
            "choices": [choice],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }
    ).encode()
