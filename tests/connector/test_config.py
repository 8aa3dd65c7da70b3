"""The connector's settings (kv_connector_extra_config) and the chunk-key namespace its layout names:
defaults, errors that say what to fix, keys that differ by model, dtype, shape and rank and not by process,
and an import that pulls in no server or engine dependency. Layouts themselves: test_layouts.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstack.cache.keys import chunk_keys
from kvstack.connector import (
    PAGED_LAYOUT,
    AttentionShape,
    ConfigError,
    block_layout_name,
    keys_by_rank,
    kv_layout,
    parse_config,
)

BLOCK = 128
CHUNK = 256
TINY = AttentionShape(num_layers=2, num_kv_heads=2, head_size=64, dtype="bfloat16", block_size=BLOCK)
CPU = block_layout_name(PAGED_LAYOUT, platform="cpu", backend="CPU_ATTN", block_size=BLOCK)
LAYOUT = kv_layout("tiny", TINY, block_layout=CPU, tp_rank=0, tp_size=1)


def tokens(n: int, seed: int = 1) -> list[int]:
    return [(seed * 7919 + i * 104729) % 4000 + 3 for i in range(n)]


# -- config


def test_config_defaults_and_overrides() -> None:
    config = parse_config({"server": "tcp://127.0.0.1:5560"})
    assert (config.chunk_size, config.load, config.save, config.timeout_s) == (128, True, True, 1.0)
    assert (config.save_queue, config.prefill_wait_s, config.partial_tail) == (64, 2.0, True)
    assert parse_config({"server": "tcp://127.0.0.1:5560", "partial_tail": False}).partial_tail is False
    with pytest.raises(ConfigError, match="partial_tail must be bool"):
        parse_config({"server": "tcp://127.0.0.1:5560", "partial_tail": 1})
    config = parse_config(
        {"server": "ipc:///tmp/c", "chunk_size": 512, "load": False, "timeout_s": 2, "model_id": "m"}
    )
    assert (config.chunk_size, config.load, config.save, config.timeout_s, config.model_id) == (
        512,
        False,
        True,
        2,
        "m",
    )


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({}, "server must be the cache server's endpoint"),
        ({"server": "127.0.0.1:5560"}, "server must be"),
        ({"server": "tcp://h:1", "laod": False}, "unknown kv_connector_extra_config keys ['laod']"),
        ({"server": "tcp://h:1", "chunk_size": "256"}, "chunk_size must be int"),
        ({"server": "tcp://h:1", "chunk_size": True}, "chunk_size must be int"),
        ({"server": "tcp://h:1", "load": 1}, "load must be bool"),
        ({"server": "tcp://h:1", "chunk_size": 0}, "chunk_size must be >= 1"),
        ({"server": "tcp://h:1", "timeout_s": 0}, "need 0 < timeout_s <= retry_max_s"),
        ({"server": "tcp://h:1", "timeout_s": 5, "retry_max_s": 1}, "need 0 < timeout_s <= retry_max_s"),
        ({"server": "tcp://h:1", "model_id": ""}, "model_id must not be empty"),
        ({"server": "tcp://h:1", "save_queue": 0}, "save_queue must be >= 1"),
        ({"server": "tcp://h:1", "prefill_wait_s": -1}, "prefill_wait_s must be >= 0"),
    ],
)
def test_config_errors_say_what_to_fix(extra: dict[str, object], says: str) -> None:
    with pytest.raises(ConfigError, match="kvstack connector: ") as e:
        parse_config(extra)
    assert says in str(e.value)


def test_chunk_size_must_be_whole_blocks() -> None:
    parse_config({"server": "tcp://h:1", "chunk_size": 384}).check_block_size(128)
    with pytest.raises(ConfigError, match=r"not a multiple of vLLM's block size 128.*e\.g\. 256"):
        parse_config({"server": "tcp://h:1", "chunk_size": 300}).check_block_size(128)


def test_secret_file(tmp_path: Path) -> None:
    (tmp_path / "s").write_text(" sesame\n")
    assert parse_config({"server": "tcp://h:1", "secret_file": str(tmp_path / "s")}).secret() == b"sesame"
    (tmp_path / "e").write_text("\n")
    with pytest.raises(ConfigError, match="is empty"):
        parse_config({"server": "tcp://h:1", "secret_file": str(tmp_path / "e")}).secret()


# -- keys


def test_key_namespace_names_model_dtype_and_rank() -> None:
    """(Platform, backend, layout and block size: tests/connector/test_layouts.py.)"""
    prompt = tokens(512)
    base = chunk_keys(prompt, LAYOUT, CHUNK)
    assert base == chunk_keys(prompt, kv_layout("tiny", TINY, block_layout=CPU, tp_rank=0, tp_size=1), CHUNK)
    fp16, heads = AttentionShape(2, 2, 64, "float16", BLOCK), AttentionShape(2, 4, 32, "bfloat16", BLOCK)
    others = [
        kv_layout("other", TINY, block_layout=CPU, tp_rank=0, tp_size=1),
        kv_layout("tiny", TINY, block_layout=CPU, tp_rank=1, tp_size=2),
        kv_layout("tiny", fp16, block_layout=CPU, tp_rank=0, tp_size=1),
        kv_layout("tiny", heads, block_layout=CPU, tp_rank=0, tp_size=1),
    ]
    for layout in others:
        assert not set(chunk_keys(prompt, layout, CHUNK)) & set(base), layout


def test_keys_by_rank_gives_each_rank_its_own_chain() -> None:
    layouts = [kv_layout("tiny", TINY, block_layout=CPU, tp_rank=r, tp_size=2) for r in range(2)]
    keys = keys_by_rank(layouts, CHUNK)(tokens(600))
    assert len(keys) == 2 and all(len(k) == 2 and k[0] != k[1] for k in keys)
    assert [k[1] for k in keys] == chunk_keys(tokens(600), layouts[1], CHUNK)
    assert keys_by_rank(layouts, CHUNK)(tokens(255)) == []


def test_keys_do_not_depend_on_the_process_or_hash_seed() -> None:
    script = (
        "import json; from kvstack.cache.keys import chunk_keys; "
        "from kvstack.connector import AttentionShape, kv_layout; "
        "layout = kv_layout('tiny', AttentionShape(2, 2, 64, 'bfloat16', 128), "
        f"block_layout={CPU!r}, tp_rank=0, tp_size=1); "
        f"print(json.dumps([k.hex() for k in chunk_keys({tokens(600)}, layout, 256)]))"
    )
    seen = set()
    for seed in ("0", "12345"):
        out = subprocess.run(
            [sys.executable, "-c", script],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        seen.add(tuple(json.loads(out)))
    assert seen == {tuple(k.hex() for k in chunk_keys(tokens(600), LAYOUT, CHUNK))}


def test_importing_the_package_pulls_in_no_server_or_engine_dependencies() -> None:
    script = (
        "import sys, kvstack.connector; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & "
        "{'aiohttp', 'prometheus_client', 'torch', 'vllm', 'redis', 'uvloop', 'tokenizers', 'yaml'}))"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
