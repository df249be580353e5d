"""Every recipe of ``docs/agents.md``, run as it stands against the shared ``stack`` (a real vLLM
CPU worker): each ``python`` block after a ``<!-- recipe: NAME -->`` line, with the front door's
address in place of the one the page names, in a process of its own, as an agent would run it.
Each recipe prints ``session ID`` last; the session must have run its calls and be closed."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.conftest import Stack

PAGE = Path(__file__).resolve().parents[1] / "docs" / "agents.md"
PAGE_URL = "http://localhost:8000/v1"
RECIPE = re.compile(r"<!-- recipe: ([\w-]+) -->\n```python\n(.*?)```", re.DOTALL)
RECIPES = dict(RECIPE.findall(PAGE.read_text()))
RUN_BOUND_S = 120
"""A recipe makes a few calls of 16 tokens: seconds, even with the SDKs' imports on a loaded
machine."""


def test_the_page_has_the_recipes_it_promises() -> None:
    assert set(RECIPES) == {"client", "plain-openai", "openai-agents", "langchain"}
    assert all(PAGE_URL in code for code in RECIPES.values())


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_a_recipe_runs_its_calls_in_a_session_it_closes(stack: Stack, name: str) -> None:
    code = RECIPES[name].replace(PAGE_URL, stack.base_url + "/v1")
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=RUN_BOUND_S
    )
    assert done.returncode == 0, done.stderr[-4000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("session "), done.stdout
    session = httpx.get(f"{stack.base_url}/v1/sessions/{last.split()[1]}", timeout=10).json()
    assert session["state"] == "closed", session
    assert session["calls_started"] >= 1, session
