"""Offline model directories that real vLLM serves with ``--load-format dummy``.

`make_tiny_model(directory)` writes a Qwen2-architecture model with no weights and no network access:

- ``config.json``: `Qwen2ForCausalLM` in the shape of a `TinyShape` (default: 2 layers, hidden 256, 4 heads,
  2 KV heads, intermediate 512, vocab 4096); `SHAPES["qwen2-0.5b"]` has Qwen2-0.5B's layer shape, slow enough
  on CPU for prefill savings to be measurable.
- ``tokenizer.json``: a byte-level BPE with Qwen2's normaliser and pre-tokenizer, trained with the
  `tokenizers` library on a corpus generated in code, so two runs write byte-identical files; special tokens
  ``<|endoftext|>`` (0), ``<|im_start|>`` (1), ``<|im_end|>`` (2); no BOS is added.
- ``tokenizer_config.json``: ``PreTrainedTokenizerFast``, eos ``<|im_end|>``, pad ``<|endoftext|>``, and
  kvstack's ChatML template (the one `BuiltinTokenizer` renders, too).
- ``generation_config.json``: token ids only, so vLLM's default sampling (and greedy decoding) is left alone.

vLLM seeds dummy weights deterministically, so engines started from one directory compute identical KV caches.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from kvstack.engines.tokenizer import BUILTIN_WORDS, CHATML_TEMPLATE, ENDOFTEXT, IM_END, SPECIAL_TOKENS


@dataclass(frozen=True)
class TinyShape:
    """The architecture numbers of a dummy Qwen2 model."""

    num_hidden_layers: int = 2
    hidden_size: int = 256
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    intermediate_size: int = 512
    vocab_size: int = 4096
    max_position_embeddings: int = 4096

    @classmethod
    def qwen2_0_5b_like(cls) -> TinyShape:
        """Qwen2-0.5B's layer shape; the vocabulary stays small, dummy-weight output is meaningless anyway."""
        return cls(
            num_hidden_layers=24,
            hidden_size=896,
            num_attention_heads=14,
            num_key_value_heads=2,
            intermediate_size=4864,
        )


# transformers (v5) loads every model_type "qwen2" tokenizer as Qwen2Tokenizer, which swaps tokenizer.json's
# normaliser and pre-tokenizer for NFC and this split (letters with one leading non-letter, single digits,
# symbol runs with their newlines, whitespace). Training with the same pipeline keeps tokenizer.json and vLLM
# in agreement.
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|"
    r" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

SHAPES: dict[str, TinyShape] = {"tiny": TinyShape(), "qwen2-0.5b": TinyShape.qwen2_0_5b_like()}


def make_tiny_model(
    directory: Path, *, shape: TinyShape | None = None, model_name: str = "kvstack-tiny"
) -> Path:
    """Write a dummy-weight Qwen2 model directory (config, tokenizer, chat template) and return its path."""
    shape = shape or TinyShape()
    if shape.hidden_size % shape.num_attention_heads or shape.num_attention_heads % shape.num_key_value_heads:
        raise ValueError(
            f"{shape} does not divide evenly: hidden_size must be a multiple of num_attention_heads and "
            "num_attention_heads a multiple of num_key_value_heads"
        )
    tokenizer_json = _trained_tokenizer_json(shape.vocab_size)
    token_ids = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    _write_json(directory / "config.json", _model_config(shape, model_name, token_ids))
    _write_json(
        directory / "generation_config.json",
        {
            "bos_token_id": token_ids[ENDOFTEXT],
            "eos_token_id": token_ids[IM_END],
            "pad_token_id": token_ids[ENDOFTEXT],
        },
    )
    (directory / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    _write_json(directory / "tokenizer_config.json", _tokenizer_config(shape))
    return directory


def _write_json(path: Path, payload: dict[str, Any]) -> None:
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def _model_config(shape: TinyShape, model_name: str, token_ids: dict[str, int]) -> dict[str, Any]:
    return {
        **asdict(shape),
        "_name_or_path": model_name,
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "head_dim": shape.hidden_size // shape.num_attention_heads,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": shape.num_hidden_layers,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "bos_token_id": token_ids[ENDOFTEXT],
        "eos_token_id": token_ids[IM_END],
    }


def _tokenizer_config(shape: TinyShape) -> dict[str, Any]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "model_max_length": shape.max_position_embeddings,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "chat_template": CHATML_TEMPLATE,
    }


