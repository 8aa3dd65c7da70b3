"""HTTP front of one simulated engine: vLLM's OpenAI-compatible endpoints on aiohttp.

Routes: /v1/completions, /v1/chat/completions (stream and non-stream), /v1/models, /health,
/tokenize, /detokenize, /v1/completions/render, /v1/chat/completions/render, /metrics,
/kv_event_sources, /reset_prefix_cache, /admin/faults (GET to read, POST to change, DELETE
to clear) for fault injection at runtime, and /admin/prefix_match (cached tokens of a prompt, for
experiments that compare a router against perfect knowledge).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import msgspec
from aiohttp import web

from kvstack.engines.prompt_tokens import ChatPrompt, prompt_ids
from kvstack.engines.tokenizer import Tokenizer
from kvstack.openai import errors
from kvstack.openai.errors import OpenAIError
from kvstack.openai.http import error_response, json_response
from kvstack.openai.sse import DONE, encode_error_event, encode_event
from kvstack.sim import responses as R
from kvstack.sim.engine import RequestStream, SimEngine, TokenEvent
from kvstack.sim.faults import FaultConfig, FaultDraw, draw, injected_error
from kvstack.sim.openai.protocol import (
    ChatRequest,
    CompletionRequest,
    SamplingOptions,
    ServingLimits,
    check_content_type,
    check_engine_input,
    check_lengths,
    parse_chat_request,
    parse_completion_request,
    parse_detokenize_request,
    parse_tokenize_request,
)
from kvstack.sim.scheduler import SimRequest

log = logging.getLogger(__name__)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass
class ServerConfig:
    served_model_names: list[str]
    model_root: str
    max_model_len: int
    enable_prompt_tokens_details: bool = False
    kv_events_config: dict[str, Any] | None = None
    engine_id: str = "sim-0"
    advertise_host: str = "127.0.0.1"
    advertise_port: int = 0
    # P/D prefill side: blocks held for the decode side are freed after this many wall seconds.
    kv_hold_timeout: float = 30.0
    faults: FaultConfig = field(default_factory=FaultConfig)
    fault_seed: int = 0


@dataclass(slots=True)
class _Seq:
    """One choice being generated: its engine stream and the text so far."""

    index: int
    prompt_index: int
    stream: RequestStream
    prompt_len: int
    text: str = ""
    tokens: list[tuple[int, str]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | None = None


class SimServer:
    """The aiohttp application around one ``SimEngine``."""

    def __init__(self, engine: SimEngine, tokenizer: Tokenizer, config: ServerConfig) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config
        self.faults = config.faults.validate()
        self._rng = random.Random(config.fault_seed)
        self._created = int(time.time())
        self._hold_timers: dict[str, asyncio.TimerHandle] = {}
        self._background: set[asyncio.Task[None]] = set()
        self.limits = ServingLimits(tuple(config.served_model_names), config.max_model_len)

    # -- app ------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[self._errors_middleware])
        r = app.router
        r.add_get("/health", self.health)
        r.add_get("/v1/models", self.models)
        r.add_get("/metrics", self.metrics)
        r.add_get("/kv_event_sources", self.kv_event_sources)
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat_completions)
        r.add_post("/v1/completions/render", self.render_completion)
        r.add_post("/v1/chat/completions/render", self.render_chat)
        r.add_post("/tokenize", self.tokenize)
        r.add_post("/detokenize", self.detokenize)
        r.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        r.add_post("/kv_transfer/release", self.kv_release)
        r.add_get("/admin/faults", self.get_faults)
        r.add_post("/admin/faults", self.set_faults)
        r.add_post("/admin/prefix_match", self.prefix_match)
        r.add_delete("/admin/faults", self.clear_faults)
        app.on_startup.append(self._on_startup)
        app.on_cleanup.append(self._on_cleanup)
        return app

    async def _on_startup(self, app: web.Application) -> None:
        self.engine.start()

    async def _on_cleanup(self, app: web.Application) -> None:
        for timer in self._hold_timers.values():
            timer.cancel()
        for task in self._background:
            task.cancel()
        await self.engine.stop()

    @web.middleware
    async def _errors_middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            return await handler(request)
        except OpenAIError as err:
            return error_response(err)

    # -- plain endpoints --------------------------------------------------------------------------
    async def health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def models(self, request: web.Request) -> web.Response:
        cfg = self.config
        return json_response(
            R.models_list(cfg.served_model_names, cfg.model_root, cfg.max_model_len, self._created)
        )

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.engine.metrics.render(), content_type="text/plain", charset="utf-8")

    async def kv_event_sources(self, request: web.Request) -> web.Response:
        cfg = self.config.kv_events_config
        return json_response({"0": cfg} if cfg else {})

    async def reset_prefix_cache(self, request: web.Request) -> web.Response:
        # Like vLLM: refused (success false) while running requests hold blocks; callers retry.
        return json_response({"success": self.engine.reset_prefix_cache()})

    async def prefix_match(self, request: web.Request) -> web.Response:
        """How many of ``token_ids`` a request would find cached now (the "oracle" view for experiments:
        the engine's true cache state, read without touching it). vLLM has no such endpoint."""
        try:
            body = msgspec.json.decode(await request.read())
            ids = body["token_ids"]
            if not isinstance(ids, list) or not all(type(t) is int for t in ids):
                raise TypeError("token_ids must be a list of integers")
        except (msgspec.DecodeError, KeyError, TypeError) as exc:
            raise errors.bad_request(f"body must be {{'token_ids': [int, ...]}}: {exc}") from None
        kv = self.engine.kv
        hit = kv.longest_cached_prefix(kv.block_hashes(ids), len(ids) - 1)
        return json_response({"cached_tokens": len(hit) * kv.block_size, "block_size": kv.block_size})

    async def get_faults(self, request: web.Request) -> web.Response:
        return json_response(self.faults.as_json())

    async def set_faults(self, request: web.Request) -> web.Response:
        try:
            changes = msgspec.json.decode(await request.read())
            if not isinstance(changes, dict):
                raise ValueError("body must be a JSON object of fault fields")
            self.faults = self.faults.updated(changes)
        except (msgspec.DecodeError, ValueError, TypeError) as exc:
            raise errors.bad_request(f"invalid fault configuration: {exc}") from None
        log.info("faults set to %s", self.faults)
        return json_response(self.faults.as_json())

    async def clear_faults(self, request: web.Request) -> web.Response:
        self.faults = FaultConfig()
        return json_response(self.faults.as_json())

    # -- tokenization ---------------------------------------------------------------------------------
    async def _body(self, request: web.Request) -> bytes:
        check_content_type(request.headers.get("Content-Type"))
        return await request.read()

    def _prompt_ids(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        return list(prompt)  # ids are checked with the engine input (check_engine_input)

    def _chat_ids(self, req: ChatRequest) -> list[int]:
        prompt = ChatPrompt(
            req.messages,
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            chat_template=req.chat_template,
            chat_template_kwargs=req.chat_template_kwargs,
            tools=req.tools,
        )
        try:
            return list(prompt_ids(self.tokenizer, prompt))
        except Exception as exc:  # a user's template or messages can fail in many ways
            raise errors.bad_request(f"Failed to apply chat template: {exc}") from None

    async def tokenize(self, request: web.Request) -> web.Response:
        req = parse_tokenize_request(await self._body(request), self.limits)
        if req.messages is not None:
            chat = ChatRequest.for_tokenize(req)
            ids = self._chat_ids(chat)
        else:
            ids = self._prompt_ids(req.prompt if req.prompt is not None else "", req.add_special_tokens)
        strs = [self.tokenizer.token_str(t) for t in ids] if req.return_token_strs else None
        return json_response(
            {"count": len(ids), "max_model_len": self.config.max_model_len, "tokens": ids, "token_strs": strs}
        )

    async def detokenize(self, request: web.Request) -> web.Response:
        req = parse_detokenize_request(await self._body(request), self.limits)
        valid = [t for t in req.tokens if 0 <= t < self.tokenizer.vocab_size]
        # vLLM decodes with special tokens kept.
        return json_response({"prompt": self.tokenizer.decode(valid, skip_special_tokens=False)})

    async def render_completion(self, request: web.Request) -> web.Response:
        req = parse_completion_request(await self._body(request), self.limits)
        model = req.model or self.limits.served_models[0]
        out = [
            self._generate_request(self.engine.next_request_id("cmpl"), ids, model, req, max_tokens)
            for ids, max_tokens in self._completion_prompts(req)
        ]
        return json_response(out)

    async def render_chat(self, request: web.Request) -> web.Response:
        req = parse_chat_request(await self._body(request), self.limits)
        model = req.model or self.limits.served_models[0]
        ids, max_tokens = self._chat_prompt(req)
        rid = self.engine.next_request_id("chatcmpl")
        return json_response(self._generate_request(rid, ids, model, req, max_tokens))

    def _generate_request(
        self,
        request_id: str,
        ids: list[int],
        model: str,
        req: CompletionRequest | ChatRequest,
        max_tokens: int,
    ) -> dict[str, Any]:
        o = req.options
        return {
            "request_id": request_id,
            "token_ids": ids,
            "token_offsets": None,
            "features": None,
            "content_parts": None,
            "sampling_params": {
                "presence_penalty": o.presence_penalty,
                "frequency_penalty": o.frequency_penalty,
                "repetition_penalty": o.repetition_penalty,
                "temperature": 1.0 if o.temperature is None else o.temperature,
                "top_p": 1.0 if o.top_p is None else o.top_p,
                "min_p": 0.0,
                "stop": list(o.stop),
                "stop_token_ids": list(o.stop_token_ids),
                "max_tokens": max_tokens,
                "output_kind": 2,
                "skip_clone": True,
                "bad_words": [],
                "skip_reading_prefix_cache": False,
            },
            "model": model,
            "reasoning_ended": None,
            "reasoning_parser_kwargs": None,
            "return_token_ids": None,
            "output_mode": "tokens",
            "stream": req.stream,
            "stream_options": None,
            "cache_salt": None,
            "priority": 0,
            "kv_transfer_params": req.kv_transfer_params,
            "ec_transfer_params": None,
        }

    # -- generation ---------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        req = parse_completion_request(await self._body(request), self.limits)
        model = req.model or self.limits.served_models[0]
        return await self._generate(request, req, model, self._completion_prompts(req), chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        req = parse_chat_request(await self._body(request), self.limits)
        model = req.model or self.limits.served_models[0]
        return await self._generate(request, req, model, [self._chat_prompt(req)], chat=True)

    def _completion_prompts(self, req: CompletionRequest) -> list[tuple[list[int], int]]:
        """Token ids and effective max_tokens of each prompt, checked as vLLM checks them."""
        out = []
        for prompt in req.prompts:
            ids = self._prompt_ids(prompt, req.add_special_tokens)
            max_tokens = check_lengths(
                len(ids),
                req.options.max_tokens,
                self.config.max_model_len,
                min_tokens=req.options.min_tokens,
                max_tokens_param=req.max_tokens_param,
                from_text=isinstance(prompt, str),
            )
            out.append((ids, max_tokens))
        return out

    def _chat_prompt(self, req: ChatRequest) -> tuple[list[int], int]:
        ids = self._chat_ids(req)
        max_tokens = check_lengths(
            len(ids),
            req.options.max_tokens,
            self.config.max_model_len,
            chat=True,
            min_tokens=req.options.min_tokens,
            max_tokens_param=req.max_tokens_param,
        )
        return ids, max_tokens

    def _submit(
        self,
        request_id: str,
        ids: list[int],
        max_tokens: int,
        opts: SamplingOptions,
        kvp: dict[str, Any] | None,
        i: int,
        queue: asyncio.Queue[TokenEvent],
    ) -> RequestStream:
        sampler = self.engine.sampler
        seed = None if opts.seed is None else opts.seed + i
        temperature = 1.0 if opts.temperature is None else opts.temperature
        key = sampler.sample_key(ids, temperature=temperature, seed=seed)
        remote_prefill = bool(kvp and kvp.get("do_remote_prefill"))
        remote_decode = bool(kvp and kvp.get("do_remote_decode"))
        sim_req = SimRequest(
            request_id=f"{request_id}-{i}",
            prompt_token_ids=ids,
            max_tokens=max_tokens,
            arrival_time=0.0,
            min_tokens=opts.min_tokens,
            ignore_eos=opts.ignore_eos,
            natural_len=sampler.natural_len(key),
            sample_key=key,
            remote_prefill=remote_prefill,
            hold_blocks_on_finish=remote_decode,
        )
        stream = self.engine.submit(sim_req, queue)
        if remote_prefill and kvp is not None and i == 0:
            # The "transfer" is instant here; tell the prefill side it may free its blocks.
            task = asyncio.get_running_loop().create_task(self._notify_prefill_side(kvp))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
        return stream

    async def _generate(
        self,
        request: web.Request,
        req: CompletionRequest | ChatRequest,
        model: str,
        prompts: list[tuple[list[int], int]],
        *,
        chat: bool,
    ) -> web.StreamResponse:
        try:
            for ids, _ in prompts:
                check_engine_input(req.options, ids, self.tokenizer.vocab_size)
        except OpenAIError as err:
            if not req.stream:
                raise
            # vLLM finds these when the engine takes the request, after a stream has started.
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
            await resp.prepare(request)
            await resp.write(encode_error_event(err))
            await resp.write(DONE)
            await resp.write_eof()
            return resp
        fault = draw(self.faults, self._rng, stream=req.stream)
        if fault.hang:
            await _wait_forever()
        if fault.error_code is not None:
            raise injected_error(fault.error_code)
        n = req.options.n
        limit = self.engine.config.max_num_queued_reqs
        if limit is not None and self.engine.num_unfinished + n * len(prompts) > limit:
            # vLLM's admission control: 503 so that balancers retry elsewhere.
            self.engine.metrics.admission_rejected.inc()
            raise errors.engine_overloaded()

        request_id = self.engine.next_request_id("chatcmpl" if chat else "cmpl")
        seqs: list[_Seq] = []
        # One queue for all choices of this request: tokens arrive in engine order without relay tasks.
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        for p_idx, (ids, max_tokens) in enumerate(prompts):
            self.engine.metrics.observe_new_request(n=n, max_tokens=max_tokens)
            for i in range(n):
                stream = self._submit(
                    request_id, ids, max_tokens, req.options, req.kv_transfer_params, i, queue
                )
                seqs.append(_Seq(p_idx * n + i, p_idx, stream, len(ids)))
        try:
            if fault.first_token_delay:
                await asyncio.sleep(fault.first_token_delay)
            if req.stream:
                return await self._stream(request, req, request_id, model, seqs, queue, fault, chat=chat)
            return await self._collect(req, request_id, model, seqs, queue, chat=chat)
        finally:
            for seq in seqs:
                self.engine.abort(seq.stream)
                self._arm_hold_timer(seq.stream.req.request_id)

    def _accept_token(self, seq: _Seq, token_id: int, finish: str | None, stop: list[str]) -> str:
        """Append one token to ``seq``; returns the text delta (cut at a stop string)."""
        text = self.engine.sampler.text(token_id)
        seq.tokens.append((token_id, text))
        if stop and text:
            before = len(seq.text)
            full = seq.text + text
            for s in stop:
                # A stop string may straddle tokens, so search from just before the new text.
                at = full.find(s, max(0, before - len(s) + 1))
                if at != -1:
                    seq.text = full[:at]
                    seq.finish_reason, seq.stop_reason = "stop", s
                    return seq.text[before:]
            seq.text = full
        else:
            seq.text += text
        if finish is not None:
            seq.finish_reason = finish
        return text

    async def _collect(
        self,
        req: CompletionRequest | ChatRequest,
        request_id: str,
        model: str,
        seqs: list[_Seq],
        queue: asyncio.Queue[TokenEvent],
        *,
        chat: bool,
    ) -> web.Response:
        async for seq, ev in self._events(seqs, queue):
            self._accept_token(seq, ev.token_id, ev.finish_reason, req.options.stop)
        k = req.options.logprobs
        choices = []
        for seq in seqs:
            tokens = seq.tokens
            lp = None
            if k is not None:
                text_of = self.tokenizer.token_str
                vocab = self.tokenizer.vocab_size
                lp = (
                    R.chat_logprobs(tokens, k, vocab, text_of)
                    if chat
                    else R.completion_logprobs(tokens, k, vocab, text_of)
                )
            build_choice = R.chat_choice if chat else R.completion_choice
            choice = build_choice(seq.index, seq.text, seq.finish_reason, logprobs=lp)
            choice["stop_reason"] = seq.stop_reason
            choices.append(choice)
        usage = self._usage(seqs, chat=chat, full=True)
        kvp = self._kv_transfer_response(req, seqs)
        build = R.chat_response if chat else R.completion_response
        return json_response(build(request_id, model, self._created_now(), choices, usage, kvp))

    async def _stream(
        self,
        request: web.Request,
        req: CompletionRequest | ChatRequest,
        request_id: str,
        model: str,
        seqs: list[_Seq],
        queue: asyncio.Queue[TokenEvent],
        fault: FaultDraw,
        *,
        chat: bool,
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream; charset=utf-8"})
        await resp.prepare(request)
        created = self._created_now()
        chunks_sent = 0
        include_usage = req.stream_options.include_usage
        continuous = req.stream_options.continuous_usage_stats
        k = req.options.logprobs
        build_chunk = R.chat_chunk if chat else R.completion_chunk

        async def send(obj: dict[str, Any]) -> None:
            nonlocal chunks_sent
            if fault.drop_after is not None and chunks_sent >= fault.drop_after:
                # Abrupt close without the terminating chunk, as a crashed engine would.
                assert request.transport is not None
                request.transport.abort()
                raise ConnectionResetError("fault injection: connection dropped mid-stream")
            await resp.write(encode_event(obj))
            chunks_sent += 1

        if chat:
            for seq in seqs:
                await send(R.chat_role_chunk(request_id, model, created, seq.index))

        async for seq, ev in self._events(seqs, queue):
            token_id, finish = ev.token_id, ev.finish_reason
            position = len(seq.tokens)
            delta = self._accept_token(seq, token_id, finish, req.options.stop)
            lp = None
            if k is not None:
                text_of, vocab = self.tokenizer.token_str, self.tokenizer.vocab_size
                pair = [(token_id, delta)]
                lp = (
                    R.chat_logprobs(pair, k, vocab, text_of, position)
                    if chat
                    else R.completion_logprobs(pair, k, vocab, text_of, len(seq.text) - len(delta))
                )
            chunk = build_chunk(
                request_id,
                model,
                created,
                seq.index,
                delta,
                seq.finish_reason,
                logprobs=lp,
                stop_reason=seq.stop_reason,
            )
            if seq.finish_reason is not None and not include_usage:
                # vLLM stamps the fingerprint on the terminal chunk unless a usage chunk comes last.
                chunk["system_fingerprint"] = R.SYSTEM_FINGERPRINT
            if continuous:
                chunk["usage"] = self._usage([seq], chat=chat, full=False)
            await send(chunk)
        if include_usage:
            await send(
                R.usage_chunk(request_id, model, created, self._usage(seqs, chat=chat, full=False), chat=chat)
            )
        await resp.write(DONE)
        await resp.write_eof()
        return resp

    async def _events(
        self, seqs: list[_Seq], queue: asyncio.Queue[TokenEvent]
    ) -> AsyncIterator[tuple[_Seq, TokenEvent]]:
        """Token events of ``seqs`` in arrival order, until each has finished (or met a stop string)."""
        by_stream = {id(s.stream): s for s in seqs}
        remaining = len(seqs)
        while remaining:
            ev = await queue.get()
            seq = by_stream[id(ev.stream)]
            if seq.finish_reason is not None:
                continue  # already stopped by a stop string
            yield seq, ev
            if seq.finish_reason is not None:
                remaining -= 1
                # A stop string ends it early (counted as "stop"); a no-op when the engine finished it.
                self.engine.abort(seq.stream, finish_reason=seq.finish_reason)

    def _usage(self, seqs: list[_Seq], *, chat: bool, full: bool) -> dict[str, Any]:
        # Prompt tokens count once per prompt, however many choices it has (as in vLLM).
        per_prompt: dict[int, tuple[int, int]] = {}
        for seq in seqs:
            per_prompt.setdefault(
                seq.prompt_index, (seq.prompt_len, max(seq.stream.req.num_cached_tokens, 0))
            )
        prompt_tokens = sum(p for p, _ in per_prompt.values())
        cached_tokens = sum(c for _, c in per_prompt.values())
        completion = sum(len(s.tokens) for s in seqs)
        details = cached_tokens if self.config.enable_prompt_tokens_details else None
        return R.usage(prompt_tokens, completion, details, chat=chat, full=full)

    def _kv_transfer_response(
        self, req: CompletionRequest | ChatRequest, seqs: list[_Seq]
    ) -> dict[str, Any] | None:
        """P/D prefill side: tell the decode side where to pull the prompt's KV from."""
        kvp = req.kv_transfer_params
        if not kvp or not kvp.get("do_remote_decode"):
            return None
        seq = seqs[0]
        sim_req = seq.stream.req
        held = self.engine.scheduler.held_blocks(sim_req.request_id)
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_block_ids": [b.block_id for b in held],
            "remote_engine_id": self.config.engine_id,
            "remote_request_id": sim_req.request_id,
            "remote_host": self.config.advertise_host,
            "remote_port": self.config.advertise_port,
            "tp_size": 1,
        }

    def _arm_hold_timer(self, request_id: str) -> None:
        """Free a finished P/D prefill's blocks after the hold timeout unless the decode side pulls first."""
        if request_id in self._hold_timers or not self.engine.scheduler.held_blocks(request_id):
            return
        loop = asyncio.get_running_loop()
        self._hold_timers[request_id] = loop.call_later(
            self.config.kv_hold_timeout, self._release_held, request_id
        )

    def _release_held(self, request_id: str) -> bool:
        timer = self._hold_timers.pop(request_id, None)
        if timer is not None:
            timer.cancel()
        return self.engine.release_held(request_id)

    async def kv_release(self, request: web.Request) -> web.Response:
        """The decode side has pulled a prefill's KV: free the blocks now (what NIXL's notification does)."""
        try:
            body = msgspec.json.decode(await request.read())
            request_id = body["remote_request_id"]
        except (msgspec.DecodeError, KeyError, TypeError):
            raise errors.bad_request('body must be {"remote_request_id": ...}', "remote_request_id") from None
        return json_response({"released": self._release_held(str(request_id))})

    async def _notify_prefill_side(self, kvp: dict[str, Any]) -> None:
        host, port, rid = kvp.get("remote_host"), kvp.get("remote_port"), kvp.get("remote_request_id")
        if not (host and port and rid):
            return
        url = f"http://{host}:{port}/kv_transfer/release"
        try:
            async with (
                aiohttp.ClientSession() as http,
                http.post(
                    url, json={"remote_request_id": rid}, timeout=aiohttp.ClientTimeout(total=5)
                ) as resp,
            ):
                await resp.read()
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.info("could not tell prefill engine %s:%s to release %s: %r", host, port, rid, exc)

    def _created_now(self) -> int:
        return int(time.time())


async def _wait_forever() -> None:
    """A hung engine: hold the connection until the client gives up."""
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.Event().wait()
    raise asyncio.CancelledError
