"""Tokenizers: HF directories tokenize and render chats exactly as transformers/vLLM do; the builtin one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jinja2
import pytest
from tokenizers import Tokenizer as RustTokenizer
from tokenizers.processors import TemplateProcessing

from kvstack.devtools.tiny_model import make_tiny_model
from kvstack.engines.tokenizer import (
    CHATML_TEMPLATE,
    ENDOFTEXT,
    IM_END,
    IM_START,
    BuiltinTokenizer,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
)
from support.engines import require_vllm, vllm_python

TEXTS = [
    "Hello world",
    "",
    " leading and trailing spaces  ",
    "12345 apples cost $6.78, don't they?",
    "caf\u0065\u0301 naïve 日本語 emoji 🙂🚀",
    "tabs\tand\nnewlines\r\n\n  indented",
    f"{IM_START}user\nhi{IM_END}\n{IM_START}assistant\n",
    f"{ENDOFTEXT}text after end{ENDOFTEXT}",
    "def cache(key):\n    return {'key': key, \"hits\": 3}\n",
    "The engine keeps a prefix cache of blocks; a request that shares a prefix skips its prefill. " * 5,
]

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city <today> & tomorrow",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]

CONVERSATIONS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": "Hi there"}]},
    {
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "What is a KV cache?"},
            {"role": "assistant", "content": "Stored keys and values."},
            {"role": "user", "content": "And a prefix cache?"},
        ]
    },
    {"messages": [{"role": "user", "content": "No prompt please"}], "add_generation_prompt": False},
    {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Describe"},
                    {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
                    {"type": "text", "text": "in one word."},
                ],
            }
        ]
    },
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "Only part"}]}]},
    {
        "messages": [
            {"role": "user", "content": "Write a haiku"},
            {"role": "assistant", "content": "Blocks in memory  "},
        ],
        "add_generation_prompt": False,
        "continue_final_message": True,
    },
    {
        "messages": [
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
                ],
            },
            {"role": "tool", "content": '{"temp": 21}'},
        ],
        "tools": TOOLS,
    },
    {"messages": [{"role": "user", "content": 'Ünïcödé ✓ <tags> & "quotes"'}], "tools": TOOLS},
    {
        "messages": [{"role": "user", "content": "custom"}],
        "chat_template": "{{ bos_token or '' }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n"
        "{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}",
    },
    {
        "messages": [{"role": "user", "content": "kwargs"}],
        "chat_template_kwargs": {"enable_thinking": False},
        "chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}{{ eos_token }}",
    },
]

# Exercises the transformers-specific jinja set-up: tojson options, loop controls, generation blocks,
# namespaces.
FEATURE_TEMPLATE = """{{ bos_token }}
{%- set ns = namespace(count=0) %}
{%- for message in messages %}
    {%- if message.role == 'skip' %}{% continue %}{% endif %}
    {%- set ns.count = ns.count + 1 %}
    {%- if message.role == 'assistant' %}
        {%- generation %}{{ message.content }}{% endgeneration %}
    {%- else %}
<{{ message.role }}>{{ message.content | tojson }}</{{ message.role }}>
    {%- endif %}
    {%- if message.role == 'stop' %}{% break %}{% endif %}
{%- endfor %}
{%- if tools %}
{{ tools | tojson(indent=2) }}
{%- endif %}
count={{ ns.count }}{% if add_generation_prompt %}
<assistant>{% endif %}"""

FEATURE_CONVERSATIONS: list[dict[str, Any]] = [
    {
        "messages": [
            {"role": "user", "content": "<b>bold</b> & 'quoted' é"},
            {"role": "skip", "content": "hidden"},
            {"role": "assistant", "content": "ok"},
            {"role": "stop", "content": "last"},
            {"role": "user", "content": "never rendered"},
        ],
        "tools": TOOLS,
    },
    {"messages": [{"role": "user", "content": "plain"}], "add_generation_prompt": False},
]

_TRANSFORMERS_SCRIPT = """
import json, sys
from transformers import AutoTokenizer

