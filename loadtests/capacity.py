"""Capacity: the highest session arrival rate at which, with no admission at all, at least a
given share of sessions finish within their objectives. Pure search over a probe function."""

from __future__ import annotations

import statistics
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field


@dataclass
class CapacitySearch:
    start: float
    """First rate tried (sessions/s)."""
    step: float = 1.5
    """Each rate tried is the last one times this, up or down."""
    threshold: float = 0.9
    max_probes: int = 8
    repeats: int = 1
    """Traces each rate is probed with (``probe``'s second argument, 0 to ``repeats - 1``): the
    rate holds where most of them do, the median share with an odd count. One trace of a
    30 s window is 13-70 sessions, and one lucky trace passed rates at which direct vLLM then
    served 43-62% of the sweep's own traces at 1x (``loadtests/results/below-capacity-1212d39``,
    ``below-capacity-avx2``)."""
    probes: list[tuple[float, float]] = field(default_factory=list)
    """(rate, median share of sessions good over its traces) for every rate probed, in order."""
    shares: list[tuple[float, ...]] = field(default_factory=list)
    """Each probe's shares, one a trace run: a probe stops once most traces held or failed."""

    def __post_init__(self) -> None:
        if self.repeats < 1:
            raise ValueError(f"a capacity probe runs at least one trace, not {self.repeats}")

    async def run(self, probe: Callable[[float, int], Awaitable[float]]) -> float:
        """Climb from ``start`` by ``step`` while the share holds (or step down while it does
        not), then probe once between the last rate that held and the first that did not
        (their geometric mean). Returns the highest rate that held; if none held within
        ``max_probes``, the lowest rate tried (``probes`` shows that it failed)."""
        rate = self.start
        passed: float | None = None
        failed: float | None = None
        while len(self.probes) < self.max_probes:
            held = await self._probe(probe, rate)
            if held:
                passed = rate if passed is None else max(passed, rate)
            else:
                failed = rate if failed is None else min(failed, rate)
            if passed is not None and failed is not None:
                break
            rate = rate * self.step if held else rate / self.step
        if passed is not None and failed is not None and len(self.probes) < self.max_probes:
            middle = (passed * failed) ** 0.5
            if await self._probe(probe, middle):
                passed = middle
        if passed is None:
            return min(r for r, _ in self.probes)
        return passed

    async def _probe(self, probe: Callable[[float, int], Awaitable[float]], rate: float) -> bool:
        most = self.repeats // 2 + 1
        shares: list[float] = []
        held = 0
        for repeat in range(self.repeats):
            shares.append(await probe(rate, repeat))
            held += shares[-1] >= self.threshold
            if held >= most or len(shares) - held > self.repeats - most:
                break
        self.probes.append((rate, statistics.median(shares)))
        self.shares.append(tuple(shares))
        return held >= most
