"""The order in which a replica decides again the sessions it holds.

A session deferred for want of room is held by the front door (``Admitter.admit``) and decided
again when room may have freed. Decided again each on its own timer, held sessions raced: one
back from a ``Retry-After`` with little of its deadline left lost the room that freed to one
that had just arrived, and was then refused as ``deadline_infeasible``. Here they take turns in
passes, one decision at a time, in the order that serves deadlines: a higher tier first, then
the earliest deadline. A session that arrives while one of its tier or a higher one is held
with an earlier deadline joins them instead of being decided ahead of them.

A pass runs as soon as a session joins or room is freed on this replica, and otherwise every
``poll_s`` (a release on another replica, or a worker's new reading, is seen at the next one).
Every held session is decided in each pass, not only the first: one that does not fit does not
block a smaller one behind it.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from dataclasses import dataclass, field

Rank = tuple[int, float]
"""(the tier's place, 0 the highest; the deadline, monotonic seconds): lower goes first."""


@dataclass(eq=False, slots=True)
class Place:
    rank: Rank
    order: int
    """Joined in this order: ties of rank go first come, first served."""
    turn: asyncio.Event = field(default_factory=asyncio.Event)
    decided: asyncio.Event = field(default_factory=asyncio.Event)


class HeldSessions:
    """The sessions one replica holds, and the passes that decide them again in order."""

    def __init__(self, poll_s: float) -> None:
        self._poll_s = poll_s
        self._places: set[Place] = set()
        self._joined = itertools.count()
        self._wake = asyncio.Event()
        self._passes: asyncio.Task[None] | None = None

    @property
    def held(self) -> int:
        return len(self._places)

    def ahead_of(self, rank: Rank) -> bool:
        """Whether a held session goes before a new one of ``rank``."""
        return any(place.rank <= rank for place in self._places)

    def join(self, rank: Rank) -> Place:
        place = Place(rank, next(self._joined))
        self._places.add(place)
        self.wake()
        if self._passes is None or self._passes.done():
            self._passes = asyncio.get_running_loop().create_task(self._run())
        return place

    def leave(self, place: Place) -> None:
        self._places.discard(place)
        place.decided.set()  # a pass waiting on it goes on

    async def turn(self, place: Place, timeout_s: float) -> bool:
        """Wait for ``place``'s turn in a pass, at most ``timeout_s``: whether it came. After a
        turn, the holder decides and then calls ``decided``."""
        if timeout_s <= 0:
            return False
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(place.turn.wait(), timeout_s)
        came = place.turn.is_set()
        place.turn.clear()
        return came

    @staticmethod
    def decided(place: Place) -> None:
        place.decided.set()

    def wake(self) -> None:
        """Room may have freed, or a session joined: run a pass now (after the one running)."""
        self._wake.set()

    async def _run(self) -> None:
        while self._places:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._poll_s)
            self._wake.clear()
            for place in sorted(self._places, key=lambda p: (p.rank, p.order)):
                if place not in self._places:
                    continue  # answered, or gone, earlier in this pass
                place.decided.clear()
                place.turn.set()
                await place.decided.wait()

    async def close(self) -> None:
        if self._passes is not None:
            self._passes.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._passes
