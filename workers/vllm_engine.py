"""The vLLM engine behind ``workers.engine.Engine``: ``AsyncLLM`` embedded in the worker process,
served through vLLM's own OpenAI serving layer.

kvgate does not re-implement OpenAI's API: the worker builds vLLM's serving objects exactly as
``vllm serve`` does (``init_app_state`` over the same command-line arguments), so the chat
template, tool-call and reasoning parsers, structured outputs, logprobs, ``n``, ``stop``,
``seed`` and every vLLM extension behave as under ``vllm serve``, and a vLLM upgrade brings new
fields without kvgate changes.

The one thing kvgate adds is a gate in front of the engine. The serving layer gets a client
that forwards everything to ``AsyncLLM`` except ``generate``: there, a kvgate call stops after
vLLM has rendered and tokenized it (so its prompt, tools included, and its output budget are
known exactly) and waits until the worker's headroom policy lets it in; the engine priority
is kvgate's (the tier, then the session's admission time: ``headroom.engine_priority``),
whatever the request said.

The same code serves the CUDA build (``pip install kvgate[gpu]``) and the CPU build
(``kvgate[cpu]``): both ship the ``vllm`` module with the same API. Only the engine arguments
differ, and those come from ``EngineSettings``.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import gc
import json
import logging
import os
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any, Final

from schemas.vocab import Endpoint, ErrorCode, FinishReason
from workers.devmodel import SERVE_ARGS_FILE
from workers.engine import (
    PROGRESS_S,
    EngineDeadError,
    EngineError,
    EngineOutput,
    EngineRequest,
    EngineRequestError,
    EngineStats,
    PreparedRequest,
)
from workers.settings import EngineSettings

log = logging.getLogger(__name__)

# Fields that OpenAI defines, vLLM ignores, and that do not change an answer: storage,
# bookkeeping and routing hints. Every other field vLLM would ignore is refused by name.
_HARMLESS_FIELDS: Final = frozenset(
    {"metadata", "store", "safety_identifier", "prompt_cache_key", "user"}
)


def _model_serve_args(model: Path) -> list[str]:
    """The ``vllm serve`` options a model folder carries for itself (a JSON list; the
    development model names its tool-call parser there)."""
    path = model / SERVE_ARGS_FILE
    if not path.is_file():
        return []
    args = json.loads(path.read_text())
    if not (isinstance(args, list) and all(isinstance(a, str) for a in args)):
        raise ValueError(f"{path} must hold a JSON list of strings")
    return list(args)


def serve_argv(config: EngineSettings) -> list[str]:
    """The ``vllm serve`` command line ``config`` stands for."""
    argv = [
        "--model",
        str(config.model),
        "--served-model-name",
        config.served_model_name,
        "--max-model-len",
        str(config.max_model_len),
        "--max-num-seqs",
        str(config.max_num_seqs),
        "--gpu-memory-utilization",
        str(config.gpu_memory_utilization),
        "--dtype",
        config.dtype,
        "--seed",
        str(config.seed),
    ]
    optional = {
        "--block-size": config.block_size,
        "--num-gpu-blocks-override": config.num_gpu_blocks_override,
        "--kv-cache-memory-bytes": config.kv_cache_memory_bytes,
    }
    for flag, value in optional.items():
        if value is not None:
            argv += [flag, str(value)]
    if config.enforce_eager:
        argv.append("--enforce-eager")
    argv += _model_serve_args(config.model)
    argv += config.serve_args
    # kvgate orders the engine's queue by tier: these are not the operator's to change.
    argv += ["--scheduling-policy", "priority", "--disable-log-stats"]
    return argv


class _SchedulerReading:
    """Holds the latest scheduler stats; written by vLLM's output handler on every step."""

    def __init__(self) -> None:
        self.kv_cache_usage: float | None = None
        self.num_running = 0
        self.num_waiting = 0
        self.num_preemptions = 0
        self.generated_tokens = 0


