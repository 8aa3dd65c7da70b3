"""The one KV-event publisher (the simulated engines' and the cache server's) over real ZMQ sockets: frames,
seq, replay, both encodings, never waiting, the counters, the cache server's topic and one batch per loop
turn, and frame for frame against vLLM's own."""

import asyncio
import textwrap
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio

from kvstack.cache.events import ChunkEvents, block_hash, topic_for
from kvstack.cache.keys import ChunkKey
from kvstack.cache.tiers import DiskTier, MemoryTier
from kvstack.kvevents.codec import (
    REPLAY_END_SEQ,
    REPLAY_END_SEQ_BYTES,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    decode_batch,
    decode_seq,
    encode_batch,
    encode_seq,
)
from kvstack.kvevents.publisher import KVEventPublisher
from support.engines import require_vllm, vllm_python

TIMEOUT = 5.0


def _stored(first_token: int) -> BlockStored:
    return BlockStored(
        block_hashes=[1000 + first_token],
        parent_block_hash=None,
        token_ids=[first_token, first_token + 1],
        block_size=2,
    )


def _client(ctx: zmq.asyncio.Context, kind: int, endpoint: str) -> zmq.asyncio.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    return sock


async def _recv(sock: zmq.asyncio.Socket) -> list[bytes]:
    return await asyncio.wait_for(sock.recv_multipart(), TIMEOUT)


async def _replay(dealer: zmq.asyncio.Socket, start_seq: int) -> list[list[bytes]]:
    """Ask for a replay from ``start_seq``; return every reply, end marker included."""
    await dealer.send_multipart([b"", encode_seq(start_seq)])
    replies = []
    while True:
        frames = await _recv(dealer)
        replies.append(frames)
        if frames[2] == REPLAY_END_SEQ_BYTES:
            return replies


async def _wait_until_subscribed(publisher: KVEventPublisher, sub: zmq.asyncio.Socket) -> int:
    """Publish probe batches until one arrives, since a fresh SUB misses what is sent before it joins."""
    for _ in range(100):
        publisher.publish([AllBlocksCleared()])
        try:
            frames = await asyncio.wait_for(sub.recv_multipart(), 0.05)
        except TimeoutError:
            continue
        # Drain any other probes already in flight; the last one tells where the stream stands.
        while await sub.poll(50):
            frames = await sub.recv_multipart()
        return decode_seq(frames[1])
    raise AssertionError("the SUB socket never received a probe batch")


async def test_sub_receives_three_frames_with_increasing_seq(ctx: zmq.asyncio.Context) -> None:
    async with KVEventPublisher("tcp://127.0.0.1:0", topic="kv", data_parallel_rank=3) as publisher:
        assert publisher.port is not None and publisher.port > 0
        assert publisher.endpoint == f"tcp://127.0.0.1:{publisher.port}"
        sub = _client(ctx, zmq.SUB, publisher.endpoint)
        last_probe = await _wait_until_subscribed(publisher, sub)
        sent: list[list[KVEvent]] = [[_stored(i), BlockRemoved(block_hashes=[1000 + i])] for i in range(3)]
        for i, events in enumerate(sent):
            assert publisher.publish(events, ts=100.0 + i) == last_probe + 1 + i
        for i, events in enumerate(sent):
            topic, seq, payload = await _recv(sub)
            assert topic == b"kv"
            assert decode_seq(seq) == last_probe + 1 + i
            assert decode_batch(payload) == EventBatch(ts=100.0 + i, events=events, data_parallel_rank=3)
        sub.close()


async def test_seq_starts_at_zero_and_an_empty_publish_sends_nothing(ctx: zmq.asyncio.Context) -> None:
    replay_at = "tcp://127.0.0.1:0"
    async with KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint=replay_at) as publisher:
        assert publisher.publish([]) is None
        assert publisher.publish(iter(())) is None
        assert publisher.next_seq == 0 and publisher.sent_events == 0
        assert publisher.publish([_stored(0)]) == 0
        assert publisher.replay_endpoint is not None
        dealer = _client(ctx, zmq.DEALER, publisher.replay_endpoint)
        replies = await _replay(dealer, 0)
        assert [decode_seq(frames[2]) for frames in replies] == [0, REPLAY_END_SEQ]
        dealer.close()