results = {}
for job in json.loads(open(sys.argv[1], encoding="utf-8").read()):
    tok = AutoTokenizer.from_pretrained(job["directory"])
    out = results[job["directory"]] = {"class": type(tok).__name__, "encode": [], "decode": [], "chat": []}
    for text in job["texts"]:
        with_special = tok.encode(text, add_special_tokens=True)
        without = tok.encode(text, add_special_tokens=False)
        out["encode"].append([with_special, without])
        out["decode"].append([
            tok.decode(with_special, skip_special_tokens=True),
            tok.decode(with_special, skip_special_tokens=False),
            [tok.decode([i]) for i in with_special],
        ])
    for case in job["conversations"]:
        kwargs = dict(case.get("chat_template_kwargs") or {})
        kwargs["add_generation_prompt"] = case.get("add_generation_prompt", True)
        kwargs["continue_final_message"] = case.get("continue_final_message", False)
        if case.get("chat_template") is not None:
            kwargs["chat_template"] = case["chat_template"]
        text = tok.apply_chat_template(case["messages"], tools=case.get("tools"), tokenize=False, **kwargs)
        ids = tok.apply_chat_template(
            case["messages"], tools=case.get("tools"), tokenize=True, return_dict=False, **kwargs
        )
        out["chat"].append([text, list(ids)])
print(json.dumps(results))
"""


def _render_and_encode(tokenizer: Tokenizer, case: dict[str, Any]) -> tuple[str, list[int]]:
    text = tokenizer.render_chat(
        case["messages"],
        add_generation_prompt=case.get("add_generation_prompt", True),
        continue_final_message=case.get("continue_final_message", False),
        chat_template=case.get("chat_template"),
        chat_template_kwargs=case.get("chat_template_kwargs"),
        tools=case.get("tools"),
    )
    return text, tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tok") / "tiny")


@pytest.fixture(scope="module")
def feature_dir(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with a BOS-adding post-processor and a chat_template.jinja using jinja extras."""
    directory = tmp_path_factory.mktemp("tok") / "feature"
    shutil.copytree(model_dir, directory)
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text("utf-8"))
    # transformers ignores add_bos_token when tokenizer.json exists; its post-processor decides.
    config.update(bos_token=ENDOFTEXT, add_bos_token=False)
    del config["chat_template"]
    config_file.write_text(json.dumps(config), encoding="utf-8")
    backend = RustTokenizer.from_file(str(directory / "tokenizer.json"))
    backend.post_processor = TemplateProcessing(single=f"{ENDOFTEXT} $A", special_tokens=[(ENDOFTEXT, 0)])
    backend.save(str(directory / "tokenizer.json"))
    # A chat_template.jinja file takes precedence over tokenizer_config.json, as in transformers.
    (directory / "chat_template.jinja").write_text(FEATURE_TEMPLATE, encoding="utf-8")
    return directory


