"""The admission benchmark's client keeps its own collector out of what it times
(``loadtests.bench_admission.client_collections_paused``)."""

from __future__ import annotations

import gc

import pytest

from loadtests.bench_admission import client_collections_paused


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_no_collection_runs_inside_a_timed_phase_and_its_garbage_goes_after() -> None:
    collections: list[int] = []

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    gc.callbacks.append(count)
    try:
        with client_collections_paused():
            collections.clear()  # the collection before the phase does not count
            assert not gc.isenabled()
            for _ in range(50_000):  # many times the first generation's threshold
                Cycle()
            assert collections == []
        assert gc.isenabled()
        assert collections, "the phase's garbage is collected once it ends"
        assert not any(isinstance(o, Cycle) for o in gc.get_objects())
    finally:
        gc.callbacks.remove(count)


def test_the_collector_comes_back_when_a_phase_fails() -> None:
    with pytest.raises(RuntimeError), client_collections_paused():
        raise RuntimeError("the phase failed")
    assert gc.isenabled()


def test_asked_not_to_pause_it_leaves_the_collector_on() -> None:
    with client_collections_paused(paused=False):
        assert gc.isenabled()
    assert gc.isenabled()