async def test_one_publish_is_one_batch_stamped_by_the_clock(ctx: zmq.asyncio.Context) -> None:
    clock = iter([42.5])
    publisher = KVEventPublisher(
        "tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", clock=lambda: next(clock)
    )
    await publisher.start()
    events: list[KVEvent] = [_stored(0), _stored(2), AllBlocksCleared()]
    assert publisher.publish(e for e in events) == 0
    assert publisher.sent_events == 3 and publisher.dropped_batches == 0
    assert publisher.replay_endpoint is not None
    dealer = _client(ctx, zmq.DEALER, publisher.replay_endpoint)
    (_, topic, _, payload), _end = await _replay(dealer, 0)
    assert topic == b""
    assert decode_batch(payload) == EventBatch(ts=42.5, events=[_stored(0), _stored(2), AllBlocksCleared()])
    # Without a data-parallel rank (the cache server's stream) the rank is nil.
    assert msgspec.msgpack.decode(payload)[2] is None
    dealer.close()
    await publisher.close()


async def test_replay_streams_batches_from_start_then_end_marker(ctx: zmq.asyncio.Context) -> None:
    async with KVEventPublisher(
        "tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", topic="kv"
    ) as publisher:
        batches = [EventBatch(ts=float(i), events=[_stored(i)]) for i in range(5)]
        for batch in batches:
            publisher.publish(batch.events, ts=batch.ts)
        assert publisher.replay_port is not None and publisher.replay_port > 0
        assert publisher.replay_endpoint is not None
        dealer = _client(ctx, zmq.DEALER, publisher.replay_endpoint)

        replies = await _replay(dealer, 2)
        expected = [[b"", b"kv", encode_seq(i), encode_batch(batches[i])] for i in (2, 3, 4)]
        # vLLM ends a replay with an empty topic frame, whatever the configured topic.
        assert replies == [*expected, [b"", b"", REPLAY_END_SEQ_BYTES, b""]]

        assert await _replay(dealer, 5) == [[b"", b"", REPLAY_END_SEQ_BYTES, b""]]
        dealer.close()


async def test_replay_buffer_keeps_only_the_last_buffer_steps_batches(ctx: zmq.asyncio.Context) -> None:
    async with KVEventPublisher(
        "tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", buffer_steps=3
    ) as publisher:
        for i in range(5):
            publisher.publish([_stored(i)])
        assert publisher.replay_endpoint is not None
        dealer = _client(ctx, zmq.DEALER, publisher.replay_endpoint)
        replies = await _replay(dealer, 0)
        assert [decode_seq(frames[2]) for frames in replies] == [2, 3, 4, REPLAY_END_SEQ]
        dealer.close()


async def test_malformed_replay_request_is_ignored_and_service_goes_on(ctx: zmq.asyncio.Context) -> None:
    async with KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0") as publisher:
        publisher.publish([_stored(0)])
        assert publisher.replay_endpoint is not None
        dealer = _client(ctx, zmq.DEALER, publisher.replay_endpoint)
        await dealer.send_multipart([b"", b"not", b"a request"])
        assert await dealer.poll(200) == 0
        replies = await _replay(dealer, 0)
        assert [decode_seq(frames[2]) for frames in replies] == [0, REPLAY_END_SEQ]
        dealer.close()


async def test_legacy_array_option_sends_events_as_arrays(ctx: zmq.asyncio.Context) -> None:
    async with KVEventPublisher(
        "tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", legacy_array=True
    ) as publisher:
        publisher.publish([_stored(0)], ts=1.0)
        assert publisher.replay_endpoint is not None
        dealer = _client(ctx, zmq.DEALER, publisher.replay_endpoint)
        (_, _, _, payload), _end = await _replay(dealer, 0)
        _ts, (event,), _rank = msgspec.msgpack.decode(payload)
        assert event[:5] == ["BlockStored", [1000], None, [0, 1], 2]
        assert decode_batch(payload).events == [_stored(0)]
        dealer.close()


