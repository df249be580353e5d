"""A worker's settings: one model, read from ``KVGATE_WORKER_*`` environment variables, with the
engine's settings and the headroom policy nested in it.

``kvgate worker``'s command-line flags are generated from these fields (``kvgate.cli``), so a
setting is declared once, here: its name (the flag ``--max-num-seqs`` and the variable
``KVGATE_WORKER_MAX_NUM_SEQS``), its type, bounds, default and the help text. The nested
groups read the same flat variable names as before they were nested, so an operator's
environment keeps its meaning.
"""

from __future__ import annotations

import argparse
import os
import shlex
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

from pydantic import Field
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsConfigDict

from broker.natsconn import NatsClientSettings
from broker.settings import DEFAULT_NATS_PORT, StreamSettings
from workers.headroom import HeadroomPolicy

_ENV = SettingsConfigDict(env_prefix="KVGATE_WORKER_", extra="ignore", populate_by_name=True)
_POLICY = HeadroomPolicy()
"""The headroom policy's defaults, declared once, on the pure policy itself."""


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


class EngineSettings(BaseSettings):
    """What vLLM is started with: ``vllm serve``'s own options, kvgate's names for them."""

    model_config = _ENV

    model: Path = Field(default=Path(".kvgate/model"), description="model directory")
    served_model_name: str = Field(
        default="kvgate-dev",
        validation_alias="KVGATE_SERVED_MODEL_NAME",
        description="the model name calls use",
    )
    max_model_len: int = Field(default=2048, ge=1, description="longest sequence, in tokens")
    max_num_seqs: int = Field(default=16, ge=1, description="sequences the engine runs at once")
    block_size: int | None = Field(default=None, ge=1, description="KV cache block, in tokens")
    num_gpu_blocks_override: int | None = Field(
        default=None, ge=1, description="KV cache size in blocks (instead of measuring memory)"
    )
    kv_cache_memory_bytes: int | None = Field(
        default=None, ge=1, description="KV cache size in bytes (instead of a memory share)"
    )
    gpu_memory_utilization: float = Field(
        default=0.9, gt=0, le=1, description="share of GPU memory the engine may take"
    )
    dtype: str = Field(default="auto", description="weights' data type")
    enforce_eager: bool = Field(default=False, description="no CUDA graphs")
    seed: int = Field(default=0, description="sampling seed")
    cpu_kvcache_space_gib: int = Field(
        default=1,
        ge=1,
        description="KV cache size of the CPU build, GiB (VLLM_CPU_KVCACHE_SPACE; the CUDA "
        "build ignores it)",
    )
    vllm_args: str = Field(
        default="",
        description="further `vllm serve` options as on its command line (`--tool-call-parser "
        "hermes --enable-auto-tool-choice`), parsed by vLLM's own parser; they follow the model "
        "folder's own defaults (kvgate-serve-args.json), so they win",
    )

    @property
    def serve_args(self) -> list[str]:
        return shlex.split(self.vllm_args)


class HeadroomSettings(BaseSettings):
    """The KV headroom policy (``workers.headroom``) as the operator sets it."""

    model_config = _ENV

    kv_high_water: float = Field(
        default=_POLICY.high_water,
        gt=0,
        le=2,
        description=(
            "share of the KV cache that calls below the guaranteed tier may commit by their"
            " predicted peak; above 1 the engine's preemption is the safety valve"
        ),
    )
    kv_low_water: float = Field(
        default=_POLICY.low_water,
        ge=0,
        lt=1,
        description="below this share of free KV cache, fetch nothing",
    )
    max_waiting: int = Field(
        default=_POLICY.max_waiting,
        ge=0,
        description="calls allowed beyond max_num_seqs (they wait inside the engine)",
    )
    starvation_s: float = Field(
        default=_POLICY.starvation_s,
        gt=0,
        description="the longest a lower tier waits behind higher ones before it goes first",
    )
    guaranteed_reserve: float = Field(
        default=_POLICY.guaranteed_reserve,
        ge=0,
        lt=1,
        description="share of the KV cache above the high-water mark only guaranteed calls use",
    )

    kv_fallback_high_water: float = Field(
        default=_POLICY.fallback_high_water,
        gt=0,
        le=1,
        description=(
            "where the high-water mark falls when the engine preempts (if the mark is above"
            " it); it climbs back over overcommit_recover_s"
        ),
    )
    overcommit_recover_s: float = Field(
        default=_POLICY.overcommit_recover_s,
        gt=0,
        description="seconds without a preemption for the mark to climb back to kv_high_water",
    )
    rescue_after: float = Field(
        default=_POLICY.rescue_after,
        ge=0,
        le=1,
        description=(
            "share of its time-to-first-token objective a call waits for room before it may"
            " start past the mark, in the rescue allowance"
        ),
    )
    rescue_overcommit: float = Field(
        default=_POLICY.rescue_overcommit,
        ge=0,
        le=1,
        description=(
            "the rescue allowance: share of the KV cache past the mark that calls about to miss"
            " their time-to-first-token objective may commit (0: off; the engine preempts where"
            " it must)"
        ),
    )

    def policy(self) -> HeadroomPolicy:
        return HeadroomPolicy(
            high_water=self.kv_high_water,
            fallback_high_water=self.kv_fallback_high_water,
            overcommit_recover_s=self.overcommit_recover_s,
            low_water=self.kv_low_water,
            max_waiting=self.max_waiting,
            starvation_s=self.starvation_s,
            guaranteed_reserve=self.guaranteed_reserve,
            rescue_after=self.rescue_after,
            rescue_overcommit=self.rescue_overcommit,
        )


