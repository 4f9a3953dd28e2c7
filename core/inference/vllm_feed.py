"""One vLLM replica's KV events over ZeroMQ, translated and handed to a listener (precise mode's feed).

vLLM publishes each batch as ``[topic, seq, payload]``: ``seq`` an 8-byte big-endian counter from 0
per publisher (it starts again at 0 when the engine restarts), ``payload`` msgpack
(:func:`~.vllm_events.decode_batch`). Its PUB socket binds when the configured endpoint is a
wildcard (``*`` or ``::`` in it) or ``ipc://`` / ``inproc://``, and connects otherwise, so
:class:`VLLMEventFeed` does the opposite (:func:`subscriber_binds`): give it the endpoint exactly as
in vLLM's ``--kv-events-config``. With ``tcp://127.0.0.1:5557`` vLLM connects and the feed binds
that address (one bound feed takes a restarted engine back without reconnecting); with
``tcp://*:5557`` vLLM binds and the feed connects to ``tcp://127.0.0.1:5557`` (``*`` read as this
host; to reach a remote engine that binds a wildcard, pass its address and ``bind=False``).
A data-parallel engine publishes one stream per rank (port + rank): one feed, and one replica
index, per rank.

The sequence numbers tell the feed what it missed. On a jump it asks vLLM's replay socket (a ROUTER
that always binds, ``replay_endpoint`` in the config) for the missing batches: it sends
``[b"", start]`` from a DEALER, so the ROUTER sees ``[identity, b"", start]``, and reads
``[..., seq, payload]`` replies (the last two frames) up to the end marker ``seq == -1`` with an
empty payload. Without a replay socket, or when the replay times out or the engine no longer holds
those batches, the feed emits :class:`~loopstack.engine.seams.kv_events.AllBlocksCleared` for the
replica, so the index forgets it rather than routing on a stale picture, and goes on from the new
batch. A sequence number that goes back (0 after a restart) or a new ``publisher_id`` is a restarted
engine: cleared first, then whatever it published before the batch in hand is replayed. A payload
that does not decode is logged and counted, and clears the replica too (its changes are lost).

A feed that starts beside a running engine (a router started or restarted while vLLM serves)
catches up first: when its first batch is not batch #0 it asks the replay socket for everything
before it and applies what the engine still holds, from its oldest buffered batch on (vLLM keeps
``buffer_steps``, 10,000 by default). Applied in order, any such tail of the history gives a
correct picture of the blocks it names; blocks stored before the tail stay unknown (their children
are skipped as unknown parents), an under-estimate that heals as the cache turns over. Without a
replay socket, or if the catch-up times out, the first batch is taken as it comes, as before.

The feed runs on its own daemon thread, which calls ``listener(replica_index, event)`` for every
translated event in order; hand events off from there if the consumer is not thread-safe. Nothing
in the constructor or in :meth:`VLLMEventFeed.close` waits on the network: ``close`` returns within
one poll interval (50 ms), plus whatever the listener call in progress takes.

Example::

    index = BlockIndex(2)
    feeds = [VLLMEventFeed(i, f"tcp://127.0.0.1:{5557 + i}", listener=index.apply) for i in range(2)]
    ...
    for feed in feeds:
        feed.close()
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeAlias

import zmq

from loopstack.engine.seams.kv_events import KVCacheEvent
from loopstack.inference.vllm_events import (
    HashTranslator,
    VLLMEventBatch,
    VLLMEventDecodeError,
    decode_batch,
)

__all__ = ["FeedListener", "VLLMEventFeed", "VLLMEventFeedStatistics", "subscriber_binds"]

logger = logging.getLogger(__name__)

FeedListener: TypeAlias = Callable[[int, KVCacheEvent], None]

_END_OF_REPLAY = -1


def subscriber_binds(endpoint: str) -> bool:
    """Whether our SUB binds ``endpoint``: exactly when vLLM's PUB, given the same string, connects."""
    publisher_binds = "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
    return not publisher_binds


def _connectable(endpoint: str) -> str:
    """A wildcard address of vLLM's (``tcp://*:5557``) as the address to connect to on this host."""
    return endpoint.replace("://*:", "://127.0.0.1:").replace("://[::]:", "://[::1]:")


class VLLMEventFeedStatistics(NamedTuple):
    """Counters of one :class:`VLLMEventFeed` since it started."""

    batches: int  # batches applied, live or replayed
    events: int  # loopstack events handed to the listener
    gaps: int  # jumps in the sequence numbers (a restart with batches missed counts too)
    replays: int  # replay requests sent
    replay_failures: int  # replays that timed out or came back incomplete (the replica was cleared)
    skipped_unknown_parent: int  # BlockStored events whose parent block was never seen
    decode_errors: int  # messages that were not a vLLM event batch
    restarts: int  # the sequence went back, or the publisher id changed
    catch_ups: int  # replays asked for at start, of what the engine published before the first batch seen
    catch_up_failures: int  # of those, the ones that timed out or came back malformed (nothing was applied)
    catch_up_batches: int  # batches they applied
    unknown_events: int  # events of types the decoder does not know, skipped
    listener_errors: int


