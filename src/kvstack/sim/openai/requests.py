"""The parsed requests `kvstack.sim.openai.protocol`'s ``parse_*`` functions return: typed msgspec Structs.

Each Struct keeps the body fields it has no attribute for in ``extra``, as sent.
"""

from __future__ import annotations

from typing import Any

import msgspec

COMPLETION_DEFAULT_MAX_TOKENS = 16  # the OpenAI completions default vLLM keeps


class StreamOptions(msgspec.Struct, kw_only=True):
    """What a streaming response carries besides tokens."""

    include_usage: bool = False
    # Only honoured together with include_usage, as in vLLM.
    continuous_usage_stats: bool = False


class SamplingOptions(msgspec.Struct, kw_only=True):
    """Generation parameters; ``None`` means the engine default (vLLM's defaults noted per field)."""

    # Completions: the request's value, 16 when absent. Chat: max_completion_tokens, else max_tokens,
    # else None = the rest of the context. The engine's limit is `check_lengths`' result.
    max_tokens: int | None = None
    min_tokens: int = 0
    temperature: float | None = None  # 1.0
    top_p: float | None = None  # 1.0
    top_k: int | None = None  # 0 (-1 also disables)
    min_p: float | None = None  # 0.0
    n: int = 1
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    # Top log-probabilities per generated token: completions `logprobs`; chat `top_logprobs` when
    # `logprobs` is true. -1 means the whole vocabulary.
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float | None = None  # 0.0
    frequency_penalty: float | None = None  # 0.0
    repetition_penalty: float | None = None  # 1.0
    logit_bias: dict[int, float] | None = None  # clamped to [-100, 100]
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = msgspec.field(default_factory=list)
    echo: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    use_beam_search: bool = False
    routed_experts_prompt_start: int = 0


class GenerationRequest(msgspec.Struct, kw_only=True):
    """What completion and chat requests share besides their prompt, options and rendering."""

    model: str | None
    stream: bool = False
    stream_options: StreamOptions = msgspec.field(default_factory=StreamOptions)
    truncate_prompt_tokens: int | None = None
    truncation_side: str | None = None
    return_token_ids: bool = False
    kv_transfer_params: dict[str, Any] | None = None
    user: str | None = None
    priority: int = 0
    request_id: str | None = None
    cache_salt: str | None = None
    # Every body field without an attribute, as sent (vLLM ignores unknown ones).
    extra: dict[str, Any] = msgspec.field(default_factory=dict)
    # Which field set the output limit, for error messages: "max_completion_tokens" or "max_tokens".
    max_tokens_param: str = "max_tokens"


class CompletionRequest(GenerationRequest, kw_only=True):
    """A /v1/completions request; each prompt is text or token ids, one choice set per prompt."""

    prompts: list[str | list[int]]
    options: SamplingOptions
    suffix: str | None = None
    add_special_tokens: bool = True

    @property
    def echo_only(self) -> bool:
        """echo with max_tokens 0: vLLM generates one token and answers with the prompt alone."""
        return self.options.echo and self.options.max_tokens == 0


class ChatRequest(GenerationRequest, kw_only=True):
    """A /v1/chat/completions request (also the chat form of /tokenize)."""

    messages: list[dict[str, Any]]
    options: SamplingOptions = msgspec.field(default_factory=SamplingOptions)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = "none"
    # Whether some message carries image/audio/video parts, which a text-only engine must refuse.
    has_media: bool = False

    @classmethod
    def for_tokenize(cls, req: TokenizeRequest) -> ChatRequest:
        """The chat request a /tokenize body with messages stands for (for rendering)."""
        return cls(
            model=req.model,
            messages=req.messages or [],
            add_generation_prompt=req.add_generation_prompt,
            continue_final_message=req.continue_final_message,
            add_special_tokens=req.add_special_tokens,
            chat_template=req.chat_template,
            chat_template_kwargs=req.chat_template_kwargs,
            tools=req.tools,
            has_media=req.has_media,
        )


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """A /tokenize request: either `prompt` (text) or `messages` (rendered with the chat template)."""

    model: str | None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    has_media: bool = False
    extra: dict[str, Any] = msgspec.field(default_factory=dict)


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    """A /detokenize request. vLLM does not check ids against the vocabulary here."""

    model: str | None
    tokens: list[int]
    extra: dict[str, Any] = msgspec.field(default_factory=dict)
