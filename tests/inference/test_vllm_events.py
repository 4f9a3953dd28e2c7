"""vLLM's KV events: both wire encodings, the hash translation, and the ZeroMQ feed on loopback."""

from __future__ import annotations

import threading
import time

import msgpack
import pytest
import zmq

from loopstack.engine.seams.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, hash_token_blocks
from loopstack.inference.vllm_events import (
    HashTranslator,
    VLLMAllBlocksCleared,
    VLLMBlockRemoved,
    VLLMBlockStored,
    VLLMEventDecodeError,
    decode_batch,
)
from loopstack.inference.vllm_feed import VLLMEventFeed, subscriber_binds
from loopstack.plugins.cache_routing.block_index import Applied, BlockIndex

TS = 1789095808.83
TOKENS = [11, 12, 13, 14, 15, 16, 17, 18]  # two blocks of 4
H1, H2 = 15760518052499183552, 4093178126412551233  # u64, as VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1 sends them

# v0.10.x: tagged arrays (array_like=True, omit_defaults=True); BlockStored ends at `medium`
V010_ARRAY = [TS, [
    ["BlockStored", [H1, H2], None, TOKENS, 4, None, "GPU"],
    ["BlockRemoved", [H2], "GPU"],
    ["AllBlocksCleared"],
], 0]
# v0.2x before vllm#42892: still arrays, now with lora_name, extra_keys (#33304) and group_idx (#37688)
V02X_ARRAY = [TS, [
    ["BlockStored", [H1, H2], None, TOKENS, 4, None, "GPU", None, [None, None], 0, "full_attention"],
    ["BlockRemoved", [H2], "GPU", 0],
    ["AllBlocksCleared"],
], 0]
# v0.26.0 (vllm#42892): events are maps tagged with "type", the batch is still an array
V026_MAP = [TS, [
    {"type": "BlockStored", "block_hashes": [H1, H2], "parent_block_hash": None, "token_ids": TOKENS,
     "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None, "extra_keys": [None, None],
     "group_idx": 0, "kv_cache_spec_kind": "full_attention"},
    {"type": "BlockRemoved", "block_hashes": [H2], "medium": "GPU", "group_idx": 0},
    {"type": "AllBlocksCleared"},
], 0]


def ours(tokens=TOKENS, block_size=4, salt=b""):
    return hash_token_blocks(tokens, block_size, salt)


def stored(hashes, parent, tokens, *, extra_keys=None, group_idx=None, medium="GPU", lora_name=None):
    return VLLMBlockStored(block_hashes=tuple(hashes), parent_block_hash=parent, token_ids=tuple(tokens),
                           block_size=4, medium=medium, extra_keys=extra_keys, group_idx=group_idx,
                           lora_name=lora_name)


def translate(translator, *events):
    return [out for event in events for out in translator.translate(event)]


# -- decoding ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("wire", [V010_ARRAY, V02X_ARRAY, V026_MAP], ids=["v0.10-array", "v0.2x-array", "v0.26-map"])
def test_every_encoding_decodes_to_the_same_loopstack_events(wire):
    batch = decode_batch(msgpack.packb(wire))
    a, b = ours()
    assert HashTranslator().translate_batch(batch) == [
        BlockStored(block_hashes=(a, b), parent_hash=None, token_ids=tuple(TOKENS), block_size=4, medium="GPU",
                    sequence_number=1, timestamp=TS),
        BlockRemoved(block_hashes=(b,), medium="GPU", sequence_number=2, timestamp=TS),
        AllBlocksCleared(sequence_number=3, timestamp=TS),
    ]
    assert batch.data_parallel_rank == 0 and batch.unknown_types == ()


def test_v09_signed_hashes_and_short_arrays_decode():
    # v0.9.0: [ts, events] without the rank; hash() values are signed; no medium yet
    batch = decode_batch(msgpack.packb([TS, [["BlockStored", [-5, 7], None, TOKENS, 4, None], ["BlockRemoved", [-5]]]]))
    assert batch.events == (
        VLLMBlockStored(block_hashes=(2**64 - 5, 7), parent_block_hash=None, token_ids=tuple(TOKENS), block_size=4),
        VLLMBlockRemoved(block_hashes=(2**64 - 5,)),
    )
    assert batch.data_parallel_rank is None