def _stat_logger_factory(reading: _SchedulerReading) -> Any:
    from vllm.v1.metrics.loggers import StatLoggerBase

    class KvgateStatLogger(StatLoggerBase):  # type: ignore[misc]
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self._reading = reading

        def record(
            self,
            scheduler_stats: Any,
            iteration_stats: Any,
            mm_cache_stats: Any = None,
            engine_idx: int = 0,
        ) -> None:
            if iteration_stats is not None:
                self._reading.num_preemptions += int(iteration_stats.num_preempted_reqs)
                self._reading.generated_tokens += int(iteration_stats.num_generation_tokens)
            if scheduler_stats is None:
                return
            self._reading.kv_cache_usage = float(scheduler_stats.kv_cache_usage)
            self._reading.num_running = int(scheduler_stats.num_running_reqs)
            self._reading.num_waiting = int(scheduler_stats.num_waiting_reqs) + int(
                getattr(scheduler_stats, "num_skipped_waiting_reqs", 0)
            )

        def log_engine_initialized(self) -> None:
            pass

    return KvgateStatLogger


class _End:
    """Queued after a ticket's last output."""


_END: Final = _End()


class _Ticket:
    """One kvgate call's passage through the serving layer and the gate.

    The serving task runs the request through vLLM's serving class; the gate (inside it) fills
    in ``prompt_tokens`` and ``max_tokens``, sets ``at_gate`` and waits for ``permit``; the
    serving layer's output (server-sent events) queues in ``outputs`` for ``generate``."""

    def __init__(self, request: EngineRequest) -> None:
        self.request = request
        self.at_gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.permit = asyncio.Event()
        self.outputs: asyncio.Queue[str | _End] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None
        self.prompt_tokens = 0
        self.max_tokens = 0
        self.completion_tokens = 0
        self.finish_reason: FinishReason | None = None
        self.body: bytes | None = None
        self.refusal: Any = None
        """vLLM's ``ErrorResponse``, when the serving layer refused the request."""
        self.engine_error: BaseException | None = None
        self._seen: dict[int, int] = {}

    def reached_gate(self, prompt_tokens: int, max_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        if not self.at_gate.done():
            self.at_gate.set_result(None)

    def observe(self, output: Any, delta: bool) -> None:
        """Count the tokens of one ``RequestOutput`` (deltas or cumulative, per choice)."""
        if not self.prompt_tokens and output.prompt_token_ids is not None:
            # Known at the gate already, unless the prompt came in a shape it could not read.
            self.prompt_tokens = len(output.prompt_token_ids)
        for choice in output.outputs:
            n = len(choice.token_ids)
            if delta:
                self.completion_tokens += n
            else:
                self.completion_tokens += n - self._seen.get(choice.index, 0)
                self._seen[choice.index] = n
        if output.finished and output.outputs:
            self.finish_reason = _finish_reason(output.outputs[0].finish_reason)


_current_ticket: contextvars.ContextVar[_Ticket | None] = contextvars.ContextVar(
    "kvgate_ticket", default=None
)


class _GatedEngineClient:
    """``AsyncLLM`` as the serving layer sees it, with kvgate's gate in ``generate``.

    Everything but ``generate`` is forwarded unchanged (``__getattr__``), so the serving classes
    read the engine's configuration, tokenizer and renderer as they would under ``vllm
    serve``. The request's ticket travels in a context variable set by the task that runs the
    serving call, which is also the task that iterates this generator."""

    def __init__(self, llm: Any) -> None:
        self._llm = llm

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    async def generate(
        self, prompt: Any, sampling_params: Any, request_id: str, *args: Any, **kwargs: Any
    ) -> AsyncGenerator[Any, None]:
        from vllm.sampling_params import RequestOutputKind

        ticket = _current_ticket.get()
        if ticket is None:
            raise RuntimeError("a request reached the engine without passing kvgate's gate")
        ticket.reached_gate(
            _prompt_length(prompt), int(sampling_params.max_tokens or 0) * sampling_params.n
        )
        await ticket.permit.wait()
        kwargs["priority"] = ticket.request.priority
        delta = sampling_params.output_kind == RequestOutputKind.DELTA
        try:
            async for output in self._llm.generate(
                prompt, sampling_params, request_id, *args, **kwargs
            ):
                ticket.observe(output, delta)
                yield output
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except BaseException as exc:
            ticket.engine_error = exc
            raise


def _prompt_length(prompt: Any) -> int:
    ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
    if ids is None:
        ids = getattr(prompt, "prompt_token_ids", None)
    return len(ids) if ids is not None else 0


class VllmEngine:
    """Start with ``await VllmEngine.start(config)``; start-up loads the model (seconds)."""

    def __init__(self, llm: Any, state: Any, config: EngineSettings, reading: Any) -> None:
        self._llm = llm
        self._state = state
        self._config = config
        self._reading = reading
        cache = llm.vllm_config.cache_config
        blocks = cache.num_gpu_blocks
        self._block_size = int(cache.block_size)
        self._kv_capacity_tokens = int(blocks) * self._block_size if blocks else None
        self._max_model_len = int(llm.model_config.max_model_len)

    @classmethod
    async def start(cls, config: EngineSettings) -> VllmEngine:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.cpu_kvcache_space_gib))
        from starlette.datastructures import State
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.entrypoints.launchers.api_server.app_state import init_app_state
        from vllm.entrypoints.launchers.cli_args import (
            make_arg_parser,
            validate_parsed_serve_args,
        )
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        from vllm.v1.engine.async_llm import AsyncLLM

        args = make_arg_parser(FlexibleArgumentParser()).parse_args(serve_argv(config))
        validate_parsed_serve_args(args)
        reading = _SchedulerReading()
        llm = AsyncLLM.from_engine_args(
            AsyncEngineArgs.from_cli_args(args), stat_loggers=[_stat_logger_factory(reading)]
        )
        state = State()
        try:
            tasks = await llm.get_supported_tasks()
            await init_app_state(_GatedEngineClient(llm), state, args, tasks)
        except BaseException:
            llm.shutdown()
            raise
        engine = cls(llm, state, config, reading)
        await engine._warm_up()
        return engine

    async def _warm_up(self) -> None:
        """Run one tiny request before serving: the first request through a fresh engine pays
        one-off set-up costs (seconds on CPU) that must not land on a caller's first token."""
        body = {
            "model": self.model_name,
            "messages": [{"role": "user", "content": "warm up"}],
            "max_tokens": 2,
        }
        request = EngineRequest("kvgate-warmup", Endpoint.CHAT_COMPLETIONS, body, 2, 0)
        async for _ in self.generate(await self.prepare(request)):
            pass

    @property
    def model_name(self) -> str:
        return self._config.served_model_name

    @property
    def max_model_len(self) -> int:
        return self._max_model_len

    def stats(self) -> EngineStats:
        return EngineStats(
            kv_cache_usage=self._reading.kv_cache_usage,
            num_running=self._reading.num_running,
            num_waiting=self._reading.num_waiting,
            kv_capacity_tokens=self._kv_capacity_tokens,
            max_num_seqs=self._config.max_num_seqs,
            block_size=self._block_size,
            num_preemptions=self._reading.num_preemptions,
            generated_tokens=self._reading.generated_tokens,
        )

    def _parse(self, request: EngineRequest) -> Any:
        """vLLM's own request model for the body, or ``EngineRequestError``."""
        from pydantic import ValidationError
        from vllm.entrypoints.anthropic.protocol import AnthropicMessagesRequest
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.openai.completion.protocol import CompletionRequest

        body = dict(request.body)
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
            body["max_tokens"] = request.max_tokens
        model = {
            Endpoint.CHAT_COMPLETIONS: ChatCompletionRequest,
            Endpoint.COMPLETIONS: CompletionRequest,
            Endpoint.MESSAGES: AnthropicMessagesRequest,
        }[request.endpoint]
        try:
            parsed = model.model_validate(body)
        except ValidationError as exc:
            first = exc.errors()[0]
            loc = ".".join(str(part) for part in first["loc"])
            raise EngineRequestError(
                ErrorCode.INVALID_PARAMETER,
                f"{loc or 'body'}: {first['msg']}",
                param=str(first["loc"][0]) if first["loc"] else None,
            ) from None
        unknown = sorted(set(body) - _accepted_fields(model))
        if unknown:
            raise EngineRequestError(
                ErrorCode.UNSUPPORTED_PARAMETER,
                f"unsupported parameter(s) {', '.join(unknown)}: this server would ignore "
                "them, which could change the answer",
                param=unknown[0],
            )
        return parsed

    async def prepare(self, request: EngineRequest) -> PreparedRequest:
        parsed = self._parse(request)
        ticket = _Ticket(request)
        ticket.task = asyncio.create_task(self._serve(ticket, parsed))
        try:
            await asyncio.wait({ticket.at_gate, ticket.task}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            await _stop(ticket)  # cancelled while vLLM rendered it: nothing may wait at the gate
            raise
        if not ticket.at_gate.done():
            # The serving layer answered without reaching the engine: a refusal.
            self._raise_outcome(ticket)
            raise EngineError("the serving layer ended the request without an answer")
        return PreparedRequest(request, ticket.prompt_tokens, ticket.max_tokens, ticket)

    async def _serve(self, ticket: _Ticket, parsed: Any) -> None:
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse
        from vllm.entrypoints.serve.exception_handling.error_response import (
            create_error_response,
        )

        _current_ticket.set(ticket)
        try:
            endpoint = ticket.request.endpoint
            if endpoint is Endpoint.CHAT_COMPLETIONS:
                result = await self._state.openai_serving_chat.create_chat_completion(parsed)
            elif endpoint is Endpoint.COMPLETIONS:
                result = await self._state.openai_serving_completion.create_completion(parsed)
            else:
                result = await self._state.anthropic_serving_messages.create_messages(parsed, None)
            if isinstance(result, ErrorResponse):
                ticket.refusal = result
            elif isinstance(result, AsyncGenerator):
                async for event in result:
                    if not event.startswith("data: [DONE]"):
                        ticket.outputs.put_nowait(event)
            else:
                # As vLLM's own routes write it (its Anthropic route leaves out nulls).
                exclude_none = ticket.request.endpoint is Endpoint.MESSAGES
                ticket.body = result.model_dump_json(exclude_none=exclude_none).encode()
        except Exception as exc:
            # What ``vllm serve`` would answer for it: a client error is the caller's to fix.
            if _is_server_fault(exc):
                ticket.engine_error = ticket.engine_error or exc
            else:
                ticket.refusal = create_error_response(exc)
        finally:
            ticket.outputs.put_nowait(_END)

    def _raise_outcome(self, ticket: _Ticket) -> None:
        """Raise what ended the request, if something other than a finish did."""
        from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDead

        exc = ticket.engine_error
        if exc is not None and _is_server_fault(exc):
            if isinstance(exc, VllmEngineDead) or self._llm.errored:
                raise EngineDeadError(str(exc)) from exc
            raise EngineError(str(exc)) from exc
        if ticket.refusal is not None:
            error = ticket.refusal.error
            if int(error.code) >= 500:
                raise EngineError(error.message)
            raise EngineRequestError(
                _refusal_code(int(error.code), error.message), error.message, error.param
            )
        if exc is not None:
            raise EngineRequestError(ErrorCode.INVALID_PARAMETER, str(exc))

    async def generate(self, prepared: PreparedRequest) -> AsyncGenerator[EngineOutput, None]:
        ticket: _Ticket = prepared.handle
        ticket.permit.set()
        counted = 0
        try:
            while True:
                try:
                    # asyncio.timeout, not wait_for: no task per output on the token path.
                    async with asyncio.timeout(PROGRESS_S):
                        events: list[str | _End] = [await ticket.outputs.get()]
                except TimeoutError:
                    # Nothing new (a request that is not streamed says nothing until its
                    # end): report the tokens generated so far.
                    new_tokens = ticket.completion_tokens - counted
                    counted = ticket.completion_tokens
                    yield EngineOutput("", new_tokens, ticket.prompt_tokens, counted)
                    continue
                while not ticket.outputs.empty():
                    events.append(ticket.outputs.get_nowait())
                ended = isinstance(events[-1], _End)
                sse = "".join(e for e in events if isinstance(e, str))
                if ended:
                    self._raise_outcome(ticket)
                elif ticket.engine_error is not None and _is_server_fault(ticket.engine_error):
                    # vLLM turned an engine failure into an error event: retry elsewhere.
                    self._raise_outcome(ticket)
                new_tokens = ticket.completion_tokens - counted
                counted = ticket.completion_tokens
                if ended:
                    yield EngineOutput(
                        sse,
                        new_tokens,
                        ticket.prompt_tokens,
                        ticket.completion_tokens,
                        ticket.finish_reason or FinishReason.STOP,
                        ticket.body,
                    )
                    return
                if sse or new_tokens:
                    yield EngineOutput(sse, new_tokens, ticket.prompt_tokens, counted)
        finally:
            await _stop(ticket)

    async def discard(self, prepared: PreparedRequest) -> None:
        await _stop(prepared.handle)

    def shutdown(self) -> None:
        llm, self._llm = self._llm, None
        # The serving objects hold the engine too (through the gated client).
        self._state = None
        if llm is not None:
            llm.shutdown()
            # AsyncLLM.__del__ shuts down again; let it run now, while the interpreter is
            # whole, rather than during interpreter teardown where it fails noisily.
            del llm
            gc.collect()


async def _stop(ticket: _Ticket) -> None:
    """End the serving task; cancelling it inside ``AsyncLLM.generate`` aborts the request
    in the engine and frees its KV blocks."""
    task = ticket.task
    if task is not None and not task.done():
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@functools.cache
def _accepted_fields(model: type) -> frozenset[str]:
    """The body fields vLLM's request ``model`` reads (names and aliases), and the harmless
    ones: worked out once per model, not per call."""
    fields = model.model_fields  # type: ignore[attr-defined]
    names = {name for name in fields} | {f.alias for f in fields.values() if f.alias}
    return frozenset(names | _HARMLESS_FIELDS)


def _is_server_fault(exc: BaseException) -> bool:
    """Whether vLLM's own server would answer ``exc`` with a 5xx (worth retrying on another
    worker) rather than a 4xx (the caller's to fix): vLLM's classification, not kvgate's."""
    from vllm.entrypoints.serve.exception_handling.error_response import create_error_response

    if not isinstance(exc, Exception):
        return True
    return int(create_error_response(exc).error.code) >= 500


def _refusal_code(status: int, message: str) -> ErrorCode:
    if status == 404:
        return ErrorCode.MODEL_NOT_FOUND
    if "context length" in message or "maximum context" in message:
        return ErrorCode.CONTEXT_LENGTH_EXCEEDED
    if status == 501:
        return ErrorCode.UNSUPPORTED_PARAMETER
    return ErrorCode.INVALID_REQUEST


def _finish_reason(raw: str | None) -> FinishReason:
    # vLLM reports "stop" for EOS and stop strings, "length" at max_tokens; an aborted request
    # never reaches here because the worker stops reading it first. Tool calls are reported
    # by the serving layer in its own response; the engine itself only stops.
    return FinishReason.LENGTH if raw == "length" else FinishReason.STOP
