"""Added time to first token at low load: kvgate (front door, JetStream, worker) against vLLM's
own OpenAI server, on the same engine configuration, one streamed call at a time.

Both targets run side by side in one invocation and are measured in alternating rounds (A, B,
A, B...), so that the machine's drift lands on both. Reported: TTFT p50/p99 per target and the
difference, per round and over all rounds.

    python -m loadtests.bench_ttft --model .kvgate/model --out loadtests/results/ttft.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from loadtests import stats
from loadtests.targets import DirectVllm, EngineConfig, KvgateStack


async def ttft_s(http: aiohttp.ClientSession, base_url: str, max_tokens: int) -> float:
    """One streamed chat call; the time until its first content chunk."""
    body = {
        "model": "kvgate-dev",
        "messages": [{"role": "user", "content": "plan the next step of the agent"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
    }
    started = time.perf_counter()
    first: float | None = None
    async with http.post(base_url + "/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        buffer = b""
        async for data in resp.content.iter_any():
            buffer += data
            if first is None and b'"content":"' in buffer.replace(b'"content":""', b""):
                first = time.perf_counter() - started
    if first is None:
        raise RuntimeError("the stream carried no content")
    return first


def quantiles(values: list[float]) -> dict[str, Any]:
    """p50 and p99 in milliseconds of TTFTs in seconds, and their count."""
    cuts = stats.summary([v * 1000 for v in values], (50, 99))
    return {"p50_ms": cuts["p50"], "p99_ms": cuts["p99"], "n": cuts["n"]}


async def measure(model: Path, rounds: int, calls: int, max_tokens: int) -> dict[str, Any]:
    engine = EngineConfig(model=model)
    samples: dict[str, list[float]] = {"direct": [], "kvgate": []}
    per_round: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvgate-ttft-") as tmp:
        root = Path(tmp)
        (root / "d").mkdir()
        (root / "k").mkdir()
        direct = DirectVllm(engine, root / "d")
        kvgate = KvgateStack(engine, root / "k", heartbeat_s=0.5, extra_env={})
        try:
            await direct.start()
            await kvgate.start()
            async with aiohttp.ClientSession() as http:
                for target in (direct.base_url, kvgate.base_url):  # warm both up
                    for _ in range(5):
                        await ttft_s(http, target, max_tokens)
                for r in range(rounds):
                    this: dict[str, list[float]] = {"direct": [], "kvgate": []}
                    for name, url in (("direct", direct.base_url), ("kvgate", kvgate.base_url)):
                        for _ in range(calls):
                            this[name].append(await ttft_s(http, url, max_tokens))
                    for name, values in this.items():
                        samples[name] += values
                    row: dict[str, Any] = {n: quantiles(v) for n, v in this.items()}
                    row["added_p50_ms"] = row["kvgate"]["p50_ms"] - row["direct"]["p50_ms"]
                    per_round.append(row)
                    print(f"round {r + 1}: {json.dumps(row)}", flush=True)
        finally:
            await kvgate.close()
            kvgate.stop()
            direct.stop()
    overall = {name: quantiles(values) for name, values in samples.items()}
    return {
        "engine": engine.to_json(),
        "calls_per_round": calls,
        "max_tokens": max_tokens,
        "rounds": per_round,
        "overall": overall,
        "added_p50_ms": overall["kvgate"]["p50_ms"] - overall["direct"]["p50_ms"],
        "added_p99_ms": overall["kvgate"]["p99_ms"] - overall["direct"]["p99_ms"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="model directory (kvgate model build)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=40, help="calls per target per round")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--out", default="loadtests/results/ttft-latest.json")
    args = parser.parse_args()
    result = asyncio.run(measure(Path(args.model), args.rounds, args.calls, args.max_tokens))
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("overall", "added_p50_ms", "added_p99_ms")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
