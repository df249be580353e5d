"""The worker's scheduling state, pure: the calls it holds and what it decides about them.
No I/O and no clock: the NATS shell (``workers.worker``) steps a ``WorkerCore`` with the
engine's reading and the time, as vLLM's ``EngineCoreProc`` steps its ``EngineCore``, and
carries out what the core decides (tasks, messages, relays, traces stay in the shell).

A call the core holds is either *staged* (fetched, not yet handed to the engine) or *running*
(handed to the engine, until its task ends), never both. For the policy it applies, see
``workers.headroom`` (what may start, how many calls fit) and ``workers.pullplan`` (how much
credit to open, from which tier).

Time comes in two clocks, as the shell reads them: ``now_s`` is monotonic seconds (arrivals,
starvation), ``now_ms`` wall-clock unix milliseconds (call deadlines, which the front door set).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from schemas.vocab import TIERS_BY_PRIORITY, Tier
from workers.engine import EngineStats
from workers.headroom import (
    Headroom,
    HeadroomPolicy,
    Load,
    StagedCall,
    call_load,
    fetchable_calls,
    headroom,
    high_water_after_preemption,
    predicted_peak,
    select_starts,
)
from workers.pullplan import TierView, held_back, plan_pulls

_COST_EWMA = 0.2
"""Weight of the latest call's cost in the running estimate that sizes pull requests."""


@dataclass(eq=False, slots=True)
class _Held:
    """A call the core holds: what it was staged as, and what its load is computed from."""

    staged: StagedCall
    deadline_ms: int
    prompt_tokens: int
    max_tokens: int
    generated: int = 0
    """Output tokens the engine produced for it so far (all its choices)."""

    def load(self, block_size: int) -> Load:
        return call_load(self.prompt_tokens, self.max_tokens, self.generated, block_size)


@dataclass(frozen=True, slots=True)
class Start:
    """A staged call the core moved to running, with what its trace records."""

    call_id: str
    room_tokens: int
    """The headroom the batch it started in was chosen from."""
    running: int
    """Calls running once this one started (itself included)."""
    together: int
    """Calls started in the same step."""
    rescued: bool = False
    """Started by the rescue rule (``workers.headroom``): it had waited long enough of its
    time-to-first-token objective to start past a call that did not fit, or past the mark."""


