"""Two picker replicas over the same engines (KV events on): they choose alike for a replayed multi-round
chat, and their in-flight counts go back to 0 whatever ended each stream, also under concurrent load."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import aiohttp
import pytest

from kvstack.bench.workloads import Conversation, MultiRoundQA, Turn
from kvstack.sim.cluster import stop_engine
from support.ext_proc import (
    ExtProcStream,
    body_message,
    destination,
    headers_message,
    response_headers_message,
)
from support.pickers import PickerStack, picking_over
from support.routers import MODEL, start_sims
from support.waiting import eventually

pytestmark = pytest.mark.slow

CHAT = "/v1/chat/completions"


@dataclass
class Replicas:
    one: PickerStack
    two: PickerStack
    http: aiohttp.ClientSession

    @property
    def both(self) -> tuple[PickerStack, PickerStack]:
        return self.one, self.two


@pytest.fixture
async def replicas() -> AsyncIterator[Replicas]:
    """Three sims publishing KV events, two pickers on their default routing ("auto")."""
    engines = await start_sims(3, time_scale=50.0, kv_events=True)
    try:
        # A generous scrape timeout: a slow scrape on a loaded machine makes an engine stale (saturated).
        async with (
            picking_over(engines, scrape_timeout=2.0) as one,
            picking_over(engines, scrape_timeout=2.0) as two,
            aiohttp.ClientSession() as http,
        ):
            for stack in (one, two):
                await eventually(
                    partial(hears_kv_events, stack), what="KV events from every engine", timeout_s=30
                )
            yield Replicas(one, two, http)
    finally:
        for e in engines:
            await stop_engine(e)


async def ask(stack: PickerStack, body: dict[str, Any], request_id: str) -> tuple[ExtProcStream, list[str]]:
    """A stream on which the picker has answered the request's headers and body: (stream, destinations)."""
    stream = stack.client.stream()
    await stream.exchange(headers_message(CHAT, extra=[("x-request-id", request_id)]))
    header, _ = destination(await stream.exchange(body_message(body)))
    assert header is not None
    return stream, header.split(",")


async def serve(http: aiohttp.ClientSession, address: str, body: dict[str, Any]) -> str:
    """Send the request to the engine the picker chose, as Envoy would; the answer's text."""
    async with http.post(f"http://{address}{CHAT}", json=body) as r:
        assert r.status == 200, await r.text()
        reply = await r.json()
    return str(reply["choices"][0]["message"]["content"])


def in_flight(stack: PickerStack) -> int:
    return sum(stack.in_flight().values())


def hears_kv_events(stack: PickerStack) -> bool:
    return all(e.state.knowledge == "kv-events" for e in stack.epp.front.registry)


def settled(stack: PickerStack) -> bool:
    """Nothing in flight, no stream open, no admission slot held."""
    picker = stack.epp.picker
    return in_flight(stack) == 0 and picker.streams == 0 and picker.front.admission.in_flight == 0


def engine_views(stack: PickerStack) -> dict[str, tuple[object, ...]]:
    """Per engine address: what this replica scores by (scrape, in-flight, KV batches seen)."""
    out: dict[str, tuple[object, ...]] = {}
    for item in stack.epp.front.fleet.engines_detail():
        metrics, events = item["metrics"] or {}, item["kv_events"] or {}
        out[item["url"].removeprefix("http://")] = (
            metrics.get("queue"),
            metrics.get("kv_usage"),
            item["in_flight"],
            events.get("batches"),
        )
    return out


@dataclass
class Conversations:
    open: dict[int, Conversation] = field(default_factory=dict)

    def body(self, turn: Turn) -> dict[str, Any]:
        conversation = self.open.setdefault(turn.session, Conversation(turn.system))
        conversation.ask(turn.text)
        return {"model": MODEL, "messages": conversation.messages(), "max_tokens": turn.max_tokens}

    def answer(self, turn: Turn, text: str) -> None:
        self.open[turn.session].answer(text)