async def test_publish_never_waits_for_a_stalled_subscriber_which_replays_what_it_lost(
    ctx: zmq.asyncio.Context,
) -> None:
    async with KVEventPublisher(
        "tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", hwm=10, buffer_steps=2000
    ) as publisher:
        stalled = _client(ctx, zmq.SUB, publisher.endpoint)
        stalled.setsockopt(zmq.RCVHWM, 10)
        last_probe = await _wait_until_subscribed(publisher, stalled)
        big = BlockStored(
            block_hashes=[1], parent_block_hash=None, token_ids=list(range(4096)), block_size=4096
        )
        for _ in range(2000):
            publisher.publish([big])  # drops past the high-water mark instead of waiting for the reader
        # The PUB socket drops for that subscriber alone and tells the sender nothing: every send counts.
        assert publisher.dropped_batches == 0
        received = []
        while await stalled.poll(200):
            received.append(decode_seq((await stalled.recv_multipart())[1]))
        assert received and received[-1] < publisher.next_seq - 1
        missing = next(seq for seq in range(last_probe + 1, publisher.next_seq) if seq not in received)
        assert publisher.replay_endpoint is not None
        dealer = _client(ctx, zmq.DEALER, publisher.replay_endpoint)
        replayed = [decode_seq(frames[2]) for frames in await _replay(dealer, missing)]
        assert replayed == [*range(missing, publisher.next_seq), REPLAY_END_SEQ]
        dealer.close()
        stalled.close()