class WorkerSettings(BaseSettings):
    model_config = _ENV

    nats_url: str = Field(
        default=f"nats://127.0.0.1:{DEFAULT_NATS_PORT}",
        validation_alias="KVGATE_NATS_URL",
        description="the NATS server",
    )
    worker_id: str = Field(
        default_factory=default_worker_id, description="default: host, process id and a suffix"
    )
    heartbeat_interval_s: float = Field(default=2.0, gt=0, description="between heartbeats")
    reading_interval_s: float = Field(
        default=0.5,
        gt=0,
        description="the soonest a heartbeat follows the last one when calls were staged,"
        " started or ended since (at most heartbeat_interval_s)",
    )
    pull_expires_s: float = Field(
        default=10.0,
        gt=0.1,
        description="how long one pull request waits at the server before it is renewed",
    )
    drain_grace_s: float = Field(
        default=30.0,
        ge=0,
        description="on SIGTERM, how long calls in flight may run before they are handed back",
    )
    nak_delay_s: float = Field(
        default=1.0, ge=0, description="redelivery delay of a call handed back"
    )
    caller_probe_s: float = Field(
        default=2.0,
        ge=0,
        description="how often a held call's caller is asked whether it still waits; a call"
        " whose front door is gone is ended (0: never asked)",
    )
    stream_gather_tokens: int = Field(
        default=8,
        ge=1,
        description="tokens of a streamed answer sent in one event once its first ones have "
        "gone one by one (workers.relay.ReplyRelay; 1: every token its own event)",
    )
    engine: EngineSettings = Field(default_factory=EngineSettings)
    headroom: HeadroomSettings = Field(default_factory=HeadroomSettings)
    stream: StreamSettings = Field(default_factory=StreamSettings)
    nats: NatsClientSettings = Field(default_factory=NatsClientSettings)


# -- the command line, generated from the model ----------------------------------------------
#
# pydantic-settings has a command-line source of its own, but it names a nested field by its
# path (``--engine.max_num_seqs``); kvgate's flags keep the flat names of the environment
# variables, which the nested groups also keep. A value is checked by the model, not by
# argparse: a flag takes a string, and a bad one gets the model's own error.

_GROUPS: dict[str, type[BaseSettings]] = {"engine": EngineSettings, "headroom": HeadroomSettings}
_NOT_FLAGS = frozenset({"stream", "nats"})
"""The stream layout and the way into NATS are the operator's, shared with the front door:
KVGATE_STREAM_* and KVGATE_NATS_* only."""


def _flag_fields() -> Iterator[tuple[str | None, str, FieldInfo]]:
    """(group or None, field name, field) for every setting a flag may give."""
    for name, info in WorkerSettings.model_fields.items():
        if name in _GROUPS:
            for inner, inner_info in _GROUPS[name].model_fields.items():
                yield name, inner, inner_info
        elif name not in _NOT_FLAGS:
            yield None, name, info


def _env_name(name: str, info: FieldInfo) -> str:
    alias = info.validation_alias
    return alias if isinstance(alias, str) else f"KVGATE_WORKER_{name.upper()}"


def worker_env(**values: object) -> dict[str, str]:
    """The environment variables that give a ``kvgate worker`` child process these settings
    (field names of any group). A name the model does not know raises ``KeyError``: a
    misspelt variable would be ignored by the child, silently."""
    known = {name: info for _, name, info in _flag_fields()}
    env: dict[str, str] = {}
    for name, value in values.items():
        if name not in known:
            raise KeyError(f"no worker setting {name!r}")
        text = str(value).lower() if isinstance(value, bool) else str(value)
        env[_env_name(name, known[name])] = text
    return env


def add_flags(parser: argparse.ArgumentParser) -> None:
    """One ``--flag`` per setting, named, typed and explained by the model."""
    for _, name, info in _flag_fields():
        env = _env_name(name, info)
        if info.default_factory is not None:
            default = ""
        else:
            default = "; unset by default" if info.default is None else f"; default {info.default}"
        help_text = f"{info.description} ({env}{default})"
        flag = "--" + name.replace("_", "-")
        if info.annotation is bool:
            parser.add_argument(
                flag, dest=name, action=argparse.BooleanOptionalAction, help=help_text
            )
        else:
            parser.add_argument(flag, dest=name, metavar=name.upper(), help=help_text)


def from_flags(args: argparse.Namespace) -> WorkerSettings:
    """The settings from the environment, with the flags given on top (raises pydantic's
    ``ValidationError`` for a bad value)."""
    given: dict[str | None, dict[str, object]] = {None: {}, **{group: {} for group in _GROUPS}}
    for group, name, _ in _flag_fields():
        value = getattr(args, name, None)
        if value is not None:
            given[group][name] = value
    return WorkerSettings(
        # Built here, not from dicts inside WorkerSettings: a nested settings model validated
        # from a dict would not read its environment variables.
        engine=EngineSettings(**given["engine"]),  # type: ignore[arg-type]
        headroom=HeadroomSettings(**given["headroom"]),  # type: ignore[arg-type]
        **given[None],  # type: ignore[arg-type]
    )
