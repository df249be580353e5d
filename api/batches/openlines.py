"""The open lines of a batch, in memory, indexed by session: what the runner decides from on
every tick, so that a tick costs what changed since the last one, not the size of the batch.

Built once from the database when a runner takes a batch (``BatchLines.build``, one light row
per line, no bodies), then kept in step by the runner: lines it started, lines the database
shows ended (a result the collector of any front door wrote, or a cancel or expiry), lines it
failed itself. Pure: no I/O, no clock.

Invariants a reader must not break:
- A line only moves forward: pending, then running, then ended. So a line the runner started
  and the database no longer shows running has ended, and a line never comes back.
- A session's lines start in line order (a ``parallel`` line alongside the line before it), so
  its pending lines, in line order, are the only ones that can start, from the front:
  deciding what starts looks at the lines that start now and one more, never the whole session.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from api.batches.store import OPEN_LINES, LineState, LineStatus


@dataclass(slots=True, eq=False)
class OpenLine:
    id: int
    line_no: int
    call_id: str
    session: str
    run_start: int
    """The line number of the first line of the run of parallel lines this line belongs to (in
    its session): the line waits for every line of its session before that one."""
    ended: bool = False


@dataclass(slots=True)
class SessionLines:
    """One session's open lines, in line order."""

    key: str
    total: int = 0
    """Every line of the session, ended ones included."""
    widest: int = 1
    """The largest run of parallel lines in the session, ended lines included: what the runner
    publishes at once at most."""
    pending: deque[OpenLine] = field(default_factory=deque)
    running: deque[OpenLine] = field(default_factory=deque)
    """Both in line order. A line that ended stays (marked) until the lines before it have
    left too: ending lines in the middle costs nothing."""
    open_pending: int = 0
    open_running: int = 0

    @property
    def open(self) -> int:
        return self.open_pending + self.open_running

    @property
    def done(self) -> bool:
        return not self.open

    def runnable(self) -> list[OpenLine]:
        """The pending lines that may start now, in line order: a line waits for every earlier
        line, except that a ``parallel`` line does not wait for the line before it (nor for the
        parallel run it belongs to)."""
        for queue in (self.pending, self.running):
            while queue and queue[0].ended:
                queue.popleft()
        fronts = [queue[0].line_no for queue in (self.running, self.pending) if queue]
        if not fronts:
            return []
        first_open = min(fronts)
        out: list[OpenLine] = []
        for line in self.pending:
            if line.run_start > first_open:
                break  # this run, and every later one, waits for the open line before it
            if not line.ended:
                out.append(line)
        return out


class BatchLines:
    """A batch's sessions that still have open lines, and its running lines by id."""

    def __init__(self) -> None:
        self.sessions: dict[str, SessionLines] = {}
        self.running: dict[int, OpenLine] = {}
        self.pending_count = 0

    @classmethod
    def build(cls, rows: Iterable[LineState]) -> BatchLines:
        """From every line of the batch, in line order (ended lines too: they shape the runs of
        parallel lines and the width of each session)."""
        out = cls()
        every: dict[str, SessionLines] = {}
        width: dict[str, int] = {}
        run_start: dict[str, int] = {}
        for row in rows:
            key = row.session_key
            session = every.get(key)
            if session is None:
                session = every[key] = SessionLines(key)
            session.total += 1
            if row.parallel and key in run_start:
                width[key] += 1
            else:
                width[key] = 1
                run_start[key] = row.line_no
            session.widest = max(session.widest, width[key])
            if row.status not in OPEN_LINES:
                continue
            line = OpenLine(row.id, row.line_no, row.call_id, key, run_start[key])
            if row.status == LineStatus.PENDING.value:
                session.pending.append(line)
                session.open_pending += 1
                out.pending_count += 1
            else:
                session.running.append(line)
                session.open_running += 1
                out.running[line.id] = line
        out.sessions = {key: s for key, s in every.items() if not s.done}
        return out

    @property
    def done(self) -> bool:
        return not self.sessions

    def started(self, lines: list[OpenLine]) -> None:
        """``lines``, the first open pending lines of their session (the runner starts them in
        order), were published and marked running."""
        ids = {line.id for line in lines}
        for key in {line.session for line in lines}:
            session = self.sessions[key]
            while session.pending and (session.pending[0].ended or session.pending[0].id in ids):
                line = session.pending.popleft()
                if line.ended:
                    continue
                ids.remove(line.id)
                session.open_pending -= 1
                self.pending_count -= 1
                session.running.append(line)
                session.open_running += 1
                self.running[line.id] = line
        assert not ids, "lines start in order"

    def ended(self, line_ids: Iterable[int]) -> set[str]:
        """Running lines that ended; returns the sessions they belong to."""
        touched: set[str] = set()
        for line_id in line_ids:
            line = self.running.pop(line_id, None)
            if line is None:
                continue
            line.ended = True
            self.sessions[line.session].open_running -= 1
            touched.add(line.session)
        return touched

    def failed(self, lines: Iterable[OpenLine]) -> None:
        """Pending lines the runner ended itself, before they started."""
        for line in lines:
            if not line.ended:
                line.ended = True
                self.sessions[line.session].open_pending -= 1
                self.pending_count -= 1

    def end_session(self, key: str) -> list[OpenLine]:
        """Every open line of the session, which the runner ended all at once; returns them."""
        session = self.sessions[key]
        lines = [line for line in (*session.pending, *session.running) if not line.ended]
        self.failed([line for line in session.pending])
        self.ended([line.id for line in session.running])
        return lines

    def end_pending(self) -> set[str]:
        """Every pending line ended (a cancel, or the window closed); returns their sessions."""
        if not self.pending_count:
            return set()
        touched = {key for key, s in self.sessions.items() if s.open_pending}
        for key in touched:
            self.failed(self.sessions[key].pending)
            self.sessions[key].pending.clear()
        return touched

    def forget(self, key: str) -> None:
        """A session with no open line left."""
        assert self.sessions[key].done
        del self.sessions[key]
