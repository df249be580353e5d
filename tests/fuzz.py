"""schemathesis' command line, every phase (stateful included), against a real front door: NATS,
the front door (a tenants file, an admin token) and a worker on the simulated engine, so that
sessions are admitted and calls answered. The suite runs a bounded version of the same
(``tests/test_openapi.py``); this is the larger run whose figures docs/reliability.md reports.

    python -m tests.fuzz --out loadtests/results/fuzz -- \\
        --phases examples,coverage,fuzzing,stateful --max-examples 200 --seed 42

Everything after ``--`` goes to ``schemathesis run``. Its reports (JUnit, NDJSON) and the front
door's log land in ``--out``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

from broker.natsserver import EmbeddedNats
from tests.contract import contract_front_door, contract_toml
from tests.simworker import sim_worker
from workers.sim_engine import SimEngine, SimEngineConfig

MODEL = "kvgate-sim"
TENANT_KEY = "fuzz-tenant-key"
ADMIN_TOKEN = "fuzz-admin-token"

HOOKS = """import schemathesis

# Batch lines uploaded as JSONL are text.
schemathesis.serializer.alias("application/jsonl", "text/plain")
"""


def prepare(out: Path) -> Path:
    """The run folder: schemathesis' configuration and hooks."""
    out.mkdir(parents=True, exist_ok=True)
    config = out / "schemathesis.toml"
    config.write_text(contract_toml(TENANT_KEY, ADMIN_TOKEN))
    (out / "fuzz_hooks.py").write_text(HOOKS)
    return config


async def fuzz(out: Path, config: Path, args: list[str]) -> int:
    with EmbeddedNats(out / "nats", log_file=out / "nats.log") as server:
        proc, base = contract_front_door(
            server.url, out, TENANT_KEY, ADMIN_TOKEN, KVGATE_SERVED_MODEL_NAME=MODEL
        )
        try:
            engine = SimEngine(
                SimEngineConfig(served_model_name=MODEL, step_s=0.001, kv_capacity_tokens=1 << 20)
            )
            async with sim_worker(engine, server.url, "fuzz-sim", ready_at=base):
                schemathesis = Path(sys.executable).parent / "schemathesis"
                cmd = [
                    str(schemathesis),
                    "--config-file",
                    str(config),
                    "run",
                    f"{base}/openapi.json",
                    "--report",
                    "junit,ndjson",
                    "--report-dir",
                    str(out / "report"),
                    *args,
                ]
                env = {**os.environ, "SCHEMATHESIS_HOOKS": "fuzz_hooks", "PYTHONPATH": str(out)}
                started = time.monotonic()
                child = await asyncio.create_subprocess_exec(*cmd, env=env)
                code = await child.wait()
                print(f"schemathesis exited {code} after {time.monotonic() - started:.0f} s")
                return code
        finally:
            proc.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("loadtests/results/fuzz"))
    parser.add_argument("args", nargs=argparse.REMAINDER, help="after --: schemathesis run's")
    options = parser.parse_args()
    args = options.args[1:] if options.args[:1] == ["--"] else options.args
    return asyncio.run(fuzz(options.out, prepare(options.out), args))


if __name__ == "__main__":
    sys.exit(main())