@lru_cache(maxsize=4)
def _trained_tokenizer_json(vocab_size: int) -> str:
    """A byte-level BPE with Qwen2's normaliser and pre-tokenizer and no BOS, trained on `_corpus()`."""
    if vocab_size < len(SPECIAL_TOKENS) + 256:
        raise ValueError(
            f"vocab_size {vocab_size} cannot hold the 256 byte tokens and {len(SPECIAL_TOKENS)} specials"
        )
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    # trim_offsets only touches offsets; ids come out with no special tokens added, as with Qwen.
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        show_progress=False,
        special_tokens=[AddedToken(token, special=True, normalized=False) for token in SPECIAL_TOKENS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    return tokenizer.to_str(pretty=True) + "\n"


# --- deterministic corpus -----------------------------------------------------------------------------------


class _SplitMix64:
    """A PRNG with a fixed algorithm: `random.Random`'s derived methods may change between Python versions."""

    def __init__(self, seed: int) -> None:
        self._state = seed & 0xFFFFFFFFFFFFFFFF

    def next(self) -> int:
        self._state = (self._state + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
        z = self._state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
        return z ^ (z >> 31)

    def below(self, n: int) -> int:
        return self.next() % n

    def skewed(self, n: int) -> int:
        """An index in [0, n) favouring small values, like word frequencies."""
        u = self.next() / 2**64
        return int(n * u * u * u)


_ONSETS = (*"bcdfghjklmnprstvwz", "br", "ch", "cl", "dr", "fl", "gr", "pl", "pr", "sh", "st", "th", "tr", "")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ea", "io", "ou", "y")
_CODAS = ("", "", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ck", "ng")
_PUNCTUATION = (".", ".", ".", ".", "?", "!", ";", ":")


def _pseudo_words(rng: _SplitMix64, count: int) -> list[str]:
    words: dict[str, None] = {}
    while len(words) < count:
        syllables = 1 + rng.below(3)
        word = "".join(
            _ONSETS[rng.below(len(_ONSETS))]
            + _VOWELS[rng.below(len(_VOWELS))]
            + _CODAS[rng.below(len(_CODAS))]
            for _ in range(syllables)
        )
        words.setdefault(word, None)
    return list(words)


def _corpus(paragraphs: int = 3000, seed: int = 20261202) -> Iterator[str]:
    """English-ish prose with numbers, code and JSON lines: the same text on every run and Python version."""
    rng = _SplitMix64(seed)
    lexicon = _pseudo_words(rng, 2500)

    def word() -> str:
        if rng.below(10) < 7:
            return BUILTIN_WORDS[rng.skewed(len(BUILTIN_WORDS))]
        return lexicon[rng.skewed(len(lexicon))]

    def sentence() -> str:
        words = [word() for _ in range(4 + rng.below(12))]
        if rng.below(5) == 0:
            words.insert(rng.below(len(words)), str(rng.below(10 ** (1 + rng.below(4)))))
        if rng.below(3) == 0:
            words[rng.below(len(words))] += ","
        return " ".join(words).capitalize() + _PUNCTUATION[rng.below(len(_PUNCTUATION))]

    for _ in range(paragraphs):
        kind = rng.below(10)
        if kind < 7:
            yield " ".join(sentence() for _ in range(2 + rng.below(5))) + "\n\n"
        elif kind == 7:
            name, arg = word(), word()
            yield f"def {name}_{word()}({arg}):\n    return {arg} + {rng.below(100)}\n\n"
        elif kind == 8:
            yield json.dumps({word(): word(), "id": rng.below(100000), "ok": rng.below(2) == 1}) + "\n"
        else:
            yield "".join(f"- {sentence()}\n" for _ in range(2 + rng.below(4))) + "\n"
