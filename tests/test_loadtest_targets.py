"""The harness runs the kvgate code it is pointed at: a comparison with another checkout first on
``PYTHONPATH`` measures that checkout, not the working directory's."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from loadtests.targets import CODE_UNDER_TEST_ENV

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
