"""`SchedulerClient`: one data DEALER connection per router process, shared by its coroutines, plus
one heartbeat DEALER driven by a thread of its own while the client is open (docs/DESIGN.md §1.2, §5.4).

I/O follows the daemon's own pattern (see `link.py`): a plain ZeroMQ socket whose FD is registered
with `loop.add_reader`; each waiting `schedule()` is a future keyed by request_id (`pending.py` keeps
them and builds the `Reattach`, `reattach.py` sends it); a local router reports lease progress by stores into its slot's
shared-memory words (`words.py`). Cancelling a caller
still waiting in `schedule()` sends `Release(cancelled)`; an `Admitted` that arrives for a request
nobody waits for any more is released at once, so nothing leaks.

After a daemon restart the link says Hello again and this client sends `Reattach` with its open
leases (and those released while the link was down, whose buffered `Release` follows the
`Reattach`, so the new daemon applies it at once), its waiting Enqueues and its unanswered requeues
(with each request's original Enqueue);
callers see an error only when the daemon stays away longer than `reconnect_deadline_s`. A request
answered `shutting_down` (the daemon is stopping, e.g. `systemctl restart`) stays pending and is
re-sent to the next daemon, so a restart within `reconnect_deadline_s` fails no caller. With
`on_unavailable="bypass"`, `schedule()` returns a degraded lease on a locally chosen worker while no
daemon answers (also to callers still waiting when the reconnect deadline passes).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Literal

import numpy as np
import zmq

from .. import hashing
from .. import protocol as p
from ..endpoints import connect_problem, data_endpoint, missing_ipc_path
from ..errors import DaemonUnavailable, KvschedError, ProtocolError, rejection_error
from .checks import BlockHashes, checked_enqueue, checked_utf8
from .lease import DroppedLeases, Lease, LeaseChannel
from .link import Link
from .pending import Answer, Bypass, PendingCalls
from .reattach import RESTART_LOSS, loss_reason, outage_expired, send_reattach
from .words import SlotWords

log = logging.getLogger(__name__)

# How long a new client waits for its daemon's first Welcome (s): a daemon compiling its kernels on a
# cold cache (about a minute here) or starved of CPU answers late.
DEFAULT_CONNECT_TIMEOUT_S = 30.0


def foreign_process_error(created_pid: int) -> KvschedError | None:
    """The error for using a client in a process other than the one that created it (a forked child),
    or None in that process. A child shares its parent's sockets but not the threads that serve them
    (fork(2) copies only the calling thread), so such a call would hang or talk on the parent's
    connection; a child creates its own client."""
    if os.getpid() == created_pid:
        return None
    return KvschedError(
        f"this kvsched client was created in process {created_pid}, not in this one "
        f"({os.getpid()}): a forked child cannot use its parent's client; create a client "
        "per process (after fork)"
    )


class SchedulerClient:
    """Asyncio client of one kvsched daemon.

    Args:
        endpoint: data socket; None = discovery (`KVSCHED_ENDPOINT`, else the ipc path of `instance`).
        instance: daemon instance name used by discovery.
        client_name: shown in the daemon's logs and `kvsched status`.
        connect_timeout_s: seconds to wait for the first `Welcome` (default 30: a daemon that is still
            starved of CPU on a loaded machine answers late; 5 s failed routers whose daemon was merely
            slow). An ipc endpoint whose socket file is missing waits as long.
        reconnect_deadline_s: after losing the daemon, waiting calls fail with `DaemonUnavailable`
            only once the outage is this old (s).
        on_unavailable: "fail" (raise `DaemonUnavailable`) or "bypass" (degraded lease on a random
            worker of `bypass_workers`, flagged `degraded=True` and counted in `degraded_total`).
        bypass_workers: (worker_id, dp_rank) pairs used in bypass mode.
        attach_progress: map the progress segment to report output tokens without frames.
        curve_server_key: the daemon's z85 CURVE public key, for a TCP endpoint off loopback.
        curve_client_keys: (public, secret) z85 keys of this client (generated when omitted; give
            fixed ones when the daemon restricts clients with `curve_authorized_keys_dir`).
        ctx: a zmq.Context to use (default: a private one).
        protocol_version: the highest wire protocol version to offer (default: the newest; the
            client falls back to version 1 when the daemon refuses it). Version 2 coalesces the
            frames of one event-loop turn into one `Batch` message.
    Raises:
        ValueError: a malformed endpoint (accepted: ipc://PATH, tcp://HOST:PORT, inproc://NAME with a shared
            `ctx`), an unknown `on_unavailable`, bypass without `bypass_workers`, a `client_name` with a lone surrogate.
    Usage:
        async with SchedulerClient() as client:
            lease = await client.schedule(request_id="r1", isl_tokens=812, block_hashes=hashes)
            async with lease:
                ...  # send to lease.worker, stream, lease.add_output_tokens(n)
    """

    def __init__(
        self,
        endpoint: str | None = None,
        *,
        instance: str = "default",
        client_name: str = "",
        connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
        reconnect_deadline_s: float = 30.0,
        on_unavailable: Literal["fail", "bypass"] = "fail",
        bypass_workers: Iterable[tuple[int, int]] = (),
        attach_progress: bool = True,
        curve_server_key: str | bytes | None = None,
        curve_client_keys: tuple[bytes, bytes] | None = None,
        ctx: zmq.Context[zmq.Socket[bytes]] | None = None,
        protocol_version: int = p.PROTOCOL_VERSION,
    ) -> None:
        if on_unavailable not in ("fail", "bypass"):
            raise ValueError("on_unavailable must be 'fail' or 'bypass'")
        self.endpoint = endpoint or data_endpoint(instance)
        problem = connect_problem(self.endpoint)
        if problem is not None:  # else pyzmq raises a bare ZMQError at connect() time
            raise ValueError(f"bad kvsched endpoint {self.endpoint!r}: {problem}; use ipc://PATH or tcp://HOST:PORT")
        self.client_name = checked_utf8("client_name", client_name or f"router-{os.getpid()}")  # sent in Hello
        self.connect_timeout_s = connect_timeout_s
        self.reconnect_deadline_s = reconnect_deadline_s
        self.on_unavailable = on_unavailable
        self.bypass_workers = [p.WorkerKey(*w) for w in bypass_workers]
        if on_unavailable == "bypass" and not self.bypass_workers:
            raise ValueError("on_unavailable='bypass' needs bypass_workers")
        self.attach_progress = attach_progress
        self.curve_server_key = curve_server_key.encode() if isinstance(curve_server_key, str) else curve_server_key
        self.curve_client_keys = curve_client_keys
        self.protocol_version = protocol_version
        self._ctx = ctx or zmq.Context()
        self._own_ctx = ctx is None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._link: Link | None = None
        self._pending = PendingCalls()  # waiting calls, open leases' Enqueues (`_pending.origins`)
        self._leases: dict[str, weakref.ref[Lease]] = {}
        self._channel = LeaseChannel(  # what its leases call on it
            loop=lambda: self._loop,
            link=lambda: self._link,
            send=self._send,
            report_state=self._report_state,
            report_progress=self._report_progress,
            forget=self._forget_lease,
            requeue=self._requeue,
            release_from_gc=self._release_from_gc,
        )
        self._dropped = DroppedLeases(self._channel)  # leases garbage-collected while open (one wake per batch)
        self._welcome_fut: asyncio.Future[p.Welcome] | None = None
        self._words = SlotWords()  # the slot's state / progress words when the segment is mapped
        self._deadline_timer: asyncio.TimerHandle | None = None
        self.degraded_total = 0
        self._epoch: int | None = None  # daemon_epoch of the last Welcome
        self._loss_reason = RESTART_LOSS
        self.lost_leases: list[str] = []
        self.errors: list[p.Error] = []  # Error frames not tied to a waiting call (diagnostics)
        self._pid = os.getpid()  # the process this client belongs to (`foreign_process_error`)
        self._abandon: weakref.finalize[..., SchedulerClient] | None = (
            None  # closes the link if this client is dropped open
        )

    @property
    def welcome(self) -> p.Welcome | None:
        return self._link.welcome if self._link is not None else None

    @property
    def connected(self) -> bool:
        return self._link is not None and self._link.connected

    def block_hashes(
        self,
        token_ids: Sequence[int] | np.ndarray,
        *,
        mode: Literal["vllm", "xxhash"] = "vllm",
        extra_keys: Sequence[Any] | None = None,
        cache: hashing.BlockHashCache | None = None,
    ) -> np.ndarray:
        """Block hashes of a prompt as this pool hashes them: `hashing.block_hashes` with the daemon's
        `block_size` and `kv_hash_seed` (from its last `Welcome`, so a daemon restarted with other
        values is followed), ready for `schedule(block_hashes=...)`.

        The daemon's `kv_hash_seed` is the pool's one hash seed: the daemon checks the engines' KV
        events against it, and every router hashing here uses it too (docs/VLLM.md).

        Args:
            token_ids: the prompt's token ids.
            mode: "vllm" (default): equal to the hashes vLLM engines publish in their KV events
                (with `--prefix-caching-hash-algo sha256_cbor` and PYTHONHASHSEED = the daemon's seed),
                which the daemon's event-fed index and hash check use; right for every pool, with or
                without events. "xxhash": several times cheaper, only for a pool whose engines publish
                no KV events, and then for every router of the pool (docs/KV_EVENTS.md).
            extra_keys / cache: as `hashing.block_hashes` (LoRA / cache-salt keys; a `BlockHashCache`).
        Returns:
            uint64[len(token_ids) // block_size].
        Raises:
            DaemonUnavailable: no `Welcome` yet (before `connect()` returned, after `close()`, or in
                bypass mode while no daemon has ever answered): the block size and seed are the
                daemon's, so the client refuses to guess them. It does not wait: `connect()` already
                waits for the Welcome.
            ValueError / TypeError: as `hashing.block_hashes`.
        """
        welcome = self.welcome
        if welcome is None:
            raise DaemonUnavailable(
                f"no Welcome from the daemon at {self.endpoint} yet: block size and hash "
                "seed come from it (call connect() first)"
            )
        return hashing.block_hashes(
            token_ids, welcome.block_size, mode=mode, hash_seed=welcome.hash_seed, extra_keys=extra_keys, cache=cache
        )

    # ------------------------------------------------------------------ connection
    async def connect(self) -> SchedulerClient:
        """Open the DEALER, say Hello, wait for Welcome.

        Raises:
            DaemonUnavailable: no Welcome within `connect_timeout_s` — for an ipc:// endpoint whose
                socket file does not exist, the wait is for the daemon to bind it (a router started
                before its daemon), and the error names the file; names the endpoint. In bypass mode
                it does not raise, returns at once when the socket file is missing, and keeps trying
                in the background.
            ProtocolError: the daemon refused our protocol version.
        """
        wrong = foreign_process_error(self._pid)
        if wrong is not None:
            raise wrong
        self._loop = asyncio.get_running_loop()
        started = self._loop.time()
        missing = missing_ipc_path(self.endpoint)
        if missing is not None and self.on_unavailable != "bypass":
            while missing is not None and self._loop.time() - started < self.connect_timeout_s:
                await asyncio.sleep(0.05)  # a daemon starting up binds it soon
                missing = missing_ipc_path(self.endpoint)
            if missing is not None:
                await self.close()
                raise DaemonUnavailable(
                    f"no kvsched daemon at {self.endpoint}: socket file {missing} does not exist "
                    f"after {self.connect_timeout_s:.1f}s (is the daemon running, with the same "
                    "XDG_RUNTIME_DIR / instance?)"
                )
        self._welcome_fut = self._loop.create_future()
        # The link (held by the loop through its reader and timer) reaches this client only weakly,
        # so a client dropped without close() is collected, and `_abandon` then closes the link.
        self._link = Link(
            self._ctx,
            self.endpoint,
            self.client_name,
            _weak_callback(self._on_frame),
            _weak_callback(self._on_welcome),
            curve_server_key=self.curve_server_key,
            curve_client_keys=self.curve_client_keys,
            protocol_version=self.protocol_version,
        )
        self._link.open(self._loop)
        if self._abandon is not None:
            self._abandon.detach()
        self._abandon = weakref.finalize(
            self, _close_abandoned, self._pid, self._loop, self._link, self._ctx if self._own_ctx else None
        )
        self._abandon.atexit = False  # at interpreter exit the process's end closes everything
        try:
            if missing is not None:  # bypass mode, no daemon bound the socket: do not wait for one
                raise TimeoutError
            left = max(0.5, self.connect_timeout_s - (self._loop.time() - started))
            await asyncio.wait_for(asyncio.shield(self._welcome_fut), left)
        except TimeoutError:
            if self.on_unavailable == "bypass":
                log.warning("no daemon at %s; bypass mode until it answers", self.endpoint)
            else:
                await self.close()
                raise DaemonUnavailable(
                    f"no kvsched daemon answered at {self.endpoint} within {self.connect_timeout_s:.1f}s"
                ) from None
        except ProtocolError:
            await self.close()
            raise
        self._arm_deadline_timer()
        return self

    def _on_welcome(self, welcome: p.Welcome, reconnected: bool) -> None:
        if self._welcome_fut is not None and not self._welcome_fut.done():
            self._welcome_fut.set_result(welcome)
        if self.attach_progress:
            self._words.attach(welcome.shm_ledger, welcome.daemon_epoch)
        if reconnected:
            self._loss_reason = loss_reason(self._epoch, welcome)
            leases = [p.LeaseRef(lease.request_id, lease.slot, lease.generation) for lease in self._open_leases()]
            send_reattach(self._link, self._pending, leases, welcome)
        self._epoch = welcome.daemon_epoch

    def _open_leases(self) -> list[Lease]:
        out = []
        for ref in self._leases.values():
            lease = ref()
            if lease is not None and lease.outcome is None:
                out.append(lease)
        return out

    async def close(self) -> None:
        """Abort every open lease, fail every waiting call, close the socket. Frames already sent
        (a last Release, these aborts) still reach a daemon that is connected, for up to
        `link.CLOSE_LINGER_MS` (2 s), so the daemon frees those leases at once; closing the client's
        own ZeroMQ context waits for that. In a forked child it does nothing: the connection is the
        parent's (`foreign_process_error`)."""
        if os.getpid() != self._pid:
            return
        if self._abandon is not None:
            self._abandon.detach()
        for lease in self._open_leases():
            lease.release("aborted")
        self._pending.fail_all()
        if self._deadline_timer is not None:
            self._deadline_timer.cancel()
        if self._link is not None:
            self._link.close()
            self._link = None
        self._words.close()
        if self._own_ctx and not self._ctx.closed:
            self._ctx.term()

    async def __aenter__(self) -> SchedulerClient:
        return await self.connect()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ scheduling
    async def schedule(
        self,
        request_id: str,
        isl_tokens: int,
        block_hashes: BlockHashes | None = None,
        *,
        policy_class: str = "",
        priority: int = 0,
        strict_priority: int = 0,
        session_id: str | None = None,
        expected_osl: int | None = None,
        pinned: tuple[int, int] | None = None,
        allowed_workers: Iterable[int] | None = None,
        do_not_queue: bool = False,
        deadline_ms: int | None = None,
        lora_name: str | None = None,
        excluded_workers: Iterable[int] | None = None,
    ) -> Lease:
        """Ask whether `request_id` may run now and where; wait until it is admitted or rejected.

        Args:
            request_id: unique among this daemon's live requests (<= 128 UTF-8 bytes).
            isl_tokens: prompt tokens (>= 1).
            block_hashes: chained prefix-block hashes: uint64 array, list of ints, or little-endian
                u64 bytes; at most ceil(isl_tokens / block_size) of them.
            pinned: (worker_id, dp_rank) the request must run on. allowed_workers: worker ids it may use.
            excluded_workers: worker ids it must not use (a pin among them: `PinnedNotAllowed`).
            deadline_ms: the longest it may wait in the queue (ms).
            (other options: `Enqueue` in docs/PROTOCOL.md, docs/DESIGN.md §2.1.)
        Returns:
            An open `Lease` (degraded when bypassing an unavailable daemon).
        Raises:
            RequestRejected subclass: the daemon's reason (QueueFull, NoEndpoints, QueueTimeout, ...).
            DaemonUnavailable: not connected, or the daemon stayed away past `reconnect_deadline_s`.
            TypeError: an argument of the wrong type (checked before sending, see `checks.py`).
            ValueError: an argument out of its bounds, malformed block_hashes, or request_id already
                waiting in this client.
            KvschedError: called in a forked child of the process that created this client
                (`foreign_process_error`): create a client per process.
            ProtocolError: the daemon answered this request with an `Error` (it could not decode it).
            FrameTooLarge (a ProtocolError and a ValueError): the request's `Enqueue` is larger than
                the daemon's `max_frame_bytes` (nothing was sent), or no longer fits the limit of a
                restarted daemon it had to be re-sent to.
        """
        wrong = foreign_process_error(self._pid)
        if wrong is not None:
            raise wrong
        if self._link is None or self._loop is None:
            raise DaemonUnavailable(f"not connected to {self.endpoint}; call connect() first")
        frame = checked_enqueue(
            request_id,
            isl_tokens,
            block_hashes,
            policy_class,
            priority,
            strict_priority,
            session_id,
            expected_osl,
            pinned,
            allowed_workers,
            do_not_queue,
            deadline_ms,
            lora_name,
            excluded_workers,
        )
        if (
            not self._link.connected
            and self.on_unavailable == "bypass"
            and outage_expired(self._link, self.reconnect_deadline_s)
        ):
            return self._degraded_lease(request_id, isl_tokens, pinned)
        return await self._await_admission(request_id, isl_tokens, frame)

    def _degraded_lease(self, request_id: str, isl_tokens: int, pinned: tuple[int, int] | None) -> Lease:
        self.degraded_total += 1
        worker = p.WorkerKey(*pinned) if pinned is not None else random.choice(self.bypass_workers)
        return Lease(None, request_id, worker, -1, 0, 0, 0, 0, isl_tokens, degraded=True)

    async def _await_admission(self, request_id: str, isl_tokens: int, frame: p.Enqueue | p.Update) -> Lease:
        wrong = foreign_process_error(self._pid)
        if wrong is not None:
            raise wrong
        if request_id in self._pending:
            raise ValueError(f"request {request_id!r} is already waiting in this client")
        if self._link is None or self._loop is None:
            raise DaemonUnavailable(f"connection to {self.endpoint} is closed")
        fut: asyncio.Future[Answer] = self._loop.create_future()
        self._pending.open(request_id, fut, frame, isl_tokens)
        origins = self._pending.origins
        try:
            # An Enqueue is not buffered while the link is down: Reattach re-sends every waiting one.
            self._link.send(frame, buffer_when_down=not isinstance(frame, p.Enqueue))
            reply = await fut
        except asyncio.CancelledError:
            origins.pop(request_id, None)
            entry = self._pending.close(request_id)
            if entry is not None and entry.future is fut and self._link is not None:
                answer = fut.result() if fut.done() and not fut.cancelled() and fut.exception() is None else None
                if isinstance(answer, p.Admitted):  # admitted just before the cancel landed: give it back
                    self._link.send(p.Release(request_id, answer.slot, answer.generation, "aborted", 0))
                else:
                    self._link.send(p.Release(request_id, -1, 0, "cancelled", 0))
            raise
        finally:
            self._pending.close(request_id)
        if isinstance(reply, Bypass):
            origins.pop(request_id, None)
            return self._degraded_lease(request_id, isl_tokens, frame.pinned if isinstance(frame, p.Enqueue) else None)
        if isinstance(reply, p.Rejected):
            origins.pop(request_id, None)
            raise rejection_error(
                reply.request_id,
                reply.reason,
                reply.detail,
                reply.policy_class,
                reply.limit_kind,
                reply.current,
                reply.limit,
            )
        lease = Lease(
            self._channel,
            reply.request_id,
            p.WorkerKey(reply.worker_id, reply.dp_rank),
            reply.slot,
            reply.generation,
            reply.cached_tokens,
            reply.overlap_blocks,
            reply.queued_us,
            isl_tokens,
            url=reply.url,
            dp_size=reply.dp_size,
        )
        self._leases[request_id] = weakref.ref(lease)
        if isinstance(frame, p.Enqueue):
            origins[request_id] = frame
        return lease

    async def _requeue(self, lease: Lease) -> Lease:
        frame = p.Update(lease.request_id, lease.slot, lease.generation, "requeue")
        return await self._await_admission(lease.request_id, lease.isl_tokens, frame)

    def _arm_deadline_timer(self) -> None:
        if self._loop is not None:
            self._deadline_timer = self._loop.call_later(0.25, _weak_callback(self._check_deadline))

    def _check_deadline(self) -> None:
        if self._link is None:
            return
        if self._pending and self._link.ever_connected and outage_expired(self._link, self.reconnect_deadline_s):
            err = f"daemon at {self.endpoint} unreachable for more than {self.reconnect_deadline_s:.0f}s"
            self._pending.expire(err, bypass=self.on_unavailable == "bypass")
        self._arm_deadline_timer()

    # ------------------------------------------------------------------ lease callbacks
    def _send(self, frame: p.Frame) -> None:
        wrong = foreign_process_error(self._pid)
        if wrong is not None:  # a lease's frame would go out on the parent's connection
            raise wrong
        if self._link is None:
            raise DaemonUnavailable(f"connection to {self.endpoint} is closed")
        self._link.send(frame)

    def _report_progress(self, lease: Lease) -> None:
        if not self._words.store_progress(lease.slot, lease.generation, lease.output_tokens):
            self._send(p.Update(lease.request_id, lease.slot, lease.generation, "progress", lease.output_tokens))

    def _report_state(self, lease: Lease, kind: Literal["dispatched", "prefill_done"]) -> None:
        """`dispatched` / `prefill_done` of a lease: one store into its slot's state word when the
        progress segment is mapped (no frame), else an `Update(kind)` frame."""
        if not self._words.store_state(lease.slot, lease.generation, kind):
            self._send(p.Update(lease.request_id, lease.slot, lease.generation, kind))

    def _forget_lease(self, lease: Lease) -> None:
        ref = self._leases.get(lease.request_id)
        if ref is not None and ref() is lease:
            del self._leases[lease.request_id]
            if lease.outcome != "requeued":  # a requeue still needs its Enqueue (Reattach.requeues)
                self._pending.origins.pop(lease.request_id, None)

    def _release_from_gc(self, request_id: str, slot: int, generation: int) -> None:
        """A lease was collected while open: abort it through the batched cleanup queue."""
        self._pending.origins.pop(request_id, None)  # a single dict operation: safe from any thread (GIL)
        self._dropped.push(request_id, slot, generation)

    def _revoke(self, request_id: str, why: str, outcome: Literal["lost", "revoked"] = "revoked") -> bool:
        """The daemon no longer holds this lease: close it locally and run its `on_dropped` callback.
        "revoked" (operator cancel): its progress calls raise `LeaseRevoked(why)`; "lost" (reaped as
        silent, a restart, or its worker removed: a revocation notice whose reason is not
        `cancelled`, docs/PROTOCOL.md): they raise `LeaseLost(why)`. Release is a no-op for both
        (logged once for a lost lease; see `Lease`)."""
        ref = self._leases.pop(request_id, None)
        if request_id not in self._pending:
            self._pending.origins.pop(request_id, None)
        lease = ref() if ref is not None else None
        if lease is None or lease.outcome is not None:
            return False
        log.warning("lease %s request_id=%s reason=%s", outcome, request_id, why)
        lease.mark_dropped(outcome, why)
        return True

    # ------------------------------------------------------------------ incoming
    def _on_frame(self, frame: p.DaemonFrame) -> None:
        match frame:
            case p.Admitted() | p.Rejected():
                if self._pending.answer(frame):  # a waiting call took it (or parked it: shutting_down)
                    return
                if isinstance(frame, p.Admitted):  # nobody waits (cancelled): give it back
                    self._send(p.Release(frame.request_id, frame.slot, frame.generation, "aborted", 0))
                elif frame.reason == "cancelled":  # an operator's `kvsched cancel`: abort the request
                    self._revoke(frame.request_id, frame.detail)
                elif self._revoke(frame.request_id, frame.detail or frame.reason, outcome="lost"):
                    self.lost_leases.append(frame.request_id)  # e.g. its worker was removed
                    del self.lost_leases[:-1000]
            case p.Reattached():
                revoked = [rid for rid in frame.lost if self._revoke(rid, self._loss_reason, outcome="lost")]
                self.lost_leases.extend(revoked)
                del self.lost_leases[:-1000]
                if revoked:  # a re-sent Release the old daemon had applied comes back "lost" too: not a loss
                    log.warning("daemon lost leases count=%d reason=%s", len(revoked), self._loss_reason)
            case p.Error():
                if frame.code == p.ErrorCode.VERSION and self._welcome_fut and not self._welcome_fut.done():
                    self._welcome_fut.set_exception(ProtocolError(frame.message))
                    return
                error = ProtocolError(f"daemon error {p.error_code_name(frame.code)}: {frame.message}")
                if not frame.request_id or not self._pending.fail(frame.request_id, error):
                    self.errors.append(frame)
                    del self.errors[:-100]


def _weak_callback(method: Callable[..., None]) -> Callable[..., None]:
    """`method` (bound to a client) as a callback that holds its object only weakly: once the object
    is collected, calling it does nothing. The event loop keeps its readers' and timers' callbacks
    (and the link they drive) alive; through this, it does not keep a dropped client alive. Costs one
    weak dereference per call."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> None:
        bound = ref()
        if bound is not None:
            bound(*args)

    return call


def _close_abandoned(
    pid: int, loop: asyncio.AbstractEventLoop, link: Link, ctx: zmq.Context[zmq.Socket[bytes]] | None
) -> None:
    """A client was collected without `close()` (its `weakref.finalize`): close its link — the
    loop's reader and timer, the heartbeat thread, the sockets (docs/DESIGN.md §5.4) — and terminate
    its own context `ctx` (None: the caller's). On the loop's thread it closes at once, else it hands
    the close to the loop; in a forked child it does nothing (the sockets are the parent's)."""
    if os.getpid() != pid or link.closed:
        return
    try:
        here = asyncio.get_running_loop() is loop
    except RuntimeError:
        here = False
    if not here and not loop.is_closed():
        try:
            loop.call_soon_threadsafe(_close_abandoned, pid, loop, link, ctx)
            return
        except RuntimeError:  # the loop closed meanwhile: close from here
            pass
    link.close()
    if ctx is not None and not ctx.closed:
        ctx.term()