async def test_replicas_choose_alike_for_a_sequential_multi_round_chat(replicas: Replicas) -> None:
    # No shared system prompt: every first round is cold on every engine, a tie that only the hash breaks
    # (a shared prefix would pull every conversation to its one holder; load would not break that tie).
    workload = MultiRoundQA(
        num_users=12, num_rounds=10, system_prompt_len=0, user_history_len=60, question_len=12,
        answer_len=6, qps=0, seed=3,
    )  # fmt: skip
    chats = Conversations()
    agreed, disagreements, targets = 0, [], set()
    for turn in workload.turns():
        body = chats.body(turn)
        request_id = f"turn-{turn.index}"
        # Each replica serves every other request, as Envoy's round robin would; the other one is asked
        # the same request (same x-request-id) and its stream ends without a response.
        server, shadow = replicas.both if turn.index % 2 == 0 else replicas.both[::-1]
        shadow_stream, shadow_pick = await ask(shadow, body, request_id)
        await shadow_stream.close()
        stream, pick = await ask(server, body, request_id)
        if pick[0] == shadow_pick[0]:
            agreed += 1
        else:
            views = {"server": engine_views(server), "shadow": engine_views(shadow)}
            disagreements.append((turn.index, turn.round, pick, shadow_pick, views))
        targets.add(pick[0])
        chats.answer(turn, await serve(replicas.http, pick[0], body))
        await stream.exchange(response_headers_message(200))
        await stream.close()
    assert agreed / workload.size >= 0.99, disagreements
    # The conversations spread over the engines (the hash and the engines' load place them; which engines
    # exactly depends on scrape timing, so only that more than one serves).
    assert len(targets) >= 2
    for stack in replicas.both:
        await eventually(partial(settled, stack), what="in-flight back to 0")


async def test_concurrent_load_through_both_replicas_leaves_no_in_flight_behind(replicas: Replicas) -> None:
    workload = MultiRoundQA(
        num_users=16, num_rounds=4, system_prompt_len=40, user_history_len=60, question_len=12,
        answer_len=24, qps=0, seed=4,
    )  # fmt: skip
    chats = Conversations()
    turns: dict[int, list[Turn]] = {}
    for turn in workload.turns():
        turns.setdefault(turn.session, []).append(turn)
    replica_of = itertools.cycle(replicas.both)  # Envoy's round robin over the replicas
    # Streams each replica was given and has not finished; a cancelled stream counts until the end, since
    # the replica learns of a cancellation later than the client.
    outstanding = {id(stack): 0 for stack in replicas.both}
    peak = {id(stack): 0 for stack in replicas.both}
    violations: list[str] = []
    done = asyncio.Event()

    async def watch() -> None:
        while not done.is_set():
            for stack in replicas.both:
                count = in_flight(stack)
                admitted = stack.epp.front.admission.in_flight
                if count > admitted or count > outstanding[id(stack)]:
                    violations.append(
                        f"{count} in flight, {admitted} admitted, {outstanding[id(stack)]} open"
                    )
                peak[id(stack)] = max(peak[id(stack)], count)
            await asyncio.sleep(0.002)

    async def user(session: int) -> None:
        for turn in turns[session]:
            body = chats.body(turn)
            stack = next(replica_of)
            outstanding[id(stack)] += 1
            stream, pick = await ask(stack, body, f"c-{turn.index}")
            if turn.index % 5 == 4:  # the client went away before the engine answered: Envoy resets
                stream.cancel()
                chats.answer(turn, "")
                continue
            chats.answer(turn, await serve(replicas.http, pick[0], body))
            await stream.exchange(response_headers_message(200))
            await stream.close()
            outstanding[id(stack)] -= 1

    watcher = asyncio.create_task(watch())
    try:
        await asyncio.gather(*(user(s) for s in turns))
    finally:
        done.set()
        await watcher
    assert not violations, violations[:5]
    assert max(peak.values()) >= 2  # requests really overlapped
    for stack in replicas.both:
        await eventually(partial(settled, stack), what="in-flight back to 0")
