"""Prompt tokenization and chat rendering, done the way vLLM does it.

`Tokenizer` is the interface the simulated engine (and the router) use to turn a request into the token ids
a vLLM engine would see. Two implementations:

- `HFTokenizer` reads a Hugging Face model directory (`tokenizer.json`, `tokenizer_config.json`, optionally
  `chat_template.jinja`) with the `tokenizers` library and renders chats with jinja2 configured exactly as
  transformers' `apply_chat_template` configures it, without importing transformers.
- `BuiltinTokenizer` needs no files: special tokens at ids 0-2, the 256 bytes at ids 3-258, then one id per
  entry of a fixed English word table (`BUILTIN_WORDS`, with and without a leading space, lower-case and
  capitalised). Text is split into words, numbers, punctuation runs and whitespace; a piece found in the
  table is one id, anything else is spelled out in byte ids, so decoding is exact and no hash seed matters.

Chat requests are rendered to text and then encoded with ``add_special_tokens=False``: vLLM's chat path calls
`apply_chat_template(tokenize=True)`, which does exactly that, so a BOS-adding tokenizer gets no second BOS.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from copy import deepcopy
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken
from tokenizers import Tokenizer as RustTokenizer

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
# Order fixes the ids (0, 1, 2) in both the builtin tokenizer and the tiny model's trained tokenizer.
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)

# ChatML, as Qwen models use it. Multi-part content keeps only text parts and joins them with "\n": that is
# how vLLM flattens parts for templates it classifies as "string" format, so the rendered prompt is the same
# whichever content format vLLM picks for this template.
CHATML_TEMPLATE = """\
{%- macro render_content(content) -%}
{%- if content is string -%}
{{- content -}}
{%- elif content is iterable and content is not mapping -%}
{%- for part in content if part.type == 'text' -%}
{%- if not loop.first -%}{{- '\\n' -}}{%- endif -%}
{{- part.text -}}
{%- endfor -%}
{%- endif -%}
{%- endmacro -%}
{%- if tools -%}
{{- '<|im_start|>system\\n' -}}
{%- if messages and messages[0].role == 'system' -%}
{{- render_content(messages[0].content) + '\\n\\n' -}}
{%- endif -%}
{{- '# Tools\\n\\nYou may call one or more functions. Their signatures are in <tools></tools>:' -}}
{{- '\\n<tools>' -}}
{%- for tool in tools -%}
{{- '\\n' + (tool | tojson) -}}
{%- endfor -%}
{{- '\\n</tools>\\n\\nFor each call, answer with a JSON object in <tool_call></tool_call> tags.' -}}
{{- '<|im_end|>\\n' -}}
{%- endif -%}
{%- for message in messages -%}
{%- if not (tools and loop.first and message.role == 'system') -%}
{%- set content = render_content(message.content) -%}
{{- '<|im_start|>' + message.role + '\\n' + content -}}
{%- if message.role == 'assistant' and message.tool_calls -%}
{%- for tool_call in message.tool_calls -%}
{%- set call = tool_call.function if tool_call.function is defined else tool_call -%}
{%- if content or not loop.first -%}{{- '\\n' -}}{%- endif -%}
{{- '<tool_call>\\n{"name": "' + call.name + '", "arguments": ' -}}
{%- if call.arguments is string -%}
{{- call.arguments -}}
{%- else -%}
{{- call.arguments | tojson -}}
{%- endif -%}
{{- '}\\n</tool_call>' -}}
{%- endfor -%}
{%- endif -%}
{{- '<|im_end|>\\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
{{- '<|im_start|>assistant\\n' -}}
{%- endif -%}
"""

# Everyday English words. The builtin tokenizer gives each one a single id, and the tiny model's training
# corpus is built from them, so both tokenizers cut English-ish prompts into roughly as many tokens as a real
# model's would.
_WORD_TEXT = """
    the of and to a in is it you that he was for on are with as his they be at one have this from or had
    by not word but what some we can out other were all there when up use your how said an each she which
    do their time if will way about many then them write would like so these her long make thing see him
    two has look more day could go come did number sound no most people my over know water than call first
    who may down side been now find any new work part take get place made live where after back little
    only round man year came show every good me give our under name very through just form sentence great
    think say help low line differ turn cause much mean before move right boy old too same tell does set
    three want air well also play small end put home read hand port large spell add even land here must
    big high such follow act why ask men change went light kind off need house picture try us again animal
    point mother world near build self earth father head stand own page should country found answer school
    grow study still learn plant cover food sun four between state keep eye never last let thought city
    tree cross farm hard start might story saw far sea draw left late run while press close night real
    life few north open seem together next white children begin got walk example ease paper group always
    music those both mark often letter until mile river car feet care second book carry took science eat
    room friend began idea fish mountain stop once base hear horse cut sure watch color face wood main
    enough plain girl usual young ready above ever red list though feel talk bird soon body dog family
    direct pose leave song measure door product black short numeral class wind question happen complete
    ship area half rock order fire south problem piece told knew pass since top whole king space heard
    best hour better true during hundred five remember step early hold west ground interest reach fast
    verb sing listen six table travel less morning ten simple several vowel toward war lay against pattern
    slow center love person money serve appear road map rain rule govern pull cold notice voice unit power
    town fine certain fly fall lead cry dark machine note wait plan figure star box noun field rest
    correct able pound done beauty drive stood contain front teach week final gave green oh quick develop
    ocean warm free minute strong special mind behind clear tail produce fact street inch multiply nothing
    course stay wheel full force blue object decide surface deep moon island foot system busy test record
    boat common gold possible plane stead dry wonder laugh thousand ago ran check game shape equate hot
    miss brought heat snow tire bring yes distant fill east paint language among hello please thanks user
    assistant system tool function value answer explain summary code data file error cache model token
    request server memory prefix block engine queue latency
"""
BUILTIN_WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())

# Letters, up to three digits, and runs of other symbols, each optionally led by one space; then whitespace.
# Every character falls in one alternative, so the pieces always concatenate back to the text.
_BUILTIN_PIECE = re.compile(r"'(?:s|t|re|ve|m|ll|d)| ?[^\W\d_]+| ?\d{1,3}| ?(?:[^\s\w]|_)+|\s+(?!\S)|\s+")
_BYTE_BASE = len(SPECIAL_TOKENS)
_WORD_BASE = _BYTE_BASE + 256

# Named special tokens transformers always exposes to chat templates (its SPECIAL_TOKENS_ATTRIBUTES).
_NAMED_SPECIAL_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class Tokenizer(Protocol):
    """Turns prompts and chats into the token ids a vLLM engine serving the same model would compute."""

    name: str
    eos_token_id: int | None
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies the post-processor (e.g. a BOS), as in HF."""
        ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; invalid UTF-8 from partial byte tokens comes out as U+FFFD."""
        ...

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text the chat template makes of `messages` (encode it with add_special_tokens=False)."""
        ...

    def token_str(self, token_id: int) -> str:
        """The text of one token as vLLM reports it in logprobs: ``decode([id])`` keeping special tokens."""
        ...


# --- chat template rendering (shared by both tokenizers) ----------------------------------------------------


class _GenerationBlock(jinja2.ext.Extension):
    """Accepts ``{% generation %}...{% endgeneration %}`` blocks and renders their body.

    transformers registers this tag (to compute assistant masks for training); templates that use it fail to
    parse without it.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    def _render_body(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja's own tojson escapes <, >, & and ' for HTML; chat templates (and transformers) want plain JSON.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def _compile_template(source: str) -> jinja2.Template:
    # Requests may carry their own template, hence a bounded cache rather than one compile per tokenizer.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def render_chat_template(
    template: str,
    messages: list[dict[str, Any]],
    *,
    special_tokens: dict[str, str],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    chat_template_kwargs: dict[str, Any] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """Render `messages` with `template` as transformers' ``apply_chat_template(tokenize=False)`` does.

    `chat_template_kwargs` become template variables on top of `special_tokens`; the explicit arguments win
    over same-named keys in it, as vLLM merges request fields over ``chat_template_kwargs``.
    """
    if not messages:
        raise ValueError("cannot render an empty conversation; send at least one message")
    if continue_final_message and add_generation_prompt:
        raise ValueError(
            "continue_final_message and add_generation_prompt are mutually exclusive; "
            "set add_generation_prompt=False to continue the last message"
        )
    variables = dict(chat_template_kwargs or {})
    for explicit in ("add_generation_prompt", "continue_final_message", "messages"):
        variables.pop(explicit, None)
    documents = variables.pop("documents", None)
    kwargs_tools = variables.pop("tools", None)
    if tools is None:
        tools = kwargs_tools
    variables = {**special_tokens, **variables}

    final_text: str | None = None
    if continue_final_message:
        messages, final_text = _tag_final_message(messages, template)

    rendered = _compile_template(template).render(
        messages=messages,
        tools=tools,
        documents=documents,
        add_generation_prompt=add_generation_prompt,
        **variables,
    )
    if final_text is None:
        return rendered
    return _cut_after_final_message(rendered, final_text)


def _tag_final_message(messages: list[dict[str, Any]], template: str) -> tuple[list[dict[str, Any]], str]:
    """Mark where the final message's text ends so the rendered prompt can be cut right after it."""
    if "content" not in template:
        raise ValueError("continue_final_message needs a chat template that renders message content")
    tagged = deepcopy(messages)
    final = tagged[-1]
    content = final.get("content")
    if content is None:
        raise ValueError("continue_final_message is set but the final message has no content to continue")
    if isinstance(content, list | tuple):
        for part in reversed(content):
            if "text" in part:
                original = str(part["text"])
                part["text"] = original + _CONTINUE_TAG
                return tagged, original
        raise ValueError("continue_final_message is set but the final message has no text part to continue")
    final["content"] = content + _CONTINUE_TAG
    return tagged, str(content)


def _cut_after_final_message(rendered: str, final_text: str) -> str:
    tag = _CONTINUE_TAG.strip()
    if final_text.strip() not in rendered or tag not in rendered:
        raise ValueError(
            "continue_final_message is set but the chat template dropped part of the final message; "
            f"final message: {final_text.strip()!r}"
        )
    at = rendered.rindex(tag)
    if rendered[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG:
        return rendered[:at]
    # The template trimmed whitespace after the message, so trailing whitespace of the message is gone too.
    return rendered[:at].rstrip()


# --- Hugging Face model directories -------------------------------------------------------------------------


def _token_text(value: Any) -> str | None:
    """A special token from tokenizer_config.json: a string or a serialised AddedToken ({"content": ...})."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


# Above this many characters HFTokenizer.encode uses the GIL-releasing batch call (it costs a little more).
_GIL_FREE_CHARS = 4096


class HFTokenizer:
    """A Hugging Face tokenizer directory, read with the `tokenizers` library (no transformers needed)."""

    def __init__(self, directory: str | Path, *, name: str | None = None) -> None:
        self.directory = Path(directory)
        tokenizer_file = self.directory / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(
                f"{tokenizer_file} not found: HFTokenizer needs a fast-tokenizer file; save the tokenizer "
                "with transformers' save_pretrained, or make a model directory with kvstack's make_tiny_model"
            )
        self.name = name or str(directory)
        self._backend = RustTokenizer.from_file(str(tokenizer_file))
        config_file = self.directory / "tokenizer_config.json"
        config: dict[str, Any] = json.loads(config_file.read_text("utf-8")) if config_file.is_file() else {}

        self.special_tokens = self._named_special_tokens(config)
        self._add_missing_special_tokens(config)
        # add_bos_token/add_eos_token in tokenizer_config.json are ignored on purpose: transformers (v5) drops
        # them whenever tokenizer.json exists, leaving BOS/EOS insertion to tokenizer.json's post-processor.
        self.chat_templates = self._chat_templates(config)

        eos = self.special_tokens.get("eos_token")
        self.eos_token_id: int | None = self._backend.token_to_id(eos) if eos is not None else None
        bos = self.special_tokens.get("bos_token")
        self.bos_token_id: int | None = self._backend.token_to_id(bos) if bos is not None else None
        self.vocab_size = self._backend.get_vocab_size(with_added_tokens=True)

    @staticmethod
    def _named_special_tokens(config: dict[str, Any]) -> dict[str, str]:
        # transformers passes every named special token to chat templates: the standard seven, the names given
        # in an `extra_special_tokens` mapping, and any other string-valued "*_token" key of the config.
        named: dict[str, str] = {}
        for key in _NAMED_SPECIAL_TOKENS:
            if (text := _token_text(config.get(key))) is not None:
                named[key] = text
        extra = config.get("extra_special_tokens")
        if isinstance(extra, dict):
            for key, value in extra.items():
                if (text := _token_text(value)) is not None:
                    named[key] = text
        for key, value in config.items():
            if key.endswith("_token") and key not in named and (text := _token_text(value)) is not None:
                named[key] = text
        return named

    def _add_missing_special_tokens(self, config: dict[str, Any]) -> None:
        # transformers adds special tokens named in the config but absent from tokenizer.json; do the same so
        # ids agree with it.
        listed = config.get("extra_special_tokens", config.get("additional_special_tokens"))
        texts = list(self.special_tokens.values())
        if isinstance(listed, list):
            texts += [text for value in listed if (text := _token_text(value)) is not None]
        missing = [text for text in dict.fromkeys(texts) if self._backend.token_to_id(text) is None]
        if missing:
            self._backend.add_special_tokens(
                [AddedToken(text, special=True, normalized=False) for text in missing]
            )

    def _chat_templates(self, config: dict[str, Any]) -> dict[str, str]:
        # Same precedence as transformers: chat_template.jinja (plus chat_templates/*.jinja) over the config
        # entry.
        templates: dict[str, str] = {}
        jinja_file = self.directory / "chat_template.jinja"
        if jinja_file.is_file():
            templates["default"] = jinja_file.read_text("utf-8")
        named_dir = self.directory / "chat_templates"
        if named_dir.is_dir():
            for path in sorted(named_dir.glob("*.jinja")):
                templates[path.stem] = path.read_text("utf-8")
        if templates:
            return templates
        configured = config.get("chat_template")
        if isinstance(configured, str):
            return {"default": configured}
        if isinstance(configured, list):
            return {str(entry["name"]): str(entry["template"]) for entry in configured}
        return {}

    def resolve_template(self, chat_template: str | None, tools: list[dict[str, Any]] | None) -> str:
        """The template to render with: a named template, a literal one, or the model's default."""
        if chat_template is not None:
            return self.chat_templates.get(chat_template, chat_template)
        if tools and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if "default" in self.chat_templates:
            return self.chat_templates["default"]
        raise ValueError(
            f"{self.directory} has no chat template (tokenizer_config.json 'chat_template' or "
            "chat_template.jinja); pass chat_template=... or add one to the model directory"
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; `add_special_tokens` applies the post-processor (e.g. a BOS), as in HF.

        Long texts go through the batch call: it releases the GIL while it works (the single call does
        not), so a caller that encodes on a worker thread leaves the event loop running.
        """
        if len(text) < _GIL_FREE_CHARS:
            return list(self._backend.encode(text, add_special_tokens=add_special_tokens).ids)
        batch = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)
        return list(batch[0].ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; invalid UTF-8 from partial byte tokens comes out as U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text the chat template makes of `messages` (encode it with add_special_tokens=False)."""
        return render_chat_template(
            self.resolve_template(chat_template, tools),
            messages,
            special_tokens=self.special_tokens,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
            tools=tools,
        )

    def token_str(self, token_id: int) -> str:
        """The text of one token as vLLM reports it in logprobs: ``decode([id])`` keeping special tokens."""
        return self._backend.decode([token_id], skip_special_tokens=False)


# --- builtin tokenizer --------------------------------------------------------------------------------------


def _builtin_word_table() -> tuple[bytes, ...]:
    forms: dict[bytes, None] = {}
    for word in BUILTIN_WORDS:
        for form in (word, " " + word, word.capitalize(), " " + word.capitalize()):
            forms.setdefault(form.encode(), None)
    return tuple(forms)


class BuiltinTokenizer:
    """A file-free tokenizer with exact decoding: table words get one id, everything else one id per byte."""

    def __init__(self, name: str = "builtin") -> None:
        self.name = name
        self._words = _builtin_word_table()
        self._word_ids = {word: _WORD_BASE + i for i, word in enumerate(self._words)}
        self._special_ids = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
        self._special_split = re.compile("(" + "|".join(re.escape(token) for token in SPECIAL_TOKENS) + ")")
        self.vocab_size = _WORD_BASE + len(self._words)
        self.eos_token_id: int | None = self._special_ids[IM_END]
        self.special_tokens = {"eos_token": IM_END, "pad_token": ENDOFTEXT}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; no BOS is ever added, so `add_special_tokens` changes nothing (like Qwen)."""
        ids: list[int] = []
        for chunk in self._special_split.split(text):
            if chunk in self._special_ids:
                ids.append(self._special_ids[chunk])
                continue
            for piece in _BUILTIN_PIECE.findall(chunk):
                raw = piece.encode()
                word_id = self._word_ids.get(raw)
                if word_id is not None:
                    ids.append(word_id)
                else:
                    ids.extend(_BYTE_BASE + byte for byte in raw)
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; invalid UTF-8 from partial byte tokens becomes U+FFFD, unknown ids are dropped."""
        out: list[str] = []
        pending = bytearray()
        for token_id in ids:
            if token_id < 0 or token_id >= self.vocab_size:
                continue
            if token_id < _BYTE_BASE:
                out.append(pending.decode("utf-8", errors="replace"))
                pending.clear()
                if not skip_special_tokens:
                    out.append(SPECIAL_TOKENS[token_id])
            elif token_id < _WORD_BASE:
                pending.append(token_id - _BYTE_BASE)
            else:
                pending += self._words[token_id - _WORD_BASE]
        out.append(pending.decode("utf-8", errors="replace"))
        return "".join(out)

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text `chat_template` (default: ChatML) makes of `messages`."""
        return render_chat_template(
            chat_template or CHATML_TEMPLATE,
            messages,
            special_tokens=self.special_tokens,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template_kwargs=chat_template_kwargs,
            tools=tools,
        )

    def token_str(self, token_id: int) -> str:
        """The text of one token as vLLM reports it in logprobs: ``decode([id])`` keeping special tokens."""
        return self.decode([token_id], skip_special_tokens=False)


def load_tokenizer(path: str | Path | None) -> Tokenizer:
    """The tokenizer of a local model directory, or the builtin one for ``None`` / ``"builtin"``."""
    if path is None or str(path) == "builtin":
        return BuiltinTokenizer()
    directory = Path(path)
    if not (directory / "tokenizer.json").is_file():
        raise FileNotFoundError(
            f"no tokenizer.json in {directory}: pass a local model directory (kvstack does not download from "
            "the Hugging Face Hub; make one offline with kvstack's make_tiny_model) or 'builtin' for the "
            "builtin tokenizer"
        )
    return HFTokenizer(directory)