class WorkerCore:
    """The calls one worker holds, staged or running, and its decisions over them."""

    def __init__(self, policy: HeadroomPolicy) -> None:
        self.policy = policy
        # Both in the order calls were staged / started: start order breaks ties by it.
        self._staged: dict[str, _Held] = {}
        self._running: dict[str, _Held] = {}
        self._est_call_tokens = float(policy.default_call_tokens)
        self._held_since: dict[Tier, float] = {}
        """Since when (``now_s``) each tier has been held back without a doorbell."""
        self._preemptions: int | None = None
        self._preempted_at_s: float | None = None

    # -- what it holds ---------------------------------------------------------------------

    @property
    def staged_count(self) -> int:
        return len(self._staged)

    @property
    def est_call_tokens(self) -> int:
        """The running estimate of a call's cost (KV tokens) that sizes pull requests."""
        return int(self._est_call_tokens)

    def holds(self, call_id: str) -> bool:
        return call_id in self._staged or call_id in self._running

    def is_running(self, call_id: str) -> bool:
        return call_id in self._running

    def staged_ids(self) -> list[str]:
        return list(self._staged)

    def running_ids(self) -> list[str]:
        return list(self._running)

    # -- a call's life ---------------------------------------------------------------------

    def stage(
        self,
        call_id: str,
        tier: Tier,
        *,
        prompt_tokens: int,
        max_tokens: int,
        block_size: int,
        session_started_ms: int,
        deadline_ms: int,
        now_s: float,
        ttft_objective_ms: int | None = None,
        waited_ms: float = 0.0,
    ) -> StagedCall:
        """Stage a call the engine's serving layer prepared; its cost (the prompt and the whole
        output budget, in blocks) also moves the estimate that sizes pull requests. A call with
        a time-to-first-token objective, which has waited ``waited_ms`` since its publish, is
        due for rescue once it has waited the policy's ``rescue_after`` of it. The caller must
        not stage an id the core already holds."""
        assert not self.holds(call_id), f"call {call_id} is already held"
        load = call_load(prompt_tokens, max_tokens, 0, block_size)
        cost = load.held + load.remaining
        self._est_call_tokens += _COST_EWMA * (cost - self._est_call_tokens)
        due_s = None
        if ttft_objective_ms is not None and self.policy.rescue_overcommit > 0:
            due_s = now_s + (self.policy.rescue_after * ttft_objective_ms - waited_ms) / 1000
        staged = StagedCall(
            call_id, tier, cost, now_s, load.remaining, session_started_ms, due_s=due_s
        )
        self._staged[call_id] = _Held(staged, deadline_ms, prompt_tokens, max_tokens)
        return staged

    def unstage(self, call_id: str) -> bool:
        """Drop a staged call (cancelled); False if it is not staged (running, or gone)."""
        return self._staged.pop(call_id, None) is not None

    def expire(self, now_ms: float) -> list[str]:
        """Drop the staged calls whose deadline has come; their ids, in staged order."""
        expired = [k for k, held in self._staged.items() if held.deadline_ms <= now_ms]
        for call_id in expired:
            del self._staged[call_id]
        return expired

    def generated(self, call_id: str, new_tokens: int) -> None:
        """The engine produced ``new_tokens`` more for a running call. A call stays running
        until ``finish``, which the shell calls only once the call's task is over, so its
        outputs always find it here (a ``KeyError`` otherwise: a shell out of step)."""
        self._running[call_id].generated += new_tokens

    def finish(self, call_id: str) -> None:
        """A running call ended, however; a call not held is ignored."""
        self._running.pop(call_id, None)

    # -- readings --------------------------------------------------------------------------

    def reading(self, stats: EngineStats) -> EngineStats:
        """The engine's reading, except that an engine running none of this worker's calls is
        idle: vLLM reports stats only when it steps, so an idle engine goes on showing the
        running count and KV usage of its last step (the warm-up's, or the end of a burst)
        until it steps again. Every request the engine holds is one of this worker's calls."""
        if self._running or not (stats.num_running or stats.num_waiting or stats.kv_cache_usage):
            return stats
        return dataclasses.replace(stats, kv_cache_usage=0.0, num_running=0, num_waiting=0)

    def committed_tokens(self, block_size: int) -> int:
        """The predicted peak of the running calls (``workers/headroom.py``)."""
        return predicted_peak(self._loads(block_size))

    def _loads(self, block_size: int) -> list[Load]:
        return [held.load(block_size) for held in self._running.values()]

    def high_water(self, stats: EngineStats, now_s: float) -> float:
        """The share of the cache lower tiers may commit now: the policy's mark, or less for a
        while after the engine preempted (``workers.headroom.high_water_after_preemption``).
        Reads the engine's preemption count, so the shell need not report preemptions."""
        count = stats.num_preemptions
        if self._preemptions is not None and count > self._preemptions:
            self._preempted_at_s = now_s
        self._preemptions = count
        since = None if self._preempted_at_s is None else now_s - self._preempted_at_s
        return high_water_after_preemption(self.policy, since)

    def room(self, stats: EngineStats, now_s: float) -> Headroom:
        """What the engine has left beside the running calls (``stats`` as the engine read)."""
        return headroom(
            self.reading(stats),
            committed_tokens=self.committed_tokens(stats.block_size),
            committed_seqs=len(self._running),
            policy=self.policy,
            high_water=self.high_water(stats, now_s),
        )

    # -- decisions -------------------------------------------------------------------------

    def start(self, stats: EngineStats, now_s: float) -> list[Start]:
        """Move the staged calls that fit now to running (``workers.headroom.select_starts``),
        in the order the shell must hand them to the engine."""
        if not self._staged:
            return []
        room = self.room(stats, now_s)
        chosen = select_starts(
            [held.staged for held in self._staged.values()],
            room,
            engine_idle=not self._running,
            now_s=now_s,
            policy=self.policy,
            running=self._loads(stats.block_size),
        )
        starts: list[Start] = []
        for staged, rescued in chosen:
            self._running[staged.key] = self._staged.pop(staged.key)
            starts.append(Start(staged.key, room.tokens, len(self._running), len(chosen), rescued))
        return starts

    def pulls(self, stats: EngineStats, tiers: Sequence[TierView], now_s: float) -> dict[Tier, int]:
        """New pull credit per tier (``workers.pullplan.plan_pulls``) for the room left beside
        the running and staged calls. ``tiers``: every tier's credit and backlog, highest
        first, ``starved`` unset: the core marks the tiers held back past the bound."""
        room = self.room(stats, now_s)
        staged = [held.staged for held in self._staged.values()]
        top = TIERS_BY_PRIORITY[0]
        top_staged = [c for c in staged if c.tier is top]
        # Staged lower-tier calls must not keep a guaranteed call from being fetched: it may
        # start in the reserve they cannot use.
        top_tier_room = (
            room.seqs - len(top_staged) > 0
            and room.tokens - sum(c.cost for c in top_staged) >= stats.block_size
        )
        free = fetchable_calls(
            room,
            staged=staged,
            capacity_tokens=stats.kv_capacity_tokens,
            est_call_tokens=int(self._est_call_tokens),
            engine_idle=not self._running,
            policy=self.policy,
        )
        waiting = held_back(tiers)
        for tier in TIERS_BY_PRIORITY:
            if tier in waiting:
                self._held_since.setdefault(tier, now_s)
            else:
                self._held_since.pop(tier, None)
        starvation = self.policy.starvation_s
        views = [
            TierView(
                v.tier,
                v.outstanding,
                v.backlog,
                starved=now_s - self._held_since.get(v.tier, now_s) > starvation,
            )
            for v in tiers
        ]
        return plan_pulls(free, views, top_tier_room=top_tier_room)

    def next_wake_s(self, now_ms: float, pull_expires_s: float, now_s: float) -> float:
        """How long the shell may wait for news before stepping again: until its pull requests
        expire, a held-back tier may be starving, a staged call's deadline comes, or a staged
        call becomes due for rescue."""
        wake = pull_expires_s
        if self._held_since:
            wake = min(wake, self.policy.starvation_s / 2)
        if self._staged:
            soonest = min(held.deadline_ms for held in self._staged.values())
            wake = min(wake, max((soonest - now_ms) / 1000, 0.0) + 0.001)
            dues = [
                held.staged.due_s
                for held in self._staged.values()
                if held.staged.due_s is not None and held.staged.due_s > now_s
            ]
            if dues:
                wake = min(wake, min(dues) - now_s + 0.001)
        return wake