async def test_a_send_zmq_refuses_is_counted_and_kept_for_replay(
    ctx: zmq.asyncio.Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0") as publisher:
        assert publisher.publish([_stored(0), _stored(2)]) == 0

        def refuse(*args: object, **kwargs: object) -> None:
            raise zmq.Again()

        monkeypatch.setattr(publisher._pub, "send_multipart", refuse)
        assert publisher.publish([_stored(4)]) == 1  # refused, not raised: the seq is spent all the same
        monkeypatch.undo()
        assert publisher.publish([_stored(6)]) == 2
        assert (publisher.sent_events, publisher.dropped_batches) == (3, 1)
        assert publisher.replay_endpoint is not None
        dealer = _client(ctx, zmq.DEALER, publisher.replay_endpoint)
        replies = await _replay(dealer, 1)
        assert [decode_batch(frames[3]).events for frames in replies[:-1]] == [[_stored(4)], [_stored(6)]]
        dealer.close()


async def test_cache_topic_and_one_batch_per_event_loop_turn(ctx: zmq.asyncio.Context) -> None:
    """The cache server's wiring: `ChunkEvents` hands each loop turn's tier events to ``publish`` at once."""
    chunk = 2
    keys = [ChunkKey(bytes([i + 1]) * 32) for i in range(4)]
    memory, disk = MemoryTier(1 << 20), DiskTier("/nonexistent", 1)
    async with KVEventPublisher(
        "tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", topic=topic_for("node-7")
    ) as publisher:
        events = ChunkEvents(publisher.publish, chunk_size=chunk)
        events.remember(keys, None, [[10 * i, 10 * i + 1] for i in range(4)])
        events.stored(memory, keys[:2])
        events.stored(memory, keys[2:])  # the chain goes on: one BlockStored
        events.removed(disk, keys[:1])
        assert publisher.next_seq == 0  # nothing before the turn ends
        await asyncio.sleep(0)
        assert publisher.next_seq == 1
        events.removed(memory, keys[3:])
        await asyncio.sleep(0)
        assert publisher.next_seq == 2 and publisher.sent_events == 3
        assert publisher.replay_endpoint is not None
        dealer = _client(ctx, zmq.DEALER, publisher.replay_endpoint)
        first, second, end = await _replay(dealer, 0)
        dealer.close()
    assert [first[1], second[1], end[1]] == [b"kvstack-cache/node-7", b"kvstack-cache/node-7", b""]
    assert decode_batch(first[3]).events == [
        BlockStored(
            block_hashes=[block_hash(k) for k in keys],
            parent_block_hash=None,
            token_ids=[0, 1, 10, 11, 20, 21, 30, 31],
            block_size=chunk,
            medium="CPU",
        ),
        BlockRemoved(block_hashes=[block_hash(keys[0])], medium="DISK"),
    ]
    assert decode_batch(second[3]).events == [BlockRemoved(block_hashes=[block_hash(keys[3])], medium="CPU")]


async def test_close_cancels_its_task_and_is_idempotent() -> None:
    before = asyncio.all_tasks()
    publisher = KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0")
    await publisher.start()
    assert {task.get_name() for task in asyncio.all_tasks() - before} == {"kv-event-replay"}
    await publisher.close()
    await publisher.close()
    assert asyncio.all_tasks() - before == set()
    assert publisher.publish([]) is None
    with pytest.raises(RuntimeError, match="not running"):
        publisher.publish([AllBlocksCleared()])


def test_publishing_before_start_is_refused() -> None:
    publisher = KVEventPublisher("tcp://127.0.0.1:0")
    with pytest.raises(RuntimeError, match="not running"):
        publisher.publish([AllBlocksCleared()])
    with pytest.raises(RuntimeError, match="not started"):
        _ = publisher.endpoint


async def test_close_leaves_a_given_context_open(ctx: zmq.asyncio.Context) -> None:
    publisher = KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0", context=ctx)
    await publisher.start()
    await publisher.close()
    assert not ctx.closed
    ctx.socket(zmq.PUB).close()


async def test_bind_conflict_names_the_endpoint_and_cleans_up() -> None:
    async with KVEventPublisher("tcp://127.0.0.1:0") as first:
        taken = first.endpoint
        before = asyncio.all_tasks()
        second = KVEventPublisher("tcp://127.0.0.1:0", replay_endpoint=taken)
        with pytest.raises(OSError, match=f"cannot bind KV event replay socket to {taken}"):
            await second.start()
        assert asyncio.all_tasks() - before == set()


# Runs in the vLLM virtualenv: vLLM's own ZmqEventPublisher publishes the batches it is given, then waits for
# stdin to close. Exit 3: no vLLM here.
_VLLM_PUBLISHER = textwrap.dedent(
    """
    import sys
    import msgspec
    try:
        from vllm.distributed import kv_events as v
    except ImportError as exc:
        print(f"cannot import vllm.distributed.kv_events: {exc}", file=sys.stderr)
        sys.exit(3)

    pub_at, replay_at, batches_path = sys.argv[1:4]
    with open(batches_path, "rb") as f:
        batches = msgspec.msgpack.decode(f.read())
    publisher = v.ZmqEventPublisher(0, endpoint=pub_at, replay_endpoint=replay_at, topic="kv")
    for ts, events in batches:
        publisher.publish(v.KVEventBatch(ts=ts, events=[getattr(v, n)(**kw) for n, kw in events]))
    print("published", flush=True)
    sys.stdin.read()
    publisher.shutdown()
    """
)


@pytest.mark.vllm
async def test_frames_match_vllm_own_publisher(ctx: zmq.asyncio.Context, tmp_path: Path) -> None:
    require_vllm()
    events: list[list[KVEvent]] = [
        [_stored(0), _stored(2)],
        [BlockRemoved(block_hashes=[1000])],
        [AllBlocksCleared(), _stored(4)],
    ]
    batches_path = tmp_path / "batches.msgpack"
    batches_path.write_bytes(
        msgspec.msgpack.encode(
            [
                [10.0 + i, [[type(ev).__name__, msgspec.structs.asdict(ev)] for ev in batch]]
                for i, batch in enumerate(events)
            ]
        )
    )
    # vLLM binds only wildcard and ipc endpoints (it connects to the rest), so both sides use ipc here.
    vllm_replay = f"ipc://{tmp_path}/vllm-replay"
    stderr_path = tmp_path / "vllm.stderr"
    with stderr_path.open("wb") as stderr:
        proc = await asyncio.create_subprocess_exec(
            str(vllm_python()),
            "-c",
            _VLLM_PUBLISHER,
            f"ipc://{tmp_path}/vllm-pub",
            vllm_replay,
            str(batches_path),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=stderr,
        )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 300)
        if not line and await proc.wait() == 3:
            pytest.skip(
                f"{vllm_python()}: {stderr_path.read_text().strip().splitlines()[-1]} (still installing?)"
            )
        assert line == b"published\n", stderr_path.read_text()[-4000:]
        dealer = _client(ctx, zmq.DEALER, vllm_replay)
        # vLLM's publisher thread sends from a queue; ask again until it has handled all three batches.
        for _ in range(50):
            from_vllm = await _replay(dealer, 0)
            if len(from_vllm) == len(events) + 1:
                break
            await asyncio.sleep(0.1)
        dealer.close()
    finally:
        proc.stdin.close()
        await asyncio.wait_for(proc.wait(), 30)

    async with KVEventPublisher(
        f"ipc://{tmp_path}/ours-pub",
        replay_endpoint=f"ipc://{tmp_path}/ours-replay",
        topic="kv",
        data_parallel_rank=0,  # vLLM's publisher stamps its rank (0 here) on every batch
    ) as publisher:
        assert publisher.port is None
        for i, batch in enumerate(events):
            publisher.publish(batch, ts=10.0 + i)
        assert publisher.replay_endpoint is not None
        dealer = _client(ctx, zmq.DEALER, publisher.replay_endpoint)
        from_us = await _replay(dealer, 0)
        dealer.close()

    assert from_us == from_vllm
    assert [decode_batch(frames[3]).events for frames in from_us[:-1]] == events
