"""The prompt token ids an engine will compute for a request, as the router needs them for prefix routing.

A prompt becomes ids the way vLLM makes them: text (``/v1/completions``) encoded with ``add_special_tokens``
(default true); token ids used as they are; chat messages rendered with the model's chat template and the
request's template fields, then encoded without special tokens. A batch routes by its first prompt; other
endpoints are not tokenized.

Locally, from a tokenizer per model (``kvstack.engines.tokenizer``; long prompts on a worker thread above
``inline_chars``), else remotely: ``POST /tokenize`` to the engines ``engines_for(model)`` lists, in turns,
each answer within ``remote_timeout`` and at most 8 bytes per request byte (+1 MiB). An engine that fails
(timeout, connection error, 5xx or 404, an unreadable answer) is not asked again for ``remote_cooldown`` s;
another 4xx or an oversized answer is the prompt's problem. Results are cached in a bounded LRU keyed by a
128-bit hash of the prompt fields. Any failure gives ``None``: the request routes without prefix knowledge.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import msgspec
import xxhash

from kvstack.engines.tokenizer import Tokenizer
from kvstack.http.client import BodyTooLarge, UpstreamError, UpstreamPool

__all__ = [
    "ChatPrompt",
    "IdsPrompt",
    "PromptTokenizer",
    "TextPrompt",
    "TokenizerStats",
    "prompt_ids",
    "prompt_of",
]

log = logging.getLogger(__name__)
_encode = msgspec.json.Encoder(order="deterministic")
# A /tokenize answer holds at most one token per prompt byte, each at most 8 bytes of JSON ("1234567,"),
# and the few a chat template adds.
_ANSWER_BYTES_PER_BYTE = 8
_ANSWER_SLACK = 1 << 20


@dataclass(frozen=True, slots=True)
class TextPrompt:
    text: str
    add_special_tokens: bool = True


@dataclass(frozen=True, slots=True)
class IdsPrompt:
    token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    messages: list[Any]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    add_special_tokens: bool = False

    def fields(self) -> dict[str, Any]:
        """The request fields that decide the rendering (also the remote /tokenize body, minus model)."""
        out: dict[str, Any] = {
            "messages": self.messages,
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
            "add_special_tokens": self.add_special_tokens,
        }
        if self.chat_template is not None:
            out["chat_template"] = self.chat_template
        if self.chat_template_kwargs:
            out["chat_template_kwargs"] = self.chat_template_kwargs
        if self.tools:
            out["tools"] = self.tools
        return out


Prompt = TextPrompt | IdsPrompt | ChatPrompt


def prompt_of(path: str, body: Mapping[str, Any]) -> Prompt | None:
    """The prompt of a parsed request body, or None when the endpoint or body has none to route by."""
    if path == "/v1/chat/completions":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return None
        kwargs = body.get("chat_template_kwargs")
        template = body.get("chat_template")
        tools = body.get("tools")
        return ChatPrompt(
            messages=messages,
            add_generation_prompt=body.get("add_generation_prompt", True) is not False,
            continue_final_message=body.get("continue_final_message") is True,
            chat_template=template if isinstance(template, str) else None,
            chat_template_kwargs=kwargs if isinstance(kwargs, dict) else None,
            tools=tools if isinstance(tools, list) else None,
            add_special_tokens=body.get("add_special_tokens") is True,
        )
    if path != "/v1/completions":
        return None
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]  # a batch: route by its first prompt
    if isinstance(prompt, str):
        return TextPrompt(prompt, body.get("add_special_tokens", True) is not False)
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return IdsPrompt(tuple(prompt))
    return None


def _cache_key(model: str, prompt: TextPrompt | ChatPrompt) -> bytes:
    h = xxhash.xxh3_128(model.encode())
    if isinstance(prompt, TextPrompt):
        h.update(b"\x00t\x01" if prompt.add_special_tokens else b"\x00t\x00")
        h.update(prompt.text.encode("utf-8", "surrogatepass"))
    else:
        h.update(b"\x00c")
        h.update(_encode.encode(prompt.fields()))
    return h.digest()


@dataclass(slots=True)
class TokenizerStats:
    local: int = 0
    remote: int = 0
    cache_hits: int = 0
    failures: int = 0
    offloaded: int = 0
    seconds: float = 0.0  # time spent producing ids (local or remote), cache hits excluded


# The engines (base URLs) that may tokenize for a model, in order of preference; empty when none can.
EnginesFor = Callable[[str], Sequence[str]]


class PromptTokenizer:
    """Prompt → token ids for routing: local tokenizers by model, else an engine's /tokenize; cached."""

    def __init__(
        self,
        tokenizers: Mapping[str, Tokenizer] | None = None,
        *,
        default: Tokenizer | None = None,
        client: UpstreamPool | None = None,
        engines_for: EnginesFor | None = None,
        remote_timeout: float = 2.0,
        remote_cooldown: float = 30.0,
        cache_entries: int = 4096,
        cache_tokens: int = 16_000_000,
        inline_chars: int = 8192,
        observe: Callable[[str, float], None] | None = None,
    ) -> None:
        """``tokenizers``: model name → tokenizer (``default`` for other models); ``client`` +
        ``engines_for`` enable remote rendering for models without a local tokenizer.

        ``observe(source, seconds)`` is told the cost of each prompt: source ``local``/``remote``/``cache``,
        or ``local_failed``/``remote_failed`` for an attempt that gave no ids.
        """
        self.tokenizers = dict(tokenizers or {})
        self.default = default
        self.client = client
        self.engines_for = engines_for
        self.remote_timeout = remote_timeout
        self.remote_cooldown = remote_cooldown
        self.cache_entries = cache_entries
        self.cache_tokens = cache_tokens
        self.inline_chars = inline_chars
        self.observe = observe
        self.stats = TokenizerStats()
        self._cache: OrderedDict[bytes, tuple[int, ...]] = OrderedDict()
        self._cached_tokens = 0
        self._executor: ThreadPoolExecutor | None = None
        self._cooling: dict[str, float] = {}  # engine -> monotonic time it may be asked again
        self._turn = 0

    def _local_tokenizer(self, model: str) -> Tokenizer | None:
        return self.tokenizers.get(model, self.default)

    async def token_ids(self, model: str, prompt: Prompt | None) -> tuple[int, ...] | None:
        """The prompt's token ids, or None when they cannot be known (never raises)."""
        if prompt is None:
            return None
        if isinstance(prompt, IdsPrompt):
            return prompt.token_ids
        key = _cache_key(model, prompt)
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.move_to_end(key)
            self.stats.cache_hits += 1
            if self.observe is not None:
                self.observe("cache", 0.0)
            return cached
        started = time.perf_counter()
        tokenizer = self._local_tokenizer(model)
        if tokenizer is not None:
            ids = await self._local(tokenizer, prompt)
            source = "local"
        else:
            engine = self._pick_engine(model)
            if engine is None:  # nobody to ask: no time spent, nothing to observe
                self.stats.failures += 1
                return None
            ids = await self._remote(engine, model, prompt)
            source = "remote"
        elapsed = time.perf_counter() - started
        self.stats.seconds += elapsed
        if ids is None:
            self.stats.failures += 1
            if self.observe is not None:
                self.observe(f"{source}_failed", elapsed)
            return None
        if source == "local":
            self.stats.local += 1
        else:
            self.stats.remote += 1
        if self.observe is not None:
            self.observe(source, elapsed)
        self._remember(key, ids)
        return ids

    def _remember(self, key: bytes, ids: tuple[int, ...]) -> None:
        if len(ids) > self.cache_tokens:
            return
        self._cache[key] = ids
        self._cached_tokens += len(ids)
        while len(self._cache) > self.cache_entries or self._cached_tokens > self.cache_tokens:
            _, dropped = self._cache.popitem(last=False)
            self._cached_tokens -= len(dropped)

    async def _local(self, tokenizer: Tokenizer, prompt: TextPrompt | ChatPrompt) -> tuple[int, ...] | None:
        size = len(prompt.text) if isinstance(prompt, TextPrompt) else _chat_size(prompt.messages)
        try:
            if size <= self.inline_chars:
                return prompt_ids(tokenizer, prompt)
            self.stats.offloaded += 1
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvstack-tokenize")
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._executor, prompt_ids, tokenizer, prompt)
        except Exception as exc:  # a user's template or messages can fail in many ways; the engine will say
            log.debug("local tokenization failed: %r", exc)
            return None

    def _pick_engine(self, model: str) -> str | None:
        """The next engine in turn for ``model`` that is not cooling down, or None."""
        if self.client is None or self.engines_for is None:
            return None
        now = time.monotonic()
        candidates = [e for e in self.engines_for(model) if self._cooling.get(e, 0.0) <= now]
        if not candidates:
            return None
        self._turn += 1
        return candidates[self._turn % len(candidates)]

    async def _remote(
        self, engine: str, model: str, prompt: TextPrompt | ChatPrompt
    ) -> tuple[int, ...] | None:
        assert self.client is not None
        fields: dict[str, Any] = {"model": model}
        if isinstance(prompt, TextPrompt):
            fields.update(prompt=prompt.text, add_special_tokens=prompt.add_special_tokens)
        else:
            fields.update(prompt.fields())
        try:
            body = _encode.encode(fields)
            reply = await self.client.post_json(
                engine,
                "/tokenize",
                body,
                within=self.remote_timeout,
                max_bytes=_ANSWER_BYTES_PER_BYTE * len(body) + _ANSWER_SLACK,
            )
            if reply.status != 200:
                if reply.status >= 500 or reply.status == 404:
                    self._cool(engine, f"HTTP {reply.status}")
                else:  # the prompt's problem; the engine will tell the client when it serves it
                    log.debug("engine %s: /tokenize answered %d", engine, reply.status)
                return None
            tokens = reply.json()["tokens"]
            if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
                raise ValueError("'tokens' is not a list of token ids")
            return tuple(tokens)
        except TimeoutError:
            self._cool(engine, f"no answer within {self.remote_timeout:g} s")
        except BodyTooLarge as exc:  # a prompt that renders to far more than it holds: not the engine's fault
            log.debug("engine %s: /tokenize %s", engine, exc)
        except (UpstreamError, ValueError, KeyError, TypeError) as exc:
            self._cool(engine, repr(exc))
        return None

    def _cool(self, engine: str, why: str) -> None:
        now = time.monotonic()
        # Expired entries go here, so engines that left do not pile up.
        self._cooling = {e: until for e, until in self._cooling.items() if until > now}
        self._cooling[engine] = now + self.remote_cooldown
        log.warning(
            "engine %s: /tokenize failed (%s); not asking it to tokenize prompts for %g s",
            engine,
            why,
            self.remote_cooldown,
        )

    def close(self) -> None:
        """Join the worker thread (if one was started)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None


def prompt_ids(tokenizer: Tokenizer, prompt: TextPrompt | ChatPrompt) -> tuple[int, ...]:
    """The ids an engine computes for ``prompt`` (chat: the template rendered, then encoded); may raise."""
    if isinstance(prompt, TextPrompt):
        return tuple(tokenizer.encode(prompt.text, add_special_tokens=prompt.add_special_tokens))
    text = tokenizer.render_chat(
        prompt.messages,
        add_generation_prompt=prompt.add_generation_prompt,
        continue_final_message=prompt.continue_final_message,
        chat_template=prompt.chat_template,
        chat_template_kwargs=prompt.chat_template_kwargs,
        tools=prompt.tools,
    )
    return tuple(tokenizer.encode(text, add_special_tokens=prompt.add_special_tokens))


def _chat_size(messages: Sequence[Any]) -> int:
    size = 0
    for message in messages:
        if isinstance(message, dict):
            content = message.get("content")
            if isinstance(content, str):
                size += len(content)
            elif isinstance(content, list):
                size += sum(len(p.get("text", "")) for p in content if isinstance(p, dict))
    return size
