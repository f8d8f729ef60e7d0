"""KV-event subscriber: one SUB (+ replay DEALER) per worker rank, driven by the actor's loop (docs/DESIGN.md §6).

I/O only; every decision about seqs, gaps, replays and the indexes is `kvevents.apply.KvEventApplier`'s.

* One SUB per (worker, dp_rank) — endpoint port + dp_rank (`kvevents.format.offset_endpoint`) —
  subscribed to the worker's topic; read by a `reader.Reader` (a wake drains at most `frame_budget`
  messages, the edge-triggered idiom of every daemon socket). Reconnection with exponential backoff is
  ZeroMQ's own (`RECONNECT_IVL` 100 ms doubling to `RECONNECT_IVL_MAX` 5 s). The SUB sends ZMTP
  heartbeats (`HEARTBEAT_IVL_MS`); a publisher that answers none for `HEARTBEAT_TIMEOUT_MS` (a
  stopped process, a partitioned host: its TCP connection may stay open) is disconnected by
  ZeroMQ, which the socket monitor reports like any other disconnect.
* Replay: when the applier asks, a DEALER (created on demand, same backoff options) sends
  `[b"", start_seq]` to the rank's replay endpoint; replies `[b"", seq, payload]` or
  `[b"", topic, seq, payload]` are fed to the applier until the end marker (seq -1). No end marker
  within `replay_timeout_s`: the DEALER is closed (late replies dropped with it) and the request is
  re-sent after a backoff (0.1 s doubling, at most 5 s), `replay_retries` times; then the missing
  seqs are given up. A restart (seq decrease) also drops the DEALER in flight.
* Restart (docs/KV_EVENTS.md, "Restarts keep the cache view"): rows whose entries
  and last applied seq survived in shared memory (`start(restored={row: seq})`) start fresh, and a
  catch-up replay from seq + 1 is sent to every such rank at once in `start()`, without waiting for
  the engine to publish; `wait_caught_up()` lets the daemon hold READY until they end (bounded).
* Connect: every completed handshake with a publisher (the first one included) asks its replay
  endpoint at once for what was published while nobody listened (`KvEventApplier.reconnected`:
  an idle engine would publish no later batch to reveal that gap).
* Staleness: the rule is `kvevents.staleness.StreamHealth`'s (evidence of loss, never silence); this
  class feeds it the socket monitor's handshakes and disconnects, the applier's `unfilled` verdict
  after every read, and the clock (a timer re-checks every row). Every row starts fresh, as not yet
  connected. Transitions are reported through `mark_stale(row, bool)` (the daemon passes
  `Ledger.set_stale`), plus once per row at start.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import zmq
from zmq.utils.monitor import parse_monitor_message

from ..kvevents.apply import KvEventApplier
from ..kvevents.format import seq_from_bytes, seq_to_bytes
from ..kvevents.staleness import StreamHealth
from ..shm.overlap import OverlapIndex
from .kv_sources import KvEventSource, SourceStream, replay_backoff_s
from .ratelimit import RateLimitedLog
from .reader import Reader, read_some, readable

if TYPE_CHECKING:
    from ..shm.kv_index import KvIndexSegment

log = logging.getLogger(__name__)

# ZMTP heartbeats on every SUB (ms): a PING every second; a publisher that answers nothing for 3 s
# is disconnected (a stopped or partitioned engine, whose TCP connection may stay open, is noticed
# within ~4 s); the same TTL asks the publisher to drop us if our PINGs stop. libzmq's io threads
# answer PINGs without the GIL, so a busy engine process still answers.
HEARTBEAT_IVL_MS = 1000
HEARTBEAT_TIMEOUT_MS = 3000


def _now_us() -> int:
    return time.monotonic_ns() // 1000


class KvEventSubscriber:
    """Feeds vLLM KV events of every configured worker rank into the overlap indexes.

    Args:
        loop: the running event loop (the actor's).
        ctx: zmq.Context for the sockets.
        sources: one `KvEventSource` per worker row with an event endpoint (`sources_for_worker`).
        device: OverlapIndex of device (GPU) blocks, fed with permanent entries.
        offload: OverlapIndex of other tiers (CPU, disk, ...), or None to ignore those.
        mark_stale: `(row, stale)` called on every staleness transition (and once per row at start).
        stale_after_s: how long a row may stay disconnected, or keep a gap unfilled, before it is
            stale (s), unless its source says (`kvevents.staleness`); silence never counts.
        replay_timeout_s: time allowed for a replay to reach its end marker (s).
        replay_retries: re-sends of a replay request that timed out before giving up.
        frame_budget: messages read per socket per wake.
        max_frame_bytes: ZMQ_MAXMSGSIZE of the sockets (a bigger message drops the connection).
        clock: monotonic seconds (tests may pass a fake).
        store: where each row's applied-through seq persists (`KvEventApplier`'s `store`), or None.
        restored: row -> last applied seq of rows whose entries survived a restart (`start()`'s default).
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        ctx: zmq.Context,
        sources: Iterable[KvEventSource],
        device: OverlapIndex,
        offload: OverlapIndex | None = None,
        *,
        mark_stale: Callable[[int, bool], None] | None = None,
        stale_after_s: float = 30.0,
        replay_timeout_s: float = 2.0,
        replay_retries: int = 3,
        frame_budget: int = 256,
        max_frame_bytes: int = 64 << 20,
        clock: Callable[[], float] = time.monotonic,
        store: KvIndexSegment | None = None,
        restored: dict[int, int] | None = None,
    ) -> None:
        self.loop = loop
        self.ctx = ctx
        self.streams = [SourceStream(s) for s in sources]
        rows = [s.src.row for s in self.streams]
        if len(set(rows)) != len(rows):
            raise ValueError(f"two KV-event sources for one worker row: {rows}")
        self.applier = KvEventApplier(device, offload, store=store)
        self.restored = dict(restored or {})
        self.mark_stale = mark_stale
        self.stale_after_s = stale_after_s
        self.replay_timeout_s = replay_timeout_s
        self.replay_retries = replay_retries
        self.frame_budget = frame_budget
        self.max_frame_bytes = max_frame_bytes
        self.clock = clock
        shortest = min([stale_after_s] + [s.src.stale_after_s for s in self.streams if s.src.stale_after_s])
        self.tick_s = max(0.01, min(0.25, shortest / 4))
        self.malformed_frames = 0  # multipart messages of the wrong shape
        self.disconnects = 0  # SUB disconnects seen by the socket monitor
        self.warn = RateLimitedLog(log)
        self._timer: asyncio.TimerHandle | None = None
        self._running = False

    # ------------------------------------------------------------------ lifecycle
    def start(self, restored: dict[int, int] | None = None) -> None:
        """Connect every SUB, register readers, start the timer; every row is reported fresh (stale
        once it stays unconnected for its limit); rows in `restored` (row -> last applied seq >= 0,
        kept in shared memory by the previous daemon) get a catch-up replay requested at once."""
        if self._running:
            raise RuntimeError("KvEventSubscriber already started; call stop() first")
        self._running = True
        restored = self.restored if restored is None else restored
        caught = 0
        for st in self.streams:
            self._open_sub(st)
            start_seq = (
                self.applier.restore(st.src.row, restored[st.src.row]) if restored and st.src.row in restored else None
            )
            st.stale = False  # not connected yet: stale only if that lasts
            if self.mark_stale is not None:
                self.mark_stale(st.src.row, st.stale)
            if start_seq is not None:
                caught += 1
                self._request_replay(st, start_seq)
        self._timer = self.loop.call_later(self.tick_s, self._on_timer)
        log.info("kv events subscribed sources=%d restored=%d", len(self.streams), caught)

    def catching_up(self) -> int:
        """Rows whose catch-up replay (after a restart) has not ended yet."""
        return sum(1 for st in self.streams if self.applier.catching_up(st.src.row))

    async def wait_caught_up(self, timeout_s: float) -> bool:
        """Wait (on the loop, so replies are read meanwhile) until every catch-up replay ended, at
        most `timeout_s` seconds. Returns True when none is left."""
        deadline = self.clock() + timeout_s
        while self.catching_up() and self.clock() < deadline:
            await asyncio.sleep(0.005)
        return not self.catching_up()

    def stop(self) -> None:
        """Unregister and close every socket (linger 0); the indexes keep what they hold."""
        if not self._running:
            return
        self._running = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for st in self.streams:
            self._close(st)

    def add_source(self, src: KvEventSource) -> None:
        """Subscribe one more worker row (admin AddWorker); it starts fresh, as not yet connected."""
        if any(st.src.row == src.row for st in self.streams):
            raise ValueError(f"worker row {src.row} already has a KV-event source")
        st = SourceStream(src)
        self.streams.append(st)
        if src.stale_after_s:
            self.tick_s = max(0.01, min(self.tick_s, src.stale_after_s / 4))
        if self._running:
            self._open_sub(st)
            if self.mark_stale is not None:
                self.mark_stale(src.row, False)

    def remove_source(self, row: int) -> None:
        """Unsubscribe a worker row (admin RemoveWorker) and forget its entries in both indexes."""
        for st in [s for s in self.streams if s.src.row == row]:
            self._close(st)
            self.streams.remove(st)
        self.applier.reset_row(row)

    def _close(self, st: SourceStream) -> None:
        self._close_dealer(st)
        st.retry_at_s = None
        if st.mon is not None:
            st.mon.stop()
            assert st.sub is not None
            st.sub.sock.disable_monitor()
            st.mon.sock.close(0)
            st.mon = None
        if st.sub is not None:
            st.sub.stop()
            st.sub.sock.close(0)
            st.sub = None

    def _options(self, sock: zmq.Socket) -> None:
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 5000)
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame_bytes)

    def _open_sub(self, st: SourceStream) -> None:
        sub = self.ctx.socket(zmq.SUB)
        self._options(sub)
        # Unbounded receive queue: libzmq (4.3.x) aborts the whole process when a ZMTP heartbeat times out
        # on a connection whose reading it paused because the queue was full (zeromq/libzmq#3937, #4767,
        # open), e.g. while the loop is busy and the engines publish. Never paused, never that path; the
        # queue holds what the engines published while the loop was busy (docs/KV_EVENTS.md).
        sub.setsockopt(zmq.RCVHWM, 0)
        sub.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
        sub.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        sub.setsockopt(zmq.HEARTBEAT_TTL, HEARTBEAT_TIMEOUT_MS)
        sub.setsockopt(zmq.SUBSCRIBE, st.src.topic.encode())
        # Monitored before it connects (an event emitted before the monitor is attached is lost); a
        # handshake, not EVENT_CONNECTED: a stopped process's kernel still accepts TCP connections.
        mon = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        try:
            sub.connect(st.src.endpoint)
        except zmq.ZMQError:
            sub.disable_monitor()
            mon.close(0)
            sub.close(0)  # an unclosed socket would hang Context.term() at shutdown
            raise
        st.sub = Reader(self.loop, sub, lambda: self._on_sub(st))
        st.mon = Reader(self.loop, mon, lambda: self._on_monitor(st))
        st.health = StreamHealth.subscribed(self._limit(st), self.clock())
        st.sub.start()
        st.mon.start()

    def _open_dealer(self, st: SourceStream) -> zmq.Socket:
        assert st.src.replay_endpoint is not None
        dealer = self.ctx.socket(zmq.DEALER)
        self._options(dealer)
        dealer.setsockopt(zmq.RCVHWM, 0)  # a replay answer may be the publisher's whole ring buffer
        try:
            dealer.connect(st.src.replay_endpoint)
        except zmq.ZMQError:
            dealer.close(0)
            raise
        st.dealer = Reader(self.loop, dealer, lambda: self._on_dealer(st))
        st.dealer.start()
        return dealer

    def _close_dealer(self, st: SourceStream) -> None:
        st.replay_deadline_s = None
        if st.dealer is not None:
            st.dealer.stop()
            st.dealer.sock.close(0)
            st.dealer = None

    # ------------------------------------------------------------------ live stream
    def _drained(self, st: SourceStream, sock: zmq.Socket, n: int) -> bool:
        """After a wake that read `n` messages of `sock`: refresh the row's verdict; True when another
        wake is needed (the budget was used, or the socket, still open, is readable)."""
        if n:
            self._refresh(st)
        return n == self.frame_budget or (not sock.closed and readable(sock))

    def _on_sub(self, st: SourceStream) -> bool:
        assert st.sub is not None
        sock = st.sub.sock
        return self._drained(
            st, sock, read_some(sock, self.frame_budget, lambda frames: self._on_live_frames(st, frames))
        )

    def _on_live_frames(self, st: SourceStream, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8 or frames[1][0] & 0x80:
            # seq >= 2^63: publishers count from 0, replay reads seqs signed, the store is int64
            self._malformed(st, "live", len(frames))
            return
        self._on_live(st, seq_from_bytes(frames[1]), frames[2])

    def _on_live(self, st: SourceStream, seq: int, payload: bytes) -> None:
        row = st.src.row
        res = self.applier.on_live(row, seq, payload, _now_us())
        if res.restarted:
            log.warning("kv events restart row=%d seq=%d: worker index cleared", row, seq)
            self._close_dealer(st)
            st.replay_attempts = 0
            st.retry_at_s = None
        if res.replay_from is not None:
            self._request_replay(st, res.replay_from)

    def _malformed(self, st: SourceStream, what: str, parts: int) -> None:
        self.malformed_frames += 1
        self.warn.warning(
            f"kv-malformed-{st.src.row}", "kv event frame malformed row=%d socket=%s parts=%d", st.src.row, what, parts
        )

    # ------------------------------------------------------------------ replay
    def _request_replay(self, st: SourceStream, start: int) -> None:
        if st.src.replay_endpoint is None:  # nowhere to ask: the missing seqs are lost
            self.applier.replay_failed(st.src.row, retry=False)
            return
        dealer = st.dealer.sock if st.dealer is not None else self._open_dealer(st)
        try:
            dealer.send_multipart((b"", seq_to_bytes(start)), zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # EAGAIN (HWM) etc.: treat as a timed-out attempt
            self.warn.warning(
                f"kv-replay-send-{st.src.row}", "kv replay request failed row=%d errno=%s", st.src.row, exc.errno
            )
        st.replay_deadline_s = self.clock() + self.replay_timeout_s
        st.retry_at_s = None
        log.debug("kv replay requested row=%d from=%d", st.src.row, start)
        assert st.dealer is not None
        st.dealer.wake_soon()  # the send may have taken the FD's edge of a reply

    def _on_dealer(self, st: SourceStream) -> bool:
        assert st.dealer is not None
        sock = st.dealer.sock
        return self._drained(st, sock, read_some(sock, self.frame_budget, lambda f: self._on_replay_frames(st, f)))

    def _on_replay_frames(self, st: SourceStream, frames: list[bytes]) -> None:
        if frames and frames[0] == b"":
            frames = frames[1:]
        if len(frames) == 3:  # [topic, seq, payload]
            frames = frames[1:]
        if len(frames) != 2 or len(frames[0]) != 8:
            self._malformed(st, "replay", len(frames))
            return
        seq = seq_from_bytes(frames[0], signed=True)
        row = st.src.row
        if seq == -1:
            st.replay_deadline_s = None
            st.replay_attempts = 0
            restarts = self.applier.counters.restarts
            nxt = self.applier.on_replay_end(row)
            if self.applier.counters.restarts != restarts:
                log.warning(
                    "kv events restart row=%d: the publisher no longer holds the last applied seq;"
                    " worker index cleared",
                    row,
                )
            if nxt is not None:
                self._request_replay(st, nxt)
            return
        if seq < 0:
            self._malformed(st, "replay", 2)
            return
        self.applier.on_replay(row, seq, frames[1], _now_us())

    # ------------------------------------------------------------------ timers
    def _on_monitor(self, st: SourceStream) -> bool:
        assert st.mon is not None
        sock = st.mon.sock
        return self._drained(st, sock, read_some(sock, self.frame_budget, lambda f: self._on_monitor_event(st, f)))

    def _on_monitor_event(self, st: SourceStream, parts: list[bytes]) -> None:
        event = parse_monitor_message(parts)["event"]
        assert st.health is not None
        if event == zmq.EVENT_DISCONNECTED:
            self.disconnects += 1
            log.info("kv events disconnected row=%d endpoint=%s", st.src.row, st.src.endpoint)
            st.health.disconnected(self.clock())
        elif event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            log.info("kv events connected row=%d endpoint=%s", st.src.row, st.src.endpoint)
            st.health.connected()
            self._catch_up_after_connect(st)

    def _catch_up_after_connect(self, st: SourceStream) -> None:
        """Ask the publisher for what it published while nobody listened (`KvEventApplier.reconnected`)."""
        if st.src.replay_endpoint is None:
            return
        start = self.applier.reconnected(st.src.row)
        if start is not None:
            self._request_replay(st, start)

    def _limit(self, st: SourceStream) -> float:
        return self.stale_after_s if st.src.stale_after_s is None else st.src.stale_after_s

    def _refresh(self, st: SourceStream) -> None:
        """Hand the row's gap state and the time to its `StreamHealth`; report a change of verdict."""
        if st.health is None:
            return
        now = self.clock()
        st.health.gap(self.applier.unfilled(st.src.row), now)
        self._set_stale(st, st.health.stale(now))

    def _set_stale(self, st: SourceStream, stale: bool) -> None:
        if st.stale != stale:
            st.stale = stale
            if self.mark_stale is not None:
                self.mark_stale(st.src.row, stale)

    def _on_timer(self) -> None:
        now = self.clock()
        try:
            for st in self.streams:
                self._refresh(st)
                if st.replay_deadline_s is not None and now > st.replay_deadline_s:
                    self._replay_timed_out(st, now)
                if st.retry_at_s is not None and now >= st.retry_at_s:
                    st.retry_at_s = None
                    self._request_replay(st, st.retry_from)
        finally:
            if self._running:
                self._timer = self.loop.call_later(self.tick_s, self._on_timer)

    def _replay_timed_out(self, st: SourceStream, now: float) -> None:
        self._close_dealer(st)  # drops late replies of this attempt
        st.replay_attempts += 1
        retry = st.replay_attempts <= self.replay_retries
        nxt = self.applier.replay_failed(st.src.row, retry)
        self._refresh(st)
        self.warn.warning(
            f"kv-replay-timeout-{st.src.row}",
            "kv replay timed out row=%d attempt=%d retry=%s",
            st.src.row,
            st.replay_attempts,
            nxt is not None,
        )
        if nxt is None:
            st.replay_attempts = 0
            return
        st.retry_from = nxt
        st.retry_at_s = now + replay_backoff_s(st.replay_attempts)

    # ------------------------------------------------------------------ introspection
    def counters(self) -> dict[str, int]:
        """Counters for metrics: applied, replayed, unknown_types, unknown_fields, gaps, restarts,
        stale_workers (a gauge), plus the applier's other counters, malformed_frames, disconnects."""
        out = self.applier.counters.as_dict()
        out["stale_workers"] = sum(1 for st in self.streams if st.stale)
        out["malformed_frames"] = self.malformed_frames
        out["disconnects"] = self.disconnects
        return out