def test_a_batch_may_be_a_map_and_carry_a_publisher_id():
    # vllm @0181ea31: EventBatch without array_like, so the batch itself is a map
    as_map = decode_batch(msgpack.packb({"ts": TS, "events": V026_MAP[1], "data_parallel_rank": 1}))
    # newest main: [ts, events, rank, publisher_id]
    with_id = decode_batch(msgpack.packb([TS, V026_MAP[1], 1, b"\x07" * 16]))
    assert as_map.events == with_id.events == decode_batch(msgpack.packb(V026_MAP)).events
    assert as_map.data_parallel_rank == with_id.data_parallel_rank == 1
    assert with_id.publisher_id == b"\x07" * 16 and as_map.publisher_id is None


def test_fields_from_newer_versions_are_ignored():
    wire = [TS, [
        {**V026_MAP[1][0], "locality": "device", "kv_cache_spec_sliding_window": 128, "session_id": "s"},
        ["BlockRemoved", [H2], "GPU", 0, "device", "a field not invented yet"],
    ], 0, b"\x01" * 16, "a batch field not invented yet"]
    batch = decode_batch(msgpack.packb(wire))
    assert batch.events == decode_batch(msgpack.packb(V026_MAP)).events[:2]


def test_full_digest_hashes_are_bytes():
    # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: 32-byte sha256 digests, as msgpack bin
    first, second = b"\x01" * 32, b"\x02" * 32
    wire = [TS, [{"type": "BlockStored", "block_hashes": [second], "parent_block_hash": first,
                  "token_ids": TOKENS[4:], "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None}]]
    (event,) = decode_batch(msgpack.packb(wire)).events
    assert isinstance(event, VLLMBlockStored)
    assert event.block_hashes == (second,) and event.parent_block_hash == first


def test_unknown_event_types_are_skipped_and_counted():
    wire = [TS, [["BlockMoved", [H1], "CPU"], {"type": "Heartbeat"}, ["AllBlocksCleared"]], 0]
    batch = decode_batch(msgpack.packb(wire))
    assert batch.events == (VLLMAllBlocksCleared(),)
    assert batch.unknown_types == ("BlockMoved", "Heartbeat")


@pytest.mark.parametrize(("payload", "complaint"), [
    (b"\xc1not msgpack", "not valid msgpack"),
    (msgpack.packb(42), "expected an array or a map"),
    (msgpack.packb([TS]), "missing field 'events'"),
    (msgpack.packb([TS, [["BlockStored", [H1], None]]]), "missing field 'token_ids'"),
    (msgpack.packb([TS, [["BlockStored", [H1], None, TOKENS, 4]]]), "8 token ids for 1 blocks of 4"),
    (msgpack.packb([TS, [["BlockRemoved", ["not a hash"]]]]), "must be an int or bytes"),
    (msgpack.packb([TS, [{"block_hashes": [H1]}]]), "needs a string 'type'"),
    (msgpack.packb([TS, [[7, [H1]]]]), "must start with its type name"),
], ids=["garbage", "scalar", "no-events", "no-tokens", "token-count", "str-hash", "untagged-map", "untagged-array"])
def test_malformed_payloads_raise_a_decode_error_naming_the_problem(payload, complaint):
    with pytest.raises(VLLMEventDecodeError, match=complaint):
        decode_batch(payload)


# -- translation ------------------------------------------------------------------------------------


def test_translated_hashes_are_the_routers_own_chain():
    (event,) = translate(HashTranslator(), stored([H1, H2], None, TOKENS))
    index = BlockIndex(1)
    assert index.apply(0, event) is Applied.APPLIED
    prompt = TOKENS + [19, 20, 21]  # the request the router hashes: the cached prefix and more
    assert event.block_hashes == tuple(ours())
    assert index.match(hash_token_blocks(prompt, 4)) == {0: 2}


def test_the_cache_salt_enters_the_first_block_only():
    (event,) = translate(HashTranslator(), stored([H1, H2], None, TOKENS, extra_keys=(("tenant-a",), None)))
    assert event.block_hashes == tuple(ours(salt=b"tenant-a"))
    assert event.salt == b"tenant-a"
    assert not set(event.block_hashes) & set(ours())  # another tenant's identical prompt never matches


def test_a_chained_block_stored_continues_from_its_parent():
    tokens = TOKENS + [19, 20, 21, 22]
    translator = HashTranslator()
    first, second = translate(
        translator,
        stored([H1, H2], None, TOKENS, extra_keys=(("tenant-a",), None)),
        stored([99], H2, tokens[8:]),  # the next turn: its parent is the first event's last block
    )
    chain = ours(tokens, salt=b"tenant-a")
    assert first.block_hashes == tuple(chain[:2])
    assert second.block_hashes == (chain[2],) and second.parent_hash == chain[1] and second.salt is None
    assert (first.sequence_number, second.sequence_number) == (1, 2)


def test_block_removed_is_translated_and_forgotten():
    translator = HashTranslator()
    translate(translator, stored([H1, H2], None, TOKENS))
    (removed,) = translate(translator, VLLMBlockRemoved(block_hashes=(H2, 12345), medium="GPU"))
    assert removed == BlockRemoved(block_hashes=(ours()[1],), medium="GPU", sequence_number=2)
    assert translator.our_hash(H2) is None and translator.our_hash(H1) == ours()[0]
    assert translate(translator, stored([99], H2, [1, 2, 3, 4])) == []  # its child can no longer be placed


def test_a_block_stored_with_an_unknown_parent_is_skipped_and_counted():
    translator = HashTranslator()
    assert translate(translator, stored([H2], H1, TOKENS[4:])) == []
    (event,) = translate(translator, stored([H1], None, TOKENS[:4]))
    assert event.sequence_number == 1  # skipped events take no number
    assert translator.statistics().num_skipped_unknown_parent == 1


def test_other_kv_cache_groups_are_ignored_unless_chosen():
    sliding = stored([H1, H2], None, TOKENS, group_idx=1)
    assert translate(HashTranslator(), sliding, VLLMBlockRemoved(block_hashes=(H1,), group_idx=1)) == []
    assert translate(HashTranslator(group_idx=1), sliding)[0].block_hashes == tuple(ours())
    assert len(translate(HashTranslator(), stored([H1, H2], None, TOKENS, group_idx=0))) == 1


def test_a_block_vllm_holds_twice_goes_with_its_last_copy():
    translator = HashTranslator()
    translate(translator, stored([H1], None, TOKENS[:4]), stored([H1], None, TOKENS[:4]))  # two concurrent prefills
    assert translate(translator, VLLMBlockRemoved(block_hashes=(H1,), medium="GPU")) == []
    (removed,) = translate(translator, VLLMBlockRemoved(block_hashes=(H1,), medium="GPU"))
    assert removed.block_hashes == (ours()[0],)


def test_the_medium_passes_through_and_is_counted_apart():
    translator = HashTranslator()
    translate(translator, stored([H1], None, TOKENS[:4]))
    (offloaded,) = translate(translator, stored([H1], None, TOKENS[:4], medium="CPU"))
    assert offloaded.medium == "CPU"
    (evicted,) = translate(translator, VLLMBlockRemoved(block_hashes=(H1,), medium="GPU"))
    assert evicted.medium == "GPU" and translator.our_hash(H1) == ours()[0]  # still on CPU: children can chain


def test_blocks_hashed_with_more_than_tokens_are_not_translated():
    image = stored([H1, H2], None, TOKENS, extra_keys=(None, (("image-digest", 1),)))
    (event,) = translate(HashTranslator(), image)
    assert event.block_hashes == (ours()[0],)  # the image block and whatever follows it are not the router's
    assert translate(HashTranslator(), stored([H1, H2], None, TOKENS, lora_name="adapter")) == []


def test_the_map_is_bounded_and_passes_evictions_on_as_removals():
    translator = HashTranslator(max_entries=1)
    stored_event, evicted = translate(translator, stored([H1, H2], None, TOKENS))
    assert isinstance(evicted, BlockRemoved) and evicted.block_hashes == (ours()[0],)
    assert translator.statistics().num_evicted == 1 and translator.our_hash(H2) == ours()[1]


def test_all_blocks_cleared_forgets_every_mapping():
    translator = HashTranslator()
    translate(translator, stored([H1, H2], None, TOKENS))
    (cleared,) = translate(translator, VLLMAllBlocksCleared())
    assert cleared == AllBlocksCleared(sequence_number=2)
    assert translator.statistics().num_entries == 0


# -- the ZeroMQ feed --------------------------------------------------------------------------------


@pytest.mark.parametrize(("endpoint", "binds"), [
    ("tcp://127.0.0.1:5557", True), ("tcp://localhost:5557", True), ("tcp://*:5557", False),
    ("tcp://[::]:5557", False), ("ipc:///tmp/kv", False), ("inproc://kv", False),
])
def test_the_feed_binds_exactly_when_vllm_would_connect(endpoint, binds):
    assert subscriber_binds(endpoint) is binds


class Listener:
    """The router's side: a block index fed by the feed, and every event it was given."""

    def __init__(self):
        self.index = BlockIndex(1)
        self.events = []
        self.results = []

    def __call__(self, replica, event):
        self.events.append(event)
        self.results.append(self.index.apply(replica, event))


class FakeVLLM:
    """vLLM's side: a PUB socket that connects to the feed, and the buffer its replay socket serves."""

    def __init__(self, context, feed_endpoint):
        self.pub = context(zmq.PUB)
        self.pub.connect(feed_endpoint)
        self.buffer = {}
        self.lock = threading.Lock()

    def publish(self, seq, events, *, send=True, publisher_id=None):
        batch = [TS + seq, events, 0] if publisher_id is None else [TS + seq, events, 0, publisher_id]
        payload = msgpack.packb(batch)
        with self.lock:
            self.buffer[seq] = payload
        if send:
            self.pub.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    def join(self, feed, start=0):
        """Publish empty batches from ``start`` until the feed handles the latest one (ZeroMQ drops
        what a PUB sends before the subscription reaches it); returns the next sequence number."""
        deadline = time.monotonic() + 10
        for seq in range(start, 1_000_000):
            assert time.monotonic() < deadline, "the feed never received a probe"
            self.publish(seq, [])
            if poll(lambda: feed.last_sequence_number == seq, timeout_s=0.2, fail=False):
                return seq + 1
        raise AssertionError("unreachable")


class ReplayServer:
    """vLLM's replay socket: a ROUTER bound on loopback answering ``[identity, b"", start]`` with
    ``[identity, b"", seq, payload]`` for every buffered batch from ``start``, then the end marker."""

    def __init__(self, context, vllm=None, *, answers=True):
        self.socket = context(zmq.ROUTER)
        self.endpoint = f"tcp://127.0.0.1:{self.socket.bind_to_random_port('tcp://127.0.0.1')}"
        self.vllm = vllm
        self.requests = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve if answers else self._ignore, daemon=True)
        self._thread.start()

    def _serve(self):
        while not self._stop.is_set():
            if not self.socket.poll(10):
                continue
            frames = self.socket.recv_multipart()
            if len(frames) != 3:
                continue  # vLLM ignores anything else
            identity, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            self.requests.append(start)
            with self.vllm.lock:
                buffered = sorted(self.vllm.buffer.items())
            for seq, payload in buffered:
                if seq >= start:
                    self.socket.send_multipart([identity, b"", seq.to_bytes(8, "big"), payload])
            self.socket.send_multipart([identity, b"", (-1).to_bytes(8, "big", signed=True), b""])

    def _ignore(self):
        self._stop.wait()

    def close(self):
        self._stop.set()
        self._thread.join()


@pytest.fixture
def context():
    """A context whose sockets all close at teardown (a socket left to the GC warns, and then blocks ``term``)."""
    context = zmq.Context()
    opened = []

    def socket(kind):
        opened.append(context.socket(kind))
        opened[-1].setsockopt(zmq.LINGER, 0)
        return opened[-1]

    yield socket
    for socket_ in opened:
        socket_.close(linger=0)
    context.term()


@pytest.fixture
def open_feed():
    feeds = []

    def open_(listener, **options):
        feed = VLLMEventFeed(0, options.pop("endpoint", "tcp://127.0.0.1:0"), listener=listener, **options)
        feeds.append(feed)
        return feed

    yield open_
    for feed in feeds:
        feed.close()


@pytest.fixture
def servers():
    started = []
    yield started
    for server in started:
        server.close()


@pytest.fixture
def replayed(context, open_feed, servers):
    """A feed with a replay server and a fake vLLM beside it: (listener, server, feed, vllm)."""

    def make(*, answers=True, **feed_options):
        listener = Listener()
        server = ReplayServer(context, answers=answers)
        servers.append(server)
        feed = open_feed(listener, replay_endpoint=server.endpoint, **feed_options)
        vllm = server.vllm = FakeVLLM(context, feed.endpoint)
        return listener, server, feed, vllm

    return make


def poll(condition, *, timeout_s=10.0, fail=True):
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            assert not fail, "condition not met in time"
            return False
        time.sleep(0.002)
    return True


def vllm_stored(hashes, parent, tokens):
    # the v0.26 map encoding, as a live engine sends it
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None,
            "extra_keys": [None] * len(hashes), "group_idx": 0, "kv_cache_spec_kind": "full_attention"}


def vllm_removed(hashes):
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": "GPU", "group_idx": 0}


PROMPT = list(range(100, 120))  # five blocks of 4
OTHER = [7, 7, 7, 7]


def test_the_feed_replays_a_missed_batch_and_applies_each_batch_once(replayed):
    listener, server, feed, vllm = replayed()
    n = vllm.join(feed)
    before = feed.statistics()
    vllm.publish(n, [vllm_stored([1, 2], None, PROMPT[:8])])
    vllm.publish(n + 1, [vllm_stored([3], 2, PROMPT[8:12])])
    vllm.publish(n + 2, [vllm_stored([50], None, OTHER)])
    vllm.publish(n + 3, [vllm_removed([50]), vllm_stored([4], 3, PROMPT[12:16])], send=False)  # lost
    vllm.publish(n + 4, [vllm_stored([5], 4, PROMPT[16:20])])  # needs block 4 from the lost batch
    poll(lambda: feed.last_sequence_number == n + 4)
    stats = feed.statistics()
    assert server.requests == [0] * stats.catch_ups + [n + 3]  # a catch-up at start, if the first probe seen was not #0
    assert (stats.batches - before.batches, stats.gaps, stats.replays, stats.replay_failures) == (5, 1, 1, 0)
    assert listener.index.match(hash_token_blocks(PROMPT, 4)) == {0: 5}
    assert listener.index.statistics().num_blocks_per_replica == (5,)  # OTHER's block was removed
    assert set(listener.results) == {Applied.APPLIED}
    last_block = hash_token_blocks(PROMPT, 4)[4]
    assert [e.block_hashes for e in listener.events if isinstance(e, BlockStored)].count((last_block,)) == 1
    assert not any(isinstance(e, AllBlocksCleared) for e in listener.events)


def test_a_feed_started_beside_a_running_engine_catches_up_on_its_history(replayed):
    listener, server, feed, vllm = replayed()
    # what the engine published before this router existed
    vllm.publish(0, [vllm_stored([1, 2], None, PROMPT[:8])], send=False)
    vllm.publish(1, [vllm_stored([50], None, OTHER)], send=False)
    vllm.publish(2, [vllm_stored([3], 2, PROMPT[8:12]), vllm_removed([50])], send=False)
    n = vllm.join(feed, start=3)
    vllm.publish(n, [vllm_stored([4], 3, PROMPT[12:16])])  # its parent is in the history
    poll(lambda: feed.last_sequence_number == n)
    stats = feed.statistics()
    assert server.requests[0] == 0 and (stats.catch_ups, stats.catch_up_failures) == (1, 0)
    assert stats.catch_up_batches >= 3 and stats.gaps == 0
    assert listener.index.match(hash_token_blocks(PROMPT, 4)) == {0: 4}
    assert listener.index.match(hash_token_blocks(OTHER, 4)) == {}  # stored and removed before the start
    assert stats.skipped_unknown_parent == 0


def test_a_catch_up_applies_the_tail_the_engine_still_holds(replayed):
    listener, server, feed, vllm = replayed()
    vllm.publish(0, [vllm_stored([1, 2], None, PROMPT[:8])], send=False)
    vllm.publish(1, [vllm_stored([50], None, OTHER)], send=False)
    vllm.publish(2, [vllm_stored([3], 2, PROMPT[8:12])], send=False)
    with vllm.lock:
        del vllm.buffer[0]  # past the engine's replay buffer
    n = vllm.join(feed, start=3)
    poll(lambda: feed.last_sequence_number == n - 1)
    stats = feed.statistics()
    assert (stats.catch_ups, stats.catch_up_failures) == (1, 0) and stats.catch_up_batches >= 2
    assert listener.index.match(hash_token_blocks(OTHER, 4)) == {0: 1}
    assert listener.index.match(hash_token_blocks(PROMPT, 4)) == {}  # its first blocks were in batch #0
    assert stats.skipped_unknown_parent == 1
    assert not any(isinstance(e, AllBlocksCleared) for e in listener.events)


def test_a_catch_up_that_times_out_leaves_the_feed_as_it_was(replayed):
    listener, server, feed, vllm = replayed(answers=False, replay_timeout_s=0.2)
    n = vllm.join(feed, start=5)
    vllm.publish(n, [vllm_stored([50], None, OTHER)])
    poll(lambda: feed.last_sequence_number == n)
    stats = feed.statistics()
    assert (stats.catch_ups, stats.catch_up_failures, stats.catch_up_batches) == (1, 1, 0)
    assert listener.index.match(hash_token_blocks(OTHER, 4)) == {0: 1}


def test_without_a_replay_socket_a_gap_clears_the_replica(context, open_feed):
    listener = Listener()
    feed = open_feed(listener)
    vllm = FakeVLLM(context, feed.endpoint)
    n = vllm.join(feed)
    vllm.publish(n, [vllm_stored([1, 2], None, PROMPT[:8])])
    vllm.publish(n + 1, [vllm_stored([3], 2, PROMPT[8:12])], send=False)  # lost
    vllm.publish(n + 2, [vllm_stored([50], None, OTHER)])
    vllm.publish(n + 3, [vllm_stored([4], 3, PROMPT[12:16])])  # its parent came in the lost batch
    poll(lambda: feed.last_sequence_number == n + 3)
    assert any(isinstance(e, AllBlocksCleared) for e in listener.events)
    assert listener.index.match(hash_token_blocks(PROMPT, 4)) == {}
    assert listener.index.match(hash_token_blocks(OTHER, 4)) == {0: 1}
    stats = feed.statistics()
    assert (stats.gaps, stats.replays, stats.skipped_unknown_parent) == (1, 0, 1)


def test_a_replay_that_times_out_clears_the_replica(replayed):
    listener, server, feed, vllm = replayed(answers=False, replay_timeout_s=0.2)
    n = vllm.join(feed)
    vllm.publish(n, [vllm_stored([1, 2], None, PROMPT[:8])])
    vllm.publish(n + 2, [vllm_stored([50], None, OTHER)])  # n + 1 never sent
    poll(lambda: feed.last_sequence_number == n + 2)
    stats = feed.statistics()
    assert (stats.replays, stats.replay_failures) == (1, 1)
    assert listener.index.statistics().num_blocks_per_replica == (1,)
    assert listener.index.match(hash_token_blocks(OTHER, 4)) == {0: 1}


def test_a_restarted_engine_clears_the_replica(context, open_feed):
    listener = Listener()
    feed = open_feed(listener)
    vllm = FakeVLLM(context, feed.endpoint)
    n = vllm.join(feed)
    vllm.publish(n, [vllm_stored([1, 2], None, PROMPT[:8])])
    poll(lambda: feed.last_sequence_number == n)
    vllm.publish(0, [vllm_stored([50], None, OTHER)])  # the new engine counts from 0 again
    poll(lambda: feed.statistics().restarts == 1 and feed.last_sequence_number == 0)
    assert isinstance(listener.events[-2], AllBlocksCleared)
    assert listener.index.match(hash_token_blocks(PROMPT, 4)) == {}
    assert listener.index.match(hash_token_blocks(OTHER, 4)) == {0: 1}


def test_a_restart_seen_late_replays_what_the_new_engine_published_first(replayed):
    listener, server, feed, vllm = replayed()
    n = vllm.join(feed)
    vllm.publish(n, [vllm_stored([1, 2], None, PROMPT[:8])])
    poll(lambda: feed.last_sequence_number == n)
    vllm.publish(0, [vllm_stored([50], None, OTHER)], send=False)  # the new engine's first batch, missed
    vllm.publish(1, [vllm_stored([51], 50, [8, 8, 8, 8])])
    poll(lambda: feed.last_sequence_number == 1)
    assert server.requests == [0] * (1 + feed.statistics().catch_ups)
    assert feed.statistics().restarts == 1
    assert listener.index.match(hash_token_blocks(PROMPT, 4)) == {}
    assert listener.index.match(hash_token_blocks(OTHER + [8, 8, 8, 8], 4)) == {0: 2}


def test_a_new_publisher_id_is_a_restart(context, open_feed):
    listener = Listener()
    feed = open_feed(listener)
    vllm = FakeVLLM(context, feed.endpoint)
    n = vllm.join(feed)
    vllm.publish(n, [vllm_stored([1, 2], None, PROMPT[:8])], publisher_id=b"a" * 16)
    vllm.publish(n + 1, [vllm_stored([50], None, OTHER)], publisher_id=b"b" * 16)
    poll(lambda: feed.last_sequence_number == n + 1)
    assert feed.statistics().restarts == 1
    assert listener.index.statistics().num_blocks_per_replica == (1,)


def test_the_feed_connects_to_a_vllm_that_binds_a_wildcard(context, open_feed):
    pub = context(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")  # vLLM with tcp://*:PORT binds (here: loopback only)
    listener = Listener()
    feed = open_feed(listener, endpoint=f"tcp://*:{port}")
    assert not feed.binds and feed.endpoint == f"tcp://127.0.0.1:{port}"
    deadline, seq = time.monotonic() + 10, 0
    while feed.last_sequence_number is None:
        assert time.monotonic() < deadline
        pub.send_multipart([b"", seq.to_bytes(8, "big"), msgpack.packb([TS, [], 0])])
        poll(lambda: feed.last_sequence_number is not None, timeout_s=0.2, fail=False)
        seq += 1
    poll(lambda: feed.last_sequence_number == seq - 1)  # probes still in flight
    pub.send_multipart([b"", seq.to_bytes(8, "big"), msgpack.packb([TS, [vllm_stored([1], None, OTHER)], 0])])
    poll(lambda: feed.last_sequence_number == seq)
    assert listener.index.match(hash_token_blocks(OTHER, 4)) == {0: 1}


def test_undecodable_messages_are_counted_and_the_feed_goes_on(context, open_feed):
    listener = Listener()
    feed = open_feed(listener)
    vllm = FakeVLLM(context, feed.endpoint)
    n = vllm.join(feed)
    vllm.pub.send_multipart([b"", b"short"])
    vllm.pub.send_multipart([b"", n.to_bytes(8, "big"), b"\xc1"])
    vllm.publish(n + 1, [vllm_stored([50], None, OTHER)])
    poll(lambda: feed.last_sequence_number == n + 1)
    assert feed.statistics().decode_errors == 2
    assert listener.index.match(hash_token_blocks(OTHER, 4)) == {0: 1}
