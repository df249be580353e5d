"""The vLLM engine behind ``workers.engine.Engine``: ``AsyncLLM`` embedded in the worker process.

The same code serves the CUDA build (``pip install kvgate[gpu]``) and the CPU build
(``kvgate[cpu]``): both ship the ``vllm`` module with the same ``AsyncLLM`` API. Only the
engine arguments differ, and those come from ``VllmEngineConfig``.
"""

from __future__ import annotations

import gc
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from schemas.vocab import ErrorCode, FinishReason
from workers.engine import (
    EngineDeadError,
    EngineDelta,
    EngineError,
    EngineRequest,
    EngineRequestError,
    EngineStats,
    PreparedRequest,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VllmEngineConfig:
    model: str
    served_model_name: str
    max_model_len: int = 2048
    max_num_seqs: int = 16
    block_size: int | None = None
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    dtype: str = "auto"
    enforce_eager: bool = False
    seed: int = 0
    # The CPU build sizes its KV cache from this variable (GiB); ignored by the CUDA build.
    cpu_kvcache_space_gib: int = 1


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


class VllmEngine:
    """Start with ``await VllmEngine.start(config)``; start-up loads the model (seconds)."""

    def __init__(self, llm: Any, config: VllmEngineConfig, reading: _SchedulerReading) -> None:
        self._llm = llm
        self._config = config
        self._reading = reading
        self._tokenizer = llm.get_tokenizer()
        cache = llm.vllm_config.cache_config
        blocks = cache.num_gpu_blocks
        self._block_size = int(cache.block_size)
        self._kv_capacity_tokens = int(blocks) * self._block_size if blocks else None
        self._max_model_len = int(llm.model_config.max_model_len)

    @classmethod
    async def start(cls, config: VllmEngineConfig) -> VllmEngine:
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(config.cpu_kvcache_space_gib))
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            model=config.model,
            served_model_name=[config.served_model_name],
            tokenizer=config.model,
            max_model_len=config.max_model_len,
            max_num_seqs=config.max_num_seqs,
            block_size=config.block_size,
            num_gpu_blocks_override=config.num_gpu_blocks_override,
            kv_cache_memory_bytes=config.kv_cache_memory_bytes,
            gpu_memory_utilization=config.gpu_memory_utilization,
            dtype=config.dtype,
            enforce_eager=config.enforce_eager,
            seed=config.seed,
            scheduling_policy="priority",
            # The stat logger below still receives scheduler stats; this only turns off
            # vLLM's own periodic log lines.
            disable_log_stats=True,
        )
        reading = _SchedulerReading()
        llm = AsyncLLM.from_engine_args(args, stat_loggers=[_stat_logger_factory(reading)])
        engine = cls(llm, config, reading)
        await engine._warm_up()
        return engine

    async def _warm_up(self) -> None:
        """Run one tiny request before serving: the first request through a fresh engine pays
        one-off set-up costs (seconds on CPU) that must not land on a caller's first token."""
        from schemas.wire import ChatMessage, SamplingParams

        request = EngineRequest(
            "kvgate-warmup", (ChatMessage("user", "warm up"),), SamplingParams(max_tokens=2), 0
        )
        async for _ in self.generate(self.prepare(request)):
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

    def prepare(self, request: EngineRequest) -> PreparedRequest:
        text = self._tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in request.messages],
            tokenize=False,
            add_generation_prompt=True,
        )
        ids = tuple(self._tokenizer.encode(text, add_special_tokens=False))
        if len(ids) + request.sampling.max_tokens > self._max_model_len:
            raise EngineRequestError(
                ErrorCode.CONTEXT_LENGTH_EXCEEDED,
                f"prompt ({len(ids)} tokens) plus max_tokens ({request.sampling.max_tokens}) "
                f"exceeds the model's context of {self._max_model_len} tokens",
            )
        return PreparedRequest(request, ids)

    def _sampling_params(self, request: EngineRequest) -> Any:
        from vllm.sampling_params import RequestOutputKind, SamplingParams

        s = request.sampling
        return SamplingParams(
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            stop=list(s.stop) or None,
            seed=s.seed,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
            ignore_eos=s.ignore_eos,
            output_kind=RequestOutputKind.DELTA,
        )

    async def generate(self, prepared: PreparedRequest) -> AsyncIterator[EngineDelta]:
        from vllm.inputs import TokensPrompt
        from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDead

        request = prepared.request
        prompt_ids = list(prepared.prompt_token_ids)
        try:
            params = self._sampling_params(request)
        except ValueError as exc:
            raise EngineRequestError(ErrorCode.INVALID_PARAMETER, str(exc)) from exc

        completion_tokens = 0
        try:
            async for output in self._llm.generate(
                TokensPrompt(prompt_token_ids=prompt_ids),
                params,
                request.request_id,
                priority=request.priority,
            ):
                completion = output.outputs[0]
                completion_tokens += len(completion.token_ids)
                finish = _finish_reason(completion.finish_reason) if output.finished else None
                yield EngineDelta(
                    text=completion.text,
                    new_tokens=len(completion.token_ids),
                    prompt_tokens=len(prompt_ids),
                    completion_tokens=completion_tokens,
                    finish_reason=finish,
                )
        except VllmEngineDead as exc:
            raise EngineDeadError(str(exc)) from exc
        except EngineError:
            raise
        except ValueError as exc:
            raise EngineRequestError(ErrorCode.INVALID_PARAMETER, str(exc)) from exc
        except Exception as exc:
            if self._llm.errored:
                raise EngineDeadError(str(exc)) from exc
            raise EngineError(str(exc)) from exc

    async def abort(self, request_id: str) -> None:
        await self._llm.abort(request_id)

    def shutdown(self) -> None:
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.shutdown()
            # AsyncLLM.__del__ shuts down again; let it run now, while the interpreter is
            # whole, rather than during interpreter teardown where it fails noisily.
            del llm
            gc.collect()


def _finish_reason(raw: str | None) -> FinishReason:
    # vLLM reports "stop" for EOS and stop strings, "length" at max_tokens; an aborted request
    # never reaches here because the worker stops reading it first.
    return FinishReason.LENGTH if raw == "length" else FinishReason.STOP
