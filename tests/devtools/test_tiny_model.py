"""make_tiny_model: deterministic files, the config vLLM reads, a vocabulary that fits the embedding."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvstack.devtools.tiny_model import SHAPES, TinyShape, make_tiny_model
from kvstack.engines.tokenizer import CHATML_TEMPLATE, ENDOFTEXT, IM_END, IM_START, HFTokenizer

MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")

_DIGEST_SCRIPT = """
import hashlib, sys
from pathlib import Path
from kvstack.devtools.tiny_model import make_tiny_model
out = make_tiny_model(Path(sys.argv[1]))
for name in sys.argv[2:]:
    print(name, hashlib.sha256((out / name).read_bytes()).hexdigest())
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def _read(directory: Path, name: str) -> dict[str, object]:
    loaded = json.loads((directory / name).read_text("utf-8"))
    assert isinstance(loaded, dict)
    return loaded


def _digests(directory: Path) -> dict[str, str]:
    return {name: hashlib.sha256((directory / name).read_bytes()).hexdigest() for name in MODEL_FILES}


def test_writes_all_files_and_returns_directory(model_dir: Path) -> None:
    assert sorted(path.name for path in model_dir.iterdir()) == sorted(MODEL_FILES)


def test_two_processes_write_byte_identical_files(model_dir: Path, tmp_path: Path) -> None:
    # Separate interpreters with different hash seeds: training must not depend on set/dict order or Rust
    # HashMaps.
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run(
            [sys.executable, "-c", _DIGEST_SCRIPT, str(tmp_path / seed), *MODEL_FILES],
            env=env,
            capture_output=True,
            text=True,
            check=True,
            timeout=120,
        ).stdout
        digests = dict(line.split() for line in out.splitlines())
        assert digests == _digests(model_dir)


def test_rewriting_in_process_is_identical(model_dir: Path, tmp_path: Path) -> None:
    assert _digests(make_tiny_model(tmp_path / "again")) == _digests(model_dir)


def test_config_describes_a_small_qwen2(model_dir: Path) -> None:
    config = _read(model_dir, "config.json")
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["model_type"] == "qwen2"
    assert config["num_hidden_layers"] == 2
    assert config["hidden_size"] == 256
    assert config["num_attention_heads"] == 4
    assert config["num_key_value_heads"] == 2
    assert config["intermediate_size"] == 512
    assert config["vocab_size"] == 4096
    assert config["max_position_embeddings"] == 4096
    assert config["tie_word_embeddings"] is True
    assert config["torch_dtype"] == "bfloat16"
    assert config["head_dim"] == 64
    assert isinstance(config["rope_theta"], float)


def test_config_token_ids_match_the_tokenizer(model_dir: Path) -> None:
    config = _read(model_dir, "config.json")
    generation = _read(model_dir, "generation_config.json")
    tokenizer = HFTokenizer(model_dir)
    assert config["eos_token_id"] == tokenizer.eos_token_id == tokenizer.encode(IM_END)[0]
    assert config["bos_token_id"] == tokenizer.encode(ENDOFTEXT)[0]
    assert generation["eos_token_id"] == config["eos_token_id"]
    # Sampling defaults here would silently change vLLM's default (greedy-capable) sampling parameters.
    assert not {"temperature", "top_p", "top_k", "min_p", "repetition_penalty"} & generation.keys()


def test_tokenizer_config(model_dir: Path) -> None:
    config = _read(model_dir, "tokenizer_config.json")
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["eos_token"] == IM_END
    assert config["pad_token"] == ENDOFTEXT
    assert config["model_max_length"] == 4096
    assert config["chat_template"] == CHATML_TEMPLATE


def test_trained_vocabulary_fits_the_embedding(model_dir: Path) -> None:
    tokenizer_json = _read(model_dir, "tokenizer.json")
    model = tokenizer_json["model"]
    assert isinstance(model, dict)
    vocab = model["vocab"]
    added = tokenizer_json["added_tokens"]
    assert isinstance(vocab, dict) and isinstance(added, list)
    ids = set(vocab.values()) | {token["id"] for token in added}
    assert max(ids) < 4096
    assert HFTokenizer(model_dir).vocab_size <= 4096
    # The corpus is rich enough to fill the vocabulary, so prompts tokenize at a realistic rate.
    assert len(ids) == 4096


def test_special_tokens_are_single_ids_and_no_bos_is_added(model_dir: Path) -> None:
    tokenizer = HFTokenizer(model_dir)
    assert [tokenizer.encode(token) for token in (ENDOFTEXT, IM_START, IM_END)] == [[0], [1], [2]]
    assert tokenizer.encode("hello") == tokenizer.encode("hello", add_special_tokens=False)


def test_english_text_compresses(model_dir: Path) -> None:
    tokenizer = HFTokenizer(model_dir)
    text = "The model will find the answer in the cache before the engine starts a new request."
    assert len(tokenizer.encode(text)) < len(text.split()) * 2


def test_larger_shape_preset(tmp_path: Path) -> None:
    shape = SHAPES["qwen2-0.5b"]
    assert shape == TinyShape.qwen2_0_5b_like()
    config = _read(make_tiny_model(tmp_path, shape=shape, model_name="dummy-0.5b"), "config.json")
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (
        24,
        896,
        4864,
    )
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (14, 2, 64)
    assert config["_name_or_path"] == "dummy-0.5b"


def test_rejects_uneven_head_shapes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="multiple of num_attention_heads"):
        make_tiny_model(tmp_path, shape=TinyShape(hidden_size=250))