@pytest.fixture(scope="module")
def transformers_reference(
    model_dir: Path, feature_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    """What transformers (from the vLLM virtualenv) makes of the test texts and chats, per model directory."""
    require_vllm()
    python = vllm_python()
    jobs = [
        {"directory": str(model_dir), "texts": TEXTS, "conversations": CONVERSATIONS},
        {"directory": str(feature_dir), "texts": TEXTS[:4], "conversations": FEATURE_CONVERSATIONS},
    ]
    jobs_file = tmp_path_factory.mktemp("tok") / "jobs.json"
    jobs_file.write_text(json.dumps(jobs), encoding="utf-8")
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TRANSFORMERS_VERBOSITY": "error",
    }
    result = subprocess.run(
        [str(python), "-c", _TRANSFORMERS_SCRIPT, str(jobs_file)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    loaded = json.loads(result.stdout.strip().splitlines()[-1])
    assert isinstance(loaded, dict)
    return loaded


def _assert_same_as_transformers(
    directory: Path, texts: list[str], conversations: list[dict[str, Any]], expected: dict[str, Any]
) -> None:
    ours = HFTokenizer(directory)
    for text, (with_special, without), (skipped, kept, pieces) in zip(
        texts, expected["encode"], expected["decode"], strict=True
    ):
        assert ours.encode(text) == with_special, text
        assert ours.encode(text, add_special_tokens=False) == without, text
        assert ours.decode(with_special) == skipped, text
        assert ours.decode(with_special, skip_special_tokens=False) == kept, text
        assert [ours.token_str(i) for i in with_special] == pieces, text
    for case, (text, ids) in zip(conversations, expected["chat"], strict=True):
        assert _render_and_encode(ours, case) == (text, ids), case


# --- equivalence with transformers (what vLLM uses) ---------------------------------------------------------


@pytest.mark.vllm
def test_tiny_model_matches_transformers(model_dir: Path, transformers_reference: dict[str, Any]) -> None:
    expected = transformers_reference[str(model_dir)]
    _assert_same_as_transformers(model_dir, TEXTS, CONVERSATIONS, expected)
    # transformers picks Qwen2Tokenizer for model_type qwen2 and rebuilds the pre-tokenizer; the tiny model's
    # tokenizer.json uses the same pipeline, which is why the ids above agree.
    assert expected["class"] == "Qwen2Tokenizer"


@pytest.mark.vllm
def test_bos_post_processor_and_jinja_extras_match_transformers(
    feature_dir: Path, transformers_reference: dict[str, Any]
) -> None:
    expected = transformers_reference[str(feature_dir)]
    _assert_same_as_transformers(feature_dir, TEXTS[:4], FEATURE_CONVERSATIONS, expected)
    ours = HFTokenizer(feature_dir)
    assert ours.encode("hi")[0] == ours.encode(ENDOFTEXT, add_special_tokens=False)[0]
    assert ours.encode("hi", add_special_tokens=False)[0] != ours.encode("hi")[0]


# --- HFTokenizer on its own ---------------------------------------------------------------------------------


@pytest.mark.parametrize("text", [t for t in TEXTS if "\u0301" not in t])
def test_hf_round_trip(model_dir: Path, text: str) -> None:
    tokenizer = HFTokenizer(model_dir)
    assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text


def test_hf_normalises_to_nfc_like_qwen(model_dir: Path) -> None:
    tokenizer = HFTokenizer(model_dir)
    assert tokenizer.encode("cafe\u0301") == tokenizer.encode("caf\u00e9")


def test_hf_special_tokens(model_dir: Path) -> None:
    tokenizer = HFTokenizer(model_dir)
    assert tokenizer.eos_token_id == 2
    assert tokenizer.bos_token_id is None
    assert tokenizer.special_tokens == {"eos_token": IM_END, "pad_token": ENDOFTEXT}
    ids = tokenizer.encode(f"{IM_START}user\nhi{IM_END}")
    assert ids[0] == 1 and ids[-1] == 2
    assert tokenizer.decode(ids) == "user\nhi"
    assert tokenizer.token_str(2) == IM_END


def test_hf_partial_utf8_token_decodes_to_replacement_char(model_dir: Path) -> None:
    tokenizer = HFTokenizer(model_dir)
    ids = tokenizer.encode("🙂")
    assert len(ids) > 1
    assert tokenizer.token_str(ids[0]) == "\ufffd"


def test_hf_chat_shapes(model_dir: Path) -> None:
    tokenizer = HFTokenizer(model_dir)
    system_user = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert tokenizer.render_chat(system_user) == (
        f"{IM_START}system\nS{IM_END}\n{IM_START}user\nU{IM_END}\n{IM_START}assistant\n"
    )
    parts = [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tokenizer.render_chat(parts, add_generation_prompt=False) == f"{IM_START}user\na\nb{IM_END}\n"
    # vLLM hands a "string"-format template the parts joined by "\n" and an "openai"-format one the list
    # itself.
    joined = [{"role": "user", "content": "a\nb"}]
    assert tokenizer.render_chat(joined) == tokenizer.render_chat(parts)
    assert tokenizer.render_chat([{"role": "user", "content": [{"type": "text", "text": "x"}]}]) == (
        tokenizer.render_chat([{"role": "user", "content": "x"}])
    )
    continued = [{"role": "user", "content": "U"}, {"role": "assistant", "content": "Once upon"}]
    assert tokenizer.render_chat(continued, add_generation_prompt=False, continue_final_message=True) == (
        f"{IM_START}user\nU{IM_END}\n{IM_START}assistant\nOnce upon"
    )


def test_hf_chat_errors_carry_the_fix(model_dir: Path) -> None:
    tokenizer = HFTokenizer(model_dir)
    with pytest.raises(ValueError, match="mutually exclusive"):
        tokenizer.render_chat([{"role": "user", "content": "x"}], continue_final_message=True)
    with pytest.raises(ValueError, match="empty conversation"):
        tokenizer.render_chat([])
    with pytest.raises(jinja2.TemplateError, match="no system"):
        tokenizer.render_chat(
            [{"role": "system", "content": "x"}],
            chat_template="{% if messages[0].role == 'system' %}"
            "{{ raise_exception('no system') }}{% endif %}",
        )


def test_hf_named_templates_and_missing_template(model_dir: Path, tmp_path: Path) -> None:
    directory = tmp_path / "named"
    shutil.copytree(model_dir, directory)
    config_file = directory / "tokenizer_config.json"
    config = json.loads(config_file.read_text("utf-8"))
    config["chat_template"] = [
        {"name": "default", "template": "D{{ messages[0].content }}"},
        {"name": "tool_use", "template": "T{{ messages[0].content }}"},
    ]
    config_file.write_text(json.dumps(config), encoding="utf-8")
    tokenizer = HFTokenizer(directory)
    messages = [{"role": "user", "content": "x"}]
    assert tokenizer.render_chat(messages) == "Dx"
    assert tokenizer.render_chat(messages, tools=TOOLS) == "Tx"
    assert tokenizer.render_chat(messages, chat_template="tool_use") == "Tx"

    del config["chat_template"]
    config_file.write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(ValueError, match="no chat template"):
        HFTokenizer(directory).render_chat(messages)


def test_sandbox_blocks_unsafe_templates(model_dir: Path) -> None:
    tokenizer = HFTokenizer(model_dir)
    with pytest.raises(jinja2.exceptions.SecurityError):
        tokenizer.render_chat(
            [{"role": "user", "content": "x"}],
            chat_template="{{ messages.__class__.__mro__ }}{{ messages.append(1) }}",
        )


# --- load_tokenizer -----------------------------------------------------------------------------------------


def test_load_tokenizer(model_dir: Path, tmp_path: Path) -> None:
    assert isinstance(load_tokenizer(None), BuiltinTokenizer)
    assert isinstance(load_tokenizer("builtin"), BuiltinTokenizer)
    loaded = load_tokenizer(str(model_dir))
    assert isinstance(loaded, HFTokenizer)
    assert loaded.name == str(model_dir)
    with pytest.raises(FileNotFoundError, match="make_tiny_model"):
        load_tokenizer(tmp_path)


# --- BuiltinTokenizer ---------------------------------------------------------------------------------------

_BUILTIN_SCRIPT = """
import json, sys
from kvstack.engines.tokenizer import BuiltinTokenizer
tok = BuiltinTokenizer()
print(json.dumps([tok.encode(text) for text in json.loads(sys.argv[1])]))
"""


def test_builtin_ids_do_not_depend_on_the_hash_seed() -> None:
    outputs = set()
    for seed in ("0", "1", "12345"):
        result = subprocess.run(
            [sys.executable, "-c", _BUILTIN_SCRIPT, json.dumps(TEXTS)],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        outputs.add(result.stdout)
    assert len(outputs) == 1
    assert json.loads(outputs.pop()) == [BuiltinTokenizer().encode(text) for text in TEXTS]


@pytest.mark.parametrize("text", [*TEXTS, "_under_score__", "x\u0301\u200b\ufeff\x00\x7f", "²³ Ⅻ ١٢٣"])
def test_builtin_round_trip(text: str) -> None:
    tokenizer = BuiltinTokenizer()
    ids = tokenizer.encode(text)
    assert all(0 <= i < tokenizer.vocab_size for i in ids)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    if text.isascii():
        assert "".join(tokenizer.token_str(i) for i in ids) == text


def test_builtin_words_are_single_tokens_and_the_rest_bytes() -> None:
    tokenizer = BuiltinTokenizer()
    assert len(tokenizer.encode("The cache model")) == 3
    assert [tokenizer.token_str(i) for i in tokenizer.encode(" Hello, world!")] == [
        " Hello",
        ",",
        " world",
        "!",
    ]
    assert len(tokenizer.encode("zq")) == 2


def test_builtin_special_tokens_and_eos() -> None:
    tokenizer = BuiltinTokenizer()
    assert tokenizer.eos_token_id == 2
    assert [tokenizer.encode(token) for token in (ENDOFTEXT, IM_START, IM_END)] == [[0], [1], [2]]
    ids = tokenizer.encode(f"{IM_START}user\nhi{IM_END}")
    assert tokenizer.decode(ids) == "user\nhi"
    assert tokenizer.decode(ids, skip_special_tokens=False) == f"{IM_START}user\nhi{IM_END}"
    assert tokenizer.encode("hi") == tokenizer.encode("hi", add_special_tokens=False)
    # Out-of-range ids are dropped rather than raising, as the tokenizers library does.
    assert tokenizer.decode([-1, tokenizer.vocab_size, *tokenizer.encode("ok")]) == "ok"


def test_builtin_partial_utf8_decodes_to_replacement_char() -> None:
    tokenizer = BuiltinTokenizer()
    ids = tokenizer.encode("é")
    assert len(ids) == 2
    assert tokenizer.token_str(ids[0]) == "\ufffd"


def test_builtin_chat_matches_the_tiny_model(model_dir: Path) -> None:
    builtin, hf = BuiltinTokenizer(), HFTokenizer(model_dir)
    for case in CONVERSATIONS:
        assert _render_and_encode(builtin, case)[0] == _render_and_encode(hf, case)[0]
    assert (
        builtin.render_chat([{"role": "user", "content": "x"}], chat_template="<{{ messages[0].content }}>")
        == "<x>"
    )
    assert (
        json.loads((model_dir / "tokenizer_config.json").read_text("utf-8"))["chat_template"]
        == CHATML_TEMPLATE
    )
