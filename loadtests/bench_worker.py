"""Worker benchmarks on the real vLLM engine (CPU build here; the same code drives a GPU).

1. Throughput efficiency at saturation: output tokens/s through kvgate (front door, JetStream,
   worker) / the same engine configuration driven directly in-process, same prompts, one run;
   and / the same engine behind vLLM's own OpenAI server (``vllm serve``), driven by the same
   HTTP client. Each server's CPU time per output token, by process, beside it.
2. Burst: 3x what the worker's KV cache holds, best-effort, then guaranteed calls on top:
   peak KV usage against the high-water mark, preemptions, the engine's waiting queue, and
   time to first token per tier.

Run: ``.venv/bin/python -m loadtests.bench_worker --out loadtests/results/worker.json``
(about 5 minutes on a 2-core machine). Both modes use the engine settings in ``ENGINE_ENV``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
import psutil

from kvgate.cli import COMMAND
from loadtests import stats
from loadtests.targets import DirectVllm, EngineConfig, KvgateStack
from workers.headroom import HeadroomPolicy
from workers.settings import worker_env

T = TypeVar("T")

ENGINE_ENV = {
    **worker_env(
        max_num_seqs=16,
        block_size=32,
        max_model_len=1024,
        enforce_eager=True,
        heartbeat_interval_s=0.5,
    ),
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
}
# Throughput: KV large enough that sequences, not KV, bound the batch in both modes
# (16 x 288-token calls = 4,608 tokens, under kvgate's 0.75 non-guaranteed share of 8,192).
THROUGHPUT_BLOCKS = "256"
# Burst: a small cache (2,048 tokens) so that 40 calls of 160 tokens are 3.1x of it.
BURST_BLOCKS = "64"

PROMPT = "the agent reads the file and writes the plan for the next step"

# Calls that did not succeed, with status and body: reported, never silently dropped.
FAILURES: list[str] = []


# -- direct: the engine in-process, no broker ------------------------------------------------


async def run_direct(model: Path, calls: int, max_tokens: int) -> dict[str, Any]:
    from schemas.vocab import Endpoint
    from workers.engine import EngineRequest
    from workers.settings import EngineSettings
    from workers.vllm_engine import VllmEngine

    config = EngineSettings(model=model)
    engine = await VllmEngine.start(config)
    try:

        async def one(i: int) -> int:
            body = {
                "model": config.served_model_name,
                "messages": [{"role": "user", "content": PROMPT}],
                "max_tokens": max_tokens,
                "ignore_eos": True,
                "stream": True,
            }
            request = EngineRequest(
                f"direct-{i}", Endpoint.CHAT_COMPLETIONS, body, max_tokens, priority=1
            )
            tokens = 0
            async for output in engine.generate(await engine.prepare(request)):
                tokens += output.new_tokens
            return tokens

        started = time.monotonic()
        tokens = await asyncio.gather(*(one(i) for i in range(calls)))
        elapsed = time.monotonic() - started
        return {
            "output_tokens": sum(tokens),
            "seconds": elapsed,
            "tokens_per_s": sum(tokens) / elapsed,
            "preemptions": engine.stats().num_preemptions,
        }
    finally:
        engine.shutdown()


# -- through kvgate ------------------------------------------------------------------------


# This benchmark measures the worker's pull gate under overload: admission lets the whole
# burst in (16 caches' worth of one-call sessions) and the guaranteed tier is open to the
# development tenant.
BENCH_ADMISSION = {"KVGATE_ADMISSION_KV_OVERCOMMIT": "16", "KVGATE_DEV_TENANT_TIER": "guaranteed"}


async def on_kvgate(
    model: Path, blocks: str, root: Path, run: Callable[[KvgateStack], Awaitable[T]]
) -> T:
    """``run`` against NATS, one worker (``ENGINE_ENV``'s engine) and the front door."""
    engine = EngineConfig(model=model, num_blocks=int(blocks))
    stack = KvgateStack(engine, root, heartbeat_s=0.5, extra_env=BENCH_ADMISSION)
    try:
        await stack.start()
        return await run(stack)
    finally:
        await stack.close()
        stack.stop()


async def stream_call(
    client: httpx.AsyncClient, max_tokens: int, tier: str
) -> dict[str, float | int | None]:
    payload = {
        "model": "kvgate-dev",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.monotonic()
    ttft: float | None = None
    tokens = 0
    async with client.stream(
        "POST", "/v1/chat/completions", json=payload, headers={"X-Kvgate-Tier": tier}
    ) as resp:
        if resp.status_code != 200:
            FAILURES.append(f"{resp.status_code} {(await resp.aread())[:200]!r}")
            return {"ttft": None, "tokens": 0, "seconds": time.monotonic() - started}
        buffer = ""
        async for text in resp.aiter_text():
            buffer += text
            *lines, buffer = buffer.split("\n")
            for line in lines:
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                elif ttft is None and chunk["choices"][0]["delta"].get("content"):
                    ttft = time.monotonic() - started
    return {"ttft": ttft, "tokens": tokens, "seconds": time.monotonic() - started}


async def plain_call(client: httpx.AsyncClient, max_tokens: int, tier: str) -> int:
    payload = {
        "model": "kvgate-dev",
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
    }
    resp = await client.post("/v1/chat/completions", json=payload, headers={"X-Kvgate-Tier": tier})
    resp.raise_for_status()
    return int(resp.json()["usage"]["completion_tokens"])


class CpuMeter:
    """CPU seconds (user and system) of the processes behind a server, by role, and of this
    process, the load client. A role's child processes (a worker's or ``vllm serve``'s engine
    core) are counted apart, as ``<role>_children``. CPU per output token moves less than tokens
    per second with what else the host runs, though not nothing: processes that share a core
    each take more CPU for the same work."""

    def __init__(self, roles: dict[str, int]) -> None:
        self._roles = {role: psutil.Process(pid) for role, pid in roles.items()}
        self._client = psutil.Process()

    def read(self) -> dict[str, float]:
        def cpu(procs: list[psutil.Process]) -> float:
            total = 0.0
            for p in procs:
                with contextlib.suppress(psutil.NoSuchProcess):
                    times = p.cpu_times()
                    total += times.user + times.system
            return total

        readings = {"client": cpu([self._client])}
        for role, proc in self._roles.items():
            readings[role] = cpu([proc])
            children = proc.children(recursive=True)
            if children:
                readings[f"{role}_children"] = cpu(children)
        return readings


async def run_http_throughput(
    base_url: str, calls: int, max_tokens: int, meter: CpuMeter
) -> dict[str, dict[str, Any]]:
    """``calls`` calls at once through an OpenAI-compatible server (kvgate's front door or
    ``vllm serve``), streamed, then not streamed, by the same client."""
    limits = httpx.Limits(max_connections=calls + 8)
    report: dict[str, dict[str, Any]] = {}
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        await stream_call(client, 4, "standard")  # first call through the HTTP path
        for mode in ("streamed", "non_streamed"):
            cpu_before = meter.read()
            started = time.monotonic()
            if mode == "streamed":
                results = await asyncio.gather(
                    *(stream_call(client, max_tokens, "standard") for _ in range(calls))
                )
                tokens = sum(int(r["tokens"] or 0) for r in results)
            else:
                counts = await asyncio.gather(
                    *(plain_call(client, max_tokens, "standard") for _ in range(calls))
                )
                tokens = sum(counts)
            elapsed = time.monotonic() - started
            cpu_after = meter.read()
            report[mode] = {
                "output_tokens": tokens,
                "seconds": elapsed,
                "tokens_per_s": tokens / elapsed,
                "cpu_us_per_token": {
                    role: round(1e6 * (cpu_after[role] - cpu_before.get(role, 0.0)) / tokens, 1)
                    for role in cpu_after
                }
                if tokens
                else {},
            }
    return report


async def run_kvgate_throughput(
    stack: KvgateStack, calls: int, max_tokens: int
) -> dict[str, dict[str, Any]]:
    meter = CpuMeter(
        {"front_door": stack.api.pid, "worker": stack.worker.pid, "nats": stack.nats.pid or 0}
    )
    return await run_http_throughput(stack.base_url, calls, max_tokens, meter)


async def run_vllm_serve_throughput(
    model: Path, root: Path, calls: int, max_tokens: int
) -> dict[str, dict[str, Any]]:
    """The same engine behind vLLM's own OpenAI server: what an operator runs without kvgate,
    HTTP and the load client's cost included, as they are in kvgate's figures."""
    server = DirectVllm(EngineConfig(model=model, num_blocks=int(THROUGHPUT_BLOCKS)), root)
    try:
        await server.start()
        meter = CpuMeter({"vllm_serve": server.proc.pid})
        return await run_http_throughput(server.base_url, calls, max_tokens, meter)
    finally:
        server.stop()


async def run_burst(stack: KvgateStack) -> dict[str, Any]:
    import nats

    from broker.fleet import FleetView, FleetWatcher
    from broker.settings import StreamSettings
    from broker.streams import workers_bucket

    nc = await nats.connect(stack.nats.url)
    js = nc.jetstream()
    watcher = FleetWatcher(lambda: workers_bucket(js, StreamSettings()), FleetView(max_age_s=3))
    await watcher.start()
    peak = {"kv_cache_usage": 0.0, "num_waiting": 0, "committed_tokens": 0}
    sampling = True

    async def sample() -> None:
        while sampling:
            for hb in watcher.view.live(int(time.time() * 1000)):
                peak["kv_cache_usage"] = max(peak["kv_cache_usage"], hb.kv_cache_usage or 0.0)
                peak["num_waiting"] = max(peak["num_waiting"], hb.num_waiting)
                peak["committed_tokens"] = max(peak["committed_tokens"], hb.committed_tokens)
            await asyncio.sleep(0.05)

    while not watcher.view.live(int(time.time() * 1000)):  # noqa: ASYNC110 - polled view
        await asyncio.sleep(0.05)
    before = watcher.view.live(int(time.time() * 1000))[0]
    sampler = asyncio.create_task(sample())
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=600) as client:
        low = [asyncio.create_task(stream_call(client, 128, "besteffort")) for _ in range(40)]
        await asyncio.sleep(1.0)
        high = [asyncio.create_task(stream_call(client, 16, "guaranteed")) for _ in range(8)]
        guaranteed = await asyncio.gather(*high)
        besteffort = await asyncio.gather(*low)
    await asyncio.sleep(0.6)
    sampling = False
    await sampler
    after = watcher.view.live(int(time.time() * 1000))[0]
    await watcher.stop()
    await nc.close()

    def ttfts(results: list[dict[str, Any]]) -> dict[str, float | None]:
        values = [float(r["ttft"]) for r in results if r["ttft"] is not None]
        cuts = stats.percentiles(values, (50, 99, 100))
        return {"p50": cuts[50], "p99": cuts[99], "max": cuts[100]}

    return {
        "kv_capacity_tokens": after.kv_capacity_tokens,
        "offered_kv_tokens": 40 * 160,
        # The worker's defaults (the bench sets neither): best-effort calls commit up to the
        # mark, guaranteed ones also the reserve above it.
        "high_water": HeadroomPolicy().high_water,
        "guaranteed_reserve": HeadroomPolicy().guaranteed_reserve,
        "peak_kv_cache_usage": peak["kv_cache_usage"],
        "peak_committed_tokens": peak["committed_tokens"],
        "peak_engine_waiting": peak["num_waiting"],
        "preemptions": after.num_preemptions - before.num_preemptions,
        "ttft_guaranteed_s": ttfts(guaranteed),
        "ttft_besteffort_s": ttfts(besteffort),
        "all_completed": all(r["tokens"] == 16 for r in guaranteed)
        and all(r["tokens"] == 128 for r in besteffort),
    }


def ensure_model(given: str | None, root: Path) -> Path:
    """The model directory given, or the dev model built under ``root``."""
    if given:
        return Path(given)
    model = root / "model"
    subprocess.run([*COMMAND, "model", "build", str(model)], check=True)
    return model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--model", help="model directory (default: build one in a temp dir)")
    parser.add_argument("--out", default="loadtests/results/worker-latest.json")
    parser.add_argument(
        "--guaranteed-reserve",
        type=float,
        help="worker's KVGATE_WORKER_GUARANTEED_RESERVE for the throughput run (default 0.15)",
    )
    parser.add_argument("--skip-burst", action="store_true")
    parser.add_argument("--direct-only", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.direct_only:
        os.environ.update(ENGINE_ENV)
        os.environ["KVGATE_WORKER_NUM_GPU_BLOCKS_OVERRIDE"] = THROUGHPUT_BLOCKS
        result = asyncio.run(run_direct(Path(args.model), args.calls, args.max_tokens))
        print(json.dumps(result))
        return 0

    with tempfile.TemporaryDirectory(prefix="kvgate-bench-") as tmp:
        root = Path(tmp)
        model = ensure_model(args.model, root)
        print("direct engine ...", flush=True)
        out = subprocess.run(
            [sys.executable, "-m", "loadtests.bench_worker", "--direct-only", "--model",
             str(model), "--calls", str(args.calls), "--max-tokens", str(args.max_tokens)],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        direct = json.loads(out.stdout.strip().splitlines()[-1])

        print("vllm serve throughput ...", flush=True)
        (root / "v").mkdir()
        served = asyncio.run(
            run_vllm_serve_throughput(model, root / "v", args.calls, args.max_tokens)
        )

        print("kvgate throughput ...", flush=True)
        (root / "t").mkdir()
        if args.guaranteed_reserve is not None:
            os.environ["KVGATE_WORKER_GUARANTEED_RESERVE"] = str(args.guaranteed_reserve)
        through = asyncio.run(
            on_kvgate(
                model,
                THROUGHPUT_BLOCKS,
                root / "t",
                lambda stack: run_kvgate_throughput(stack, args.calls, args.max_tokens),
            )
        )

        os.environ.pop("KVGATE_WORKER_GUARANTEED_RESERVE", None)
        burst: dict[str, Any] = {}
        if not args.skip_burst:
            print("burst ...", flush=True)
            (root / "b").mkdir()
            burst = asyncio.run(on_kvgate(model, BURST_BLOCKS, root / "b", run_burst))

    efficiency = {
        mode: result["tokens_per_s"] / direct["tokens_per_s"] for mode, result in through.items()
    }
    against_serve = {
        mode: result["tokens_per_s"] / served[mode]["tokens_per_s"]
        for mode, result in through.items()
    }
    report: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "engine_env": ENGINE_ENV,
        "throughput": {
            "calls": args.calls,
            "max_tokens": args.max_tokens,
            "direct": direct,
            "vllm_serve": served,
            "kvgate": through,
            "efficiency": efficiency,
            "efficiency_against_vllm_serve": against_serve,
            "guaranteed_reserve": args.guaranteed_reserve,
        },
        "burst": burst,
        "failed_calls": FAILURES,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    for mode, result in through.items():
        print(
            f"throughput ({mode}): direct {direct['tokens_per_s']:.0f} tok/s, vllm serve "
            f"{served[mode]['tokens_per_s']:.0f} tok/s, kvgate {result['tokens_per_s']:.0f} "
            f"tok/s, efficiency {efficiency[mode]:.3f} (against vllm serve "
            f"{against_serve[mode]:.3f}); CPU us per token: kvgate "
            f"{result['cpu_us_per_token']}, vllm serve {served[mode]['cpu_us_per_token']}"
        )
    if burst:
        print(
            f"burst: peak KV {burst['peak_kv_cache_usage']:.2f} "
            f"(high water {burst['high_water']:.2f}), preemptions "
            f"{burst['preemptions']}, peak engine waiting {burst['peak_engine_waiting']}, TTFT p99 "
            f"guaranteed {burst['ttft_guaranteed_s']['p99']:.2f}s / best-effort "
            f"{burst['ttft_besteffort_s']['p99']:.2f}s"
        )
    if FAILURES:
        print(f"{len(FAILURES)} calls failed; first: {FAILURES[0]}")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
