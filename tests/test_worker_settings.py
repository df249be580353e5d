"""A worker's settings: one model, the environment variables and the command line generated
from it, the engine's command line and the headroom policy built from it."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from pydantic import ValidationError

from kvgate.cli import main
from workers.headroom import HeadroomPolicy
from workers.settings import (
    EngineSettings,
    HeadroomSettings,
    WorkerSettings,
    add_flags,
    from_flags,
    worker_env,
)
from workers.vllm_engine import serve_argv


def parse(*argv: str) -> WorkerSettings:
    parser = argparse.ArgumentParser()
    add_flags(parser)
    return from_flags(parser.parse_args(list(argv)))


def test_every_setting_has_a_flag_and_the_flags_land_in_their_groups() -> None:
    parser = argparse.ArgumentParser()
    add_flags(parser)
    flags = {a.dest for a in parser._actions if a.dest != "help"}
    fields = (
        set(WorkerSettings.model_fields) - {"engine", "headroom", "stream", "nats"}
        | set(EngineSettings.model_fields)
        | set(HeadroomSettings.model_fields)
    )
    assert flags == fields
    settings = parse(
        "--max-num-seqs", "3", "--kv-high-water", "0.8", "--enforce-eager", "--worker-id", "w9"
    )
    assert settings.engine.max_num_seqs == 3 and settings.engine.enforce_eager
    assert settings.headroom.kv_high_water == 0.8
    assert settings.worker_id == "w9"


def test_flags_win_over_the_environment_which_keeps_its_flat_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in worker_env(max_num_seqs=5, max_model_len=512, max_waiting=2).items():
        monkeypatch.setenv(name, value)
    settings = parse("--max-num-seqs", "7")
    assert settings.engine.max_num_seqs == 7  # the flag
    assert settings.engine.max_model_len == 512  # the same group's variable is still read
    assert settings.headroom.policy().max_waiting == 2
    assert WorkerSettings().engine.max_num_seqs == 5


def test_a_bad_value_is_refused_by_name() -> None:
    with pytest.raises(ValidationError, match="max_num_seqs"):
        parse("--max-num-seqs", "0")
    with pytest.raises(KeyError, match="max_num_seq"):
        worker_env(max_num_seq=4)


def test_the_command_exits_2_with_the_setting_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["worker", "--kv-high-water", "2.5"]) == 2
    assert "kv_high_water" in capsys.readouterr().err


def test_the_headroom_defaults_are_the_policys_own() -> None:
    assert HeadroomSettings().policy() == HeadroomPolicy()


def test_the_engine_command_line_carries_the_settings() -> None:
    argv = serve_argv(
        EngineSettings(
            model=Path("/m"),
            max_num_seqs=3,
            block_size=32,
            vllm_args="--tool-call-parser hermes",
        )
    )
    assert argv[argv.index("--max-num-seqs") + 1] == "3"
    assert argv[argv.index("--block-size") + 1] == "32"
    assert "--num-gpu-blocks-override" not in argv
    assert argv[argv.index("--tool-call-parser") + 1] == "hermes"
    # kvgate orders the engine's queue by tier, whatever the operator passed.
    assert argv[-3:] == ["--scheduling-policy", "priority", "--disable-log-stats"]
