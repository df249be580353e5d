"""The engine interface the worker drives, and its errors.

One real implementation (``workers.vllm_engine.VllmEngine``, on GPU or on CPU with the same
code). The worker never imports vLLM itself, so its pull loop and relay can be read and tested
as plain asyncio code.

Errors (their place in kvgate's tree is drawn in ``broker.errors``)::

    EngineError              engine_error: worth retrying on another worker
    ├── EngineRequestError   this call cannot run here (too long, bad parameters): do not retry
    └── EngineDeadError      fatal: the engine is gone, every call in it is lost, the worker
                             must exit
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, Final, Protocol

from broker.errors import EngineError as EngineError  # defined there: the front door needs it
from schemas.vocab import Endpoint, ErrorCode, FinishReason


class EngineRequestError(EngineError):
    """The engine's serving layer refused the request; ``message`` and ``param`` are its own,
    ``code`` the request error's (an ``InvalidRequest`` code), which the caller sees."""

    def __init__(self, code: ErrorCode, message: str, param: str | None = None) -> None:
        super().__init__(message, param=param)
        self.code = code


class EngineDeadError(EngineError):
    """Fatal: the engine is gone. The worker hands its calls back and exits."""


PROGRESS_S: Final = 2.0
"""The longest an engine's ``generate`` goes without yielding."""


@dataclass(frozen=True, slots=True)
class EngineRequest:
    """One OpenAI request for the engine's serving layer. ``body`` is the caller's JSON object
    as sent; ``max_tokens`` is kvgate's budget, applied when the body names no limit."""

    request_id: str
    endpoint: Endpoint
    body: dict[str, Any]
    max_tokens: int
    priority: int


@dataclass(eq=False, slots=True)
class PreparedRequest:
    """A request the serving layer has checked and rendered (chat template, tools), held at
    the engine's door until the worker lets it in. ``prompt_tokens`` and ``max_tokens`` are
    what the engine will hold: the rendered prompt, and the output budget of every choice."""

    request: EngineRequest
    prompt_tokens: int
    max_tokens: int
    handle: Any = None
    """The engine's own state for the request (opaque to the worker)."""


@dataclass(frozen=True, slots=True)
class EngineOutput:
    """New output since the previous one. ``sse`` holds the server-sent events the serving
    layer wrote (streamed requests only); ``body`` is its whole response (the last output of
    a request that was not streamed). ``finish_reason`` is set on the last output only."""

    sse: str
    new_tokens: int
    prompt_tokens: int
    completion_tokens: int
    finish_reason: FinishReason | None = None
    body: bytes | None = None


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

    @property
    def max_model_len(self) -> int:
        """The longest prompt plus output the engine takes (listed by ``/v1/models``)."""
        ...

    def stats(self) -> EngineStats: ...

    async def prepare(self, request: EngineRequest) -> PreparedRequest:
        """Parse, check and render ``request`` without starting it; raises
        ``EngineRequestError`` if the serving layer refuses it (bad field, prompt plus
        ``max_tokens`` beyond the context, a field kvgate cannot honour). A prepared request
        must be passed to ``generate`` or ``discard``."""
        ...

    def generate(self, prepared: PreparedRequest) -> AsyncGenerator[EngineOutput, None]:
        """Start the request and yield its output until it finishes, at least every
        ``PROGRESS_S`` (an empty output when there is nothing new: a request that is not
        streamed has no output until its end). When the consumer is slower than the engine,
        consecutive outputs are merged rather than queued one per token. Closing the
        iterator early aborts the request in the engine."""
        ...

    async def discard(self, prepared: PreparedRequest) -> None:
        """Drop a prepared request that will not run (deadline, cancel, drain)."""
        ...

    def shutdown(self) -> None: ...
