"""Capacity: the highest session arrival rate at which, with no admission at all, at least a
given share of sessions finish within their objectives. Pure search over a probe function."""

from __future__ import annotations

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
    probes: list[tuple[float, float]] = field(default_factory=list)
    """(rate, share of sessions good) for every probe run, in order."""

    async def run(self, probe: Callable[[float], Awaitable[float]]) -> float:
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

    async def _probe(self, probe: Callable[[float], Awaitable[float]], rate: float) -> bool:
        share = await probe(rate)
        self.probes.append((rate, share))
        return share >= self.threshold