class VLLMEventFeed:
    """Subscribes to one vLLM replica's KV events and calls ``listener`` with translated events.

    The socket is set up (bound or connected, see the module docstring) before the constructor
    returns, so a busy port raises here; :attr:`endpoint` is the address actually bound (port 0
    asks for a free one).

    Args:
        replica_index: passed to ``listener`` with every event.
        endpoint: vLLM's ``endpoint`` setting.
        replay_endpoint: vLLM's ``replay_endpoint`` (None: gaps clear the replica); always connected
            to, ``*`` read as this host.
        topic: vLLM's ``topic`` (a prefix filter; ``""`` takes everything).
        listener: called on the feed's thread; an exception is logged and counted.
        bind: override the bind-or-connect rule.
        translator: the hash translator (one per replica; the default follows KV cache group 0).
        replay_timeout_s: how long one replay may take before the replica is cleared instead.
        receive_hwm: messages the SUB socket queues (vLLM's PUB default is 100000) while a replay runs.
        poll_interval_s: how often the thread looks at the stop flag.
    """

    def __init__(
        self,
        replica_index: int,
        endpoint: str,
        *,
        replay_endpoint: str | None = None,
        topic: str = "",
        listener: FeedListener,
        bind: bool | None = None,
        translator: HashTranslator | None = None,
        replay_timeout_s: float = 2.0,
        receive_hwm: int = 100_000,
        poll_interval_s: float = 0.05,
    ) -> None:
        self.replica_index = replica_index
        self.replay_endpoint = None if replay_endpoint is None else _connectable(replay_endpoint)
        self.replay_timeout_s = replay_timeout_s
        self._listener = listener
        self._translator = translator or HashTranslator()
        self._poll_ms = max(1, int(poll_interval_s * 1000))
        self._binds = subscriber_binds(endpoint) if bind is None else bind
        self._context = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        try:
            self._sub.setsockopt(zmq.LINGER, 0)
            self._sub.setsockopt(zmq.RCVHWM, receive_hwm)
            self._sub.setsockopt(zmq.IPV6, 1 if "[" in endpoint else 0)
            self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
            if self._binds:
                self._sub.bind(endpoint)
                self.endpoint = self._sub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self.endpoint = _connectable(endpoint)
                self._sub.connect(self.endpoint)
        except BaseException:
            self._sub.close(linger=0)
            self._context.term()
            raise
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(VLLMEventFeedStatistics._fields, 0)
        self._last_sequence: int | None = None
        self._publisher_id: bytes | None = None
        self._dirty = True  # the listener may hold blocks of this replica (it is not known to be clear)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"vllm-kv-feed-{replica_index}", daemon=True)
        self._thread.start()

    @property
    def binds(self) -> bool:
        """True when the feed bound :attr:`endpoint` (vLLM connects), False when it connected."""
        return self._binds

    @property
    def last_sequence_number(self) -> int | None:
        """vLLM's sequence number of the last batch handled (None before the first)."""
        with self._lock:
            return self._last_sequence

    def statistics(self) -> VLLMEventFeedStatistics:
        with self._lock:
            return VLLMEventFeedStatistics(**self._counts)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread and release the sockets; calling it again does nothing."""
        self._stopping.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("vLLM KV feed of replica %d did not stop within %.1fs", self.replica_index, timeout_s)

    def __enter__(self) -> VLLMEventFeed:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- the feed's thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                if not self._sub.poll(self._poll_ms):
                    continue
                frames = self._sub.recv_multipart()
                try:
                    self._on_message(frames)
                except Exception:  # a bug here must not stop the feed; the replica's view is suspect
                    logger.exception("vLLM KV feed of replica %d failed on a message", self.replica_index)
                    self._count("decode_errors")
                    self._clear()
        finally:
            self._sub.close(linger=0)
            self._context.term()

    def _on_message(self, frames: Sequence[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            # no usable sequence number: if it was a batch, the next one shows the gap
            self._decode_error(f"expected [topic, 8-byte seq, payload], got {len(frames)} frames")
            return
        seq = int.from_bytes(frames[1], "big")
        batch: VLLMEventBatch | None = None
        try:
            batch = decode_batch(frames[2])
        except VLLMEventDecodeError as exc:
            self._decode_error(f"batch #{seq}: {exc}")
        last = self._last_sequence
        restarted = last is not None and (
            seq <= last
            or (batch is not None and None not in (batch.publisher_id, self._publisher_id)
                and batch.publisher_id != self._publisher_id)
        )
        if restarted:
            logger.warning("vLLM replica %d restarted (batch #%d after #%s): forgetting its blocks",
                           self.replica_index, seq, last)
            self._count("restarts")
            self._clear()
            last = -1  # replay what it published before this batch
        if last is not None and seq > last + 1:
            self._count("gaps")
            self._recover(last + 1, seq)
        elif last is None and seq > 0 and self.replay_endpoint is not None:
            self._catch_up(seq)
        if batch is None:
            self._clear()  # what the lost batch changed is unknown
        else:
            self._apply(batch)
            self._publisher_id = batch.publisher_id
        with self._lock:
            self._last_sequence = seq

    def _recover(self, start: int, stop: int) -> None:
        """Replay batches ``start`` to ``stop - 1``, or clear the replica."""
        batches = None
        if self.replay_endpoint is not None:
            self._count("replays")
            batches = self._replay(start, stop)
            if batches is None:
                self._count("replay_failures")
        if batches is None:
            logger.warning("vLLM replica %d: batches #%d-#%d missed and not replayed: forgetting its blocks",
                           self.replica_index, start, stop - 1)
            self._clear()
            return
        for batch in batches:
            self._apply(batch)

    def _catch_up(self, stop: int) -> None:
        """Apply what the engine still holds of batches 0 to ``stop - 1`` (the feed's first batch is #stop)."""
        self._count("catch_ups")
        batches = self._replay(0, stop, tail=True)
        if batches is None:
            self._count("catch_up_failures")
            return  # taken as it comes: nothing known is wrong, only less is known
        for batch in batches:
            self._apply(batch)
        with self._lock:
            self._counts["catch_up_batches"] += len(batches)

    def _replay(self, start: int, stop: int, *, tail: bool = False) -> list[VLLMEventBatch] | None:
        """The batches ``start`` to ``stop - 1`` from the replay socket, all of them or None;
        ``tail``: a contiguous run ending at ``stop - 1`` from wherever the engine's buffer begins."""
        assert self.replay_endpoint is not None
        dealer = self._context.socket(zmq.DEALER)
        payloads: list[bytes] = []
        try:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.IPV6, 1 if "[" in self.replay_endpoint else 0)
            dealer.connect(self.replay_endpoint)
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + self.replay_timeout_s
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._stopping.is_set():
                    logger.warning("vLLM replica %d: replay from #%d timed out", self.replica_index, start)
                    return None
                if not dealer.poll(min(self._poll_ms, max(1, int(remaining * 1000)))):
                    continue
                frames = dealer.recv_multipart()
                if len(frames) < 2 or len(frames[-2]) != 8:
                    logger.warning("vLLM replica %d: malformed replay reply", self.replica_index)
                    return None
                seq, payload = int.from_bytes(frames[-2], "big", signed=True), frames[-1]
                if seq == _END_OF_REPLAY or not payload:
                    break
                if tail and not payloads and start <= seq < stop:
                    start = seq  # the oldest batch the engine still holds
                if start + len(payloads) <= seq < stop:
                    if seq != start + len(payloads):
                        break  # the engine no longer holds the batches in between
                    payloads.append(payload)
        finally:
            dealer.close(linger=0)
        if tail and not payloads:
            return []  # the engine holds nothing from before ``stop``
        if len(payloads) != stop - start:
            logger.warning("vLLM replica %d: replay returned %d of batches #%d-#%d", self.replica_index,
                           len(payloads), start, stop - 1)
            return None
        try:
            return [decode_batch(payload) for payload in payloads]
        except VLLMEventDecodeError as exc:
            self._decode_error(f"replayed batch: {exc}")
            return None

    def _apply(self, batch: VLLMEventBatch) -> None:
        events = self._translator.translate_batch(batch)
        self._dirty = self._dirty or bool(events)
        for event in events:
            try:
                self._listener(self.replica_index, event)
            except Exception:
                logger.exception("KV event listener failed on replica %d's event %r", self.replica_index, event)
                self._count("listener_errors")
        with self._lock:
            self._counts["batches"] += 1
            self._counts["events"] += len(events)
            self._counts["unknown_events"] += len(batch.unknown_types)
            self._counts["skipped_unknown_parent"] = self._translator.statistics().num_skipped_unknown_parent

    def _clear(self) -> None:
        """Tell the listener to forget the replica's blocks, unless nothing was sent since the last time."""
        if not self._dirty:
            return
        self._dirty = False
        event = self._translator.clear(timestamp=time.time())
        try:
            self._listener(self.replica_index, event)
        except Exception:
            logger.exception("KV event listener failed on replica %d's event %r", self.replica_index, event)
            self._count("listener_errors")
        self._count("events")

    def _decode_error(self, message: str) -> None:
        count = self._count("decode_errors")
        if count & (count - 1) == 0:  # the 1st, 2nd, 4th, 8th, ... so a broken stream does not flood the log
            logger.warning("vLLM replica %d: undecodable KV event message (%d so far): %s",
                           self.replica_index, count, message)

    def _count(self, name: str) -> int:
        with self._lock:
            self._counts[name] += 1
            return self._counts[name]
