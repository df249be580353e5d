"""A front door reachable from the network is never open by accident (issue 14, item 1): with
no tenants file every caller is the development tenant, so binding to anything but loopback
needs a tenants file or an explicit opt-in."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
from pydantic import ValidationError

from broker.settings import ApiSettings, is_loopback
from kvgate.cli import main


@pytest.fixture(autouse=True)
def no_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("KVGATE_TENANTS_FILE", "KVGATE_ALLOW_OPEN_NETWORK", "KVGATE_HOST"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_loopback_binds_need_no_tenants(host: str) -> None:
    assert is_loopback(host)
    assert ApiSettings(host=host).host == host


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "kvgate.internal"])
def test_an_open_bind_without_tenants_is_refused_by_name(host: str) -> None:
    with pytest.raises(ValidationError, match="KVGATE_ALLOW_OPEN_NETWORK"):
        ApiSettings(host=host)


def test_a_tenants_file_or_the_opt_in_allows_an_open_bind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert ApiSettings(host="0.0.0.0", tenants_file=tmp_path / "tenants.toml").host == "0.0.0.0"
    monkeypatch.setenv("KVGATE_ALLOW_OPEN_NETWORK", "true")
    assert ApiSettings(host="0.0.0.0").allow_open_network


@pytest.mark.parametrize("command", ["api", "up"])
def test_the_commands_refuse_before_starting_anything(
    command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # What earlier tests left for the collector (an unclosed client's task, which asyncio
    # reports when it is collected) is collected now, not into this command's stderr.
    gc.collect()
    capsys.readouterr()
    assert main([command, "--host", "0.0.0.0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvgate {command}: ")
    assert "KVGATE_TENANTS_FILE" in err and "Traceback" not in err
