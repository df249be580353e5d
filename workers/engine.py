"""The engine interface the worker drives, and its errors.

One real implementation (``workers.vllm_engine.VllmEngine``, on GPU or on CPU with the same
code). The worker never imports vLLM itself, so its pull loop and relay can be read and tested
as plain asyncio code.

Errors::

    EngineError
    ├── EngineRequestError   this call cannot run here (too long, bad parameters): do not retry
    └── EngineDeadError      the engine is gone: every call in it is lost, the worker must exit
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

from schemas.vocab import ErrorCode, FinishReason
from schemas.wire import ChatMessage, SamplingParams


class EngineError(Exception):
    """Any failure of the engine; a plain ``EngineError`` is worth retrying elsewhere."""


class EngineRequestError(EngineError):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class EngineDeadError(EngineError):
    pass


@dataclass(frozen=True, slots=True)
class EngineRequest:
    request_id: str
    messages: tuple[ChatMessage, ...]
    sampling: SamplingParams
    priority: int


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """A request checked and tokenized by the engine, ready to generate."""

    request: EngineRequest
    prompt_token_ids: tuple[int, ...]

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True, slots=True)
class EngineDelta:
    """New text since the previous delta. ``finish_reason`` is set on the last one only."""

    text: str
    new_tokens: int
    prompt_tokens: int
    completion_tokens: int
    finish_reason: FinishReason | None


@dataclass(frozen=True, slots=True)
class EngineStats:
    """The scheduler's latest reading. ``None`` fields mean "not reported yet", never zero."""

    kv_cache_usage: float | None
    num_running: int
    num_waiting: int
    kv_capacity_tokens: int | None
    max_num_seqs: int
    block_size: int = 16
    num_preemptions: int = 0
    """Requests the engine has preempted since it started (KV cache ran out mid-run)."""
    generated_tokens: int = 0
    """Output tokens generated since the engine started."""


class Engine(Protocol):
    @property
    def model_name(self) -> str: ...

    def stats(self) -> EngineStats: ...

    def prepare(self, request: EngineRequest) -> PreparedRequest:
        """Tokenize and check ``request``; raises ``EngineRequestError`` if it cannot run here
        (for example prompt plus ``max_tokens`` beyond the context)."""
        ...

    def generate(self, prepared: PreparedRequest) -> AsyncIterator[EngineDelta]:
        """Yield deltas until the request finishes. When the consumer is slower than the
        engine, consecutive deltas are merged rather than queued one per token. Closing the
        iterator early aborts the request in the engine."""
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a running request and free its KV blocks; unknown ids are ignored."""
        ...

    def shutdown(self) -> None: ...
