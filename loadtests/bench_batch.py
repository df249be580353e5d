"""Interactive guaranteed calls while a large batch soaks up the worker.

One vLLM CPU worker (2,048 KV tokens, 16 sequences) and one front door (its batch runner on).
First the guaranteed calls alone (the baseline); then a batch of best-effort sessions is
submitted and, once it fills the worker, the same guaranteed calls again. Reported: time to
first token of the guaranteed calls (p50/p99/max) in both phases against the 1 s objective,
the batch's progress meanwhile, then the batch is cancelled.

Run: ``.venv/bin/python -m loadtests.bench_batch --out loadtests/results/batch.json``
(about 2 minutes; builds the dev model in a temporary directory unless ``--model``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from loadtests import stats
from loadtests.bench_worker import (
    BURST_BLOCKS,
    FAILURES,
    ensure_model,
    on_kvgate,
    stream_call,
)
from loadtests.targets import KvgateStack

OBJECTIVE_S = 1.0


def batch_lines(sessions: int, calls: int, max_tokens: int) -> list[dict[str, Any]]:
    return [
        {
            "custom_id": f"s{s}-c{c}",
            "session": f"s{s}",
            "body": {
                "model": "kvgate-dev",
                "messages": [{"role": "user", "content": f"batch session {s} step {c}"}],
                "max_tokens": max_tokens,
                "ignore_eos": True,
            },
        }
        for s in range(sessions)
        for c in range(calls)
    ]


async def guaranteed_round(client: httpx.AsyncClient, calls: int, waves: int) -> list[float]:
    ttfts: list[float] = []
    for _ in range(waves):
        results = await asyncio.gather(
            *(stream_call(client, 16, "guaranteed") for _ in range(calls))
        )
        ttfts += [float(r["ttft"]) for r in results if r["ttft"] is not None]
        await asyncio.sleep(0.5)
    return ttfts


def summary(ttfts: list[float]) -> dict[str, Any]:
    cuts = stats.summary(ttfts, (50, 99), ndigits=3)
    return {
        "calls": len(ttfts),
        "p50_s": cuts["p50"],
        "p99_s": cuts["p99"],
        "max_s": round(max(ttfts), 3),
        "within_objective": round(sum(t <= OBJECTIVE_S for t in ttfts) / len(ttfts), 3),
    }


async def run(stack: KvgateStack, args: argparse.Namespace) -> dict[str, Any]:
    async with httpx.AsyncClient(base_url=stack.base_url, timeout=120) as client:
        await guaranteed_round(client, 2, 2)  # warm-up
        alone = await guaranteed_round(client, args.calls, args.waves)
        lines = batch_lines(args.sessions, 3, args.batch_tokens)
        resp = await client.post("/v1/batches", json={"requests": lines})
        resp.raise_for_status()
        batch_id = resp.json()["id"]
        async with asyncio.timeout(120):
            while True:  # the batch's progress lives in the front door: poll it
                counts = (await client.get(f"/v1/batches/{batch_id}")).json()["request_counts"]
                if counts["running"] >= args.fill:
                    break
                await asyncio.sleep(0.2)
        started = time.monotonic()
        before = (await client.get(f"/v1/batches/{batch_id}")).json()["request_counts"]
        during = await guaranteed_round(client, args.calls, args.waves)
        after = (await client.get(f"/v1/batches/{batch_id}")).json()
        seconds = time.monotonic() - started
        await client.post(f"/v1/batches/{batch_id}/cancel")
    return {
        "guaranteed_alone": summary(alone),
        "guaranteed_during_batch": summary(during),
        "batch": {
            "lines": len(lines),
            "status_while_measured": after["status"],
            "completed_while_measured": after["request_counts"]["completed"] - before["completed"],
            "seconds_measured": round(seconds, 1),
            "running_at_start": before["running"],
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: build one in a temp dir)")
    parser.add_argument("--out", default="loadtests/results/batch.json")
    parser.add_argument("--sessions", type=int, default=200)
    parser.add_argument("--batch-tokens", type=int, default=256)
    parser.add_argument("--calls", type=int, default=4, help="guaranteed calls per wave")
    parser.add_argument("--waves", type=int, default=8)
    parser.add_argument(
        "--fill",
        type=int,
        default=6,
        help="batch calls in flight that count as a full worker (default 6: about what "
        "2,048 KV tokens hold of calls of ~270 tokens with the guaranteed reserve kept; "
        "admission admits no more of the batch than the worker can start)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="kvgate-bench-") as tmp:
        root = Path(tmp)
        model = ensure_model(args.model, root)
        result = asyncio.run(on_kvgate(model, BURST_BLOCKS, root, lambda s: run(s, args)))
    report = {
        "command": "python -m loadtests.bench_batch " + " ".join(sys.argv[1:]),
        "when": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "objective_ttft_s": OBJECTIVE_S,
        "engine": "vLLM CPU, dev model, 16 sequences, 64 blocks of 32 tokens",
        **result,
        "failed_calls": FAILURES,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
