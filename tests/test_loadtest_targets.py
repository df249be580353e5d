"""The harness runs the kvgate code it is pointed at: a comparison with another checkout first on
``PYTHONPATH`` measures that checkout, not the working directory's; and a harness stopped with
SIGTERM stops what it started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from loadtests.targets import CODE_UNDER_TEST_ENV, TERMINATED_EXIT

REPO = Path(__file__).resolve().parents[1]


def test_a_checkout_on_pythonpath_wins_over_the_working_directory(tmp_path: Path) -> None:
    other = tmp_path / "other-checkout" / "schemas"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("")
    (other / "vocab.py").write_text("print('the other checkout')\n")

    def run_from_this_tree(extra: dict[str, str]) -> str:
        # As the harness starts kvgate's processes: `python -m`, in this tree's directory.
        env = {**os.environ, "PYTHONPATH": str(other.parent), **extra}
        done = subprocess.run(
            [sys.executable, "-m", "schemas.vocab"],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        )
        return done.stdout.strip()

    # Without it, `python -m` put the working directory first: this tree ran on both sides.
    assert run_from_this_tree({}) == ""
    assert run_from_this_tree(CODE_UNDER_TEST_ENV) == "the other checkout"


EXIT_BOUND_S = 60.0
"""How long the terminated harness may take to exit: generous, it only bounds a failing test."""

HARNESS = """
import asyncio, sys
from pathlib import Path
from loadtests.targets import run_until_terminated

async def sweep():
    try:
        print("started", flush=True)
        await asyncio.sleep(3600)
    finally:
        Path(sys.argv[1]).write_text("stopped what it started")

sys.exit(143 if run_until_terminated(sweep()) is None else 0)
"""


def test_sigterm_runs_the_harness_cleanup_before_it_exits(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    with subprocess.Popen(
        [sys.executable, "-c", HARNESS, str(marker)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    ) as proc:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "started"
        proc.send_signal(signal.SIGTERM)
        # Without the handler SIGTERM ended it there (-15), and the cleanup never ran.
        assert proc.wait(timeout=EXIT_BOUND_S) == TERMINATED_EXIT == 143
    assert marker.read_text() == "stopped what it started"
