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
from collections.abc import AsyncIterator
from dataclasses import dataclass

from schemas.vocab import ErrorCode, FinishReason
from workers.engine import (
    EngineDelta,
    EngineError,
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

    def prepare(self, request: EngineRequest) -> PreparedRequest:
        words = " ".join(m.content for m in request.messages).split()
        ids = tuple(range(len(words) + 4))  # role markers and the generation prompt
        if len(ids) + request.sampling.max_tokens > self.config.max_model_len:
            raise EngineRequestError(
                ErrorCode.CONTEXT_LENGTH_EXCEEDED, "prompt plus max_tokens exceeds the context"
            )
        return PreparedRequest(request, ids)

    async def generate(self, prepared: PreparedRequest) -> AsyncIterator[EngineDelta]:
        request = prepared.request
        if any(FAIL_MARKER in m.content for m in request.messages):
            raise EngineError("simulated engine failure")
        self._waiting += 1
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
        rid = request.request_id
        self._running[rid] = prepared.prompt_tokens
        try:
            for n in itertools.count(1):
                await asyncio.sleep(self.config.step_s)
                self._running[rid] += 1
                self._generated += 1
                last = n >= request.sampling.max_tokens
                yield EngineDelta(
                    text=f" t{n}",
                    new_tokens=1,
                    prompt_tokens=prepared.prompt_tokens,
                    completion_tokens=n,
                    finish_reason=FinishReason.LENGTH if last else None,
                )
                if last:
                    return
        finally:
            self._running.pop(rid, None)
            self._slots.release()

    async def abort(self, request_id: str) -> None:
        # Generation stops when the worker closes the iterator; nothing else is held.
        return None

    def shutdown(self) -> None:
        return None
