"""Seeded, deterministic request workloads for KV-cache-aware routing experiments. Pure; no I/O.

A workload is a lazy sequence of ``Turn``s in planned-arrival order. A turn belongs to a *session*: the
runner sends the turns of one session in order, each only after the previous one's answer arrived, and
builds its prompt from the whole ``Conversation`` so far (a failed round stays in it with an empty answer,
so the session keeps its context). Single-request sessions have no such wait.

Text is made of words from the built-in tokenizer's word table, one word per token or close to it, so
``*_len`` parameters are token counts give or take a few, and a text tokenizes the same on every run.
The same seed gives the same texts and the same planned arrival times; a different seed differs.

Arrivals (every workload): ``qps`` requests per second in total, ``arrival="poisson"`` (exponential gaps)
or ``"uniform"`` (gaps of exactly ``1/qps``); ``qps <= 0`` plans every request at time 0 (the runner's
concurrency cap then sets the pace). Workloads: ``MultiRoundQA`` (multi-round chat over a shared system
prompt), ``SharedPrefix`` (independent requests over a few popular prefixes) and ``LongDocQA`` (questions
on long documents); each class says its shape and size.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Literal, Protocol

from kvstack.engines.tokenizer import BUILTIN_WORDS

__all__ = [
    "Conversation",
    "LongDocQA",
    "MultiRoundQA",
    "SharedPrefix",
    "Turn",
    "Workload",
    "arrival_times",
    "words",
]

Arrival = Literal["poisson", "uniform"]
# Words only (no digits, no punctuation): each is one token of the built-in tokenizer.
_WORDS: tuple[str, ...] = tuple(w for w in BUILTIN_WORDS if w.isalpha())


@dataclass(frozen=True, slots=True)
class Turn:
    """One request a workload plans."""

    index: int  # request number, in planned-arrival order
    arrival: float  # planned send time, seconds after the run starts
    session: int  # turns of one session are sent in order, each after the previous answer
    round: int  # 0-based position in its session
    last: bool  # the session has no further turns
    text: str  # the new user message (round 0: with the session's lead text before it)
    max_tokens: int
    system: str | None = None  # the system prompt, on round 0 only
    group: int | None = None  # shared-prefix group or document, for reports


@dataclass(slots=True)
class Conversation:
    """A session's messages so far: system prompt, then (user, assistant) pairs, the last answer pending."""

    system: str | None = None
    users: list[str] = field(default_factory=list)
    answers: list[str] = field(default_factory=list)

    def ask(self, text: str) -> None:
        """Start a round with user message ``text``."""
        if len(self.users) != len(self.answers):
            raise ValueError("the previous round has no answer yet")
        self.users.append(text)

    def answer(self, text: str) -> None:
        """The assistant's answer to the pending question."""
        if len(self.users) != len(self.answers) + 1:
            raise ValueError("no question is pending")
        self.answers.append(text)

    def messages(self) -> list[dict[str, str]]:
        """Chat messages for ``/v1/chat/completions``."""
        out = [{"role": "system", "content": self.system}] if self.system is not None else []
        for user, answer in itertools.zip_longest(self.users, self.answers):
            out.append({"role": "user", "content": user})
            if answer is not None:
                out.append({"role": "assistant", "content": answer})
        return out

    def prompt(self) -> str:
        """The conversation flattened for ``/v1/completions``; a later round extends an earlier prompt."""
        parts = [f"System: {self.system}\n\n"] if self.system is not None else []
        for user, answer in itertools.zip_longest(self.users, self.answers):
            parts.append(f"User: {user}\n\nAssistant:")
            if answer is not None:
                parts.append(f"{answer}\n\n")
        return "".join(parts)


class Workload(Protocol):
    """What the runner needs of a workload."""

    @property
    def name(self) -> str:
        """Workload kind, for reports."""
        ...

    @property
    def size(self) -> int | None:
        """Number of requests, or None when endless."""
        ...

    def turns(self) -> Iterator[Turn]:
        """The planned requests in arrival order (lazy)."""
        ...

    def describe(self) -> dict[str, object]:
        """Parameters, for reports."""
        ...


def words(rng: random.Random, n: int) -> str:
    """``n`` random words joined by spaces."""
    return " ".join(rng.choices(_WORDS, k=n))


def arrival_times(qps: float, arrival: Arrival, rng: random.Random) -> Iterator[float]:
    """Planned arrival times from 0: Poisson or evenly spaced at ``qps``; all 0 when ``qps <= 0``."""
    if arrival not in ("poisson", "uniform"):
        raise ValueError(f"arrival must be 'poisson' or 'uniform', not {arrival!r}")
    if qps <= 0:
        yield from itertools.repeat(0.0)
    elif arrival == "uniform":
        yield from (k / qps for k in itertools.count())  # k/qps, not a running sum: no drift
    else:
        yield from itertools.accumulate((rng.expovariate(qps) for _ in itertools.count()), initial=0.0)


def _rng(seed: int, *key: object) -> random.Random:
    # A string seed is hashed with SHA-512, so the stream is the same in every process.
    return random.Random(":".join(str(k) for k in (seed, *key)))


def _positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")


def _lead(lead: str, question: str) -> str:
    return f"{lead}\n\n{question}" if lead else question


@dataclass(frozen=True, kw_only=True)
class MultiRoundQA:
    """Users in multi-round conversations over a shared system prompt and their own history.

    production-stack's multi-round QA shape: ``num_users`` users each hold a conversation of ``num_rounds``
    rounds. Every user's first message carries a system prompt of ``system_prompt_len`` words shared by all
    users and a per-user history of ``user_history_len`` words, then a question of ``question_len`` words;
    later rounds add a question each, after the answers actually received. ``answer_len`` is ``max_tokens``.
    Arrival slot k goes to user ``k % num_users``, round ``k // num_users``, so users start staggered and each
    user's rounds are planned ``num_users`` slots apart; a round whose previous answer is late is sent when it
    arrives. Size: ``num_users * num_rounds``.
    """

    num_users: int = 10
    num_rounds: int = 5
    system_prompt_len: int = 1000  # words shared by all users
    user_history_len: int = 2000  # words of each user's own context, in the first message
    question_len: int = 20  # words per question
    answer_len: int = 100  # max_tokens per answer
    qps: float = 1.0
    arrival: Arrival = "poisson"
    seed: int = 0
    name: str = "multi-round-qa"

    def __post_init__(self) -> None:
        _positive(num_users=self.num_users, num_rounds=self.num_rounds, answer_len=self.answer_len)
        _positive(question_len=self.question_len)

    @property
    def size(self) -> int:
        return self.num_users * self.num_rounds

    def system_prompt(self) -> str | None:
        if self.system_prompt_len <= 0:
            return None
        return words(_rng(self.seed, "system"), self.system_prompt_len)

    def turns(self) -> Iterator[Turn]:
        system = self.system_prompt()
        times = arrival_times(self.qps, self.arrival, _rng(self.seed, "arrivals"))
        for k, t in zip(range(self.size), times, strict=False):
            user, rnd = k % self.num_users, k // self.num_users
            question = words(_rng(self.seed, "question", user, rnd), self.question_len)
            if rnd == 0:
                history = words(_rng(self.seed, "history", user), max(self.user_history_len, 0))
                text = _lead(history, question)
            else:
                text = question
            yield Turn(
                index=k,
                arrival=t,
                session=user,
                round=rnd,
                last=rnd == self.num_rounds - 1,
                text=text,
                max_tokens=self.answer_len,
                system=system if rnd == 0 else None,
            )

    def describe(self) -> dict[str, object]:
        return _describe(self)


@dataclass(frozen=True, kw_only=True)
class SharedPrefix:
    """Independent requests sharing one of ``groups`` prefixes, picked uniformly or by Zipf popularity.

    ``groups`` prefixes of ``prefix_len`` words; each request picks a group, uniformly or with Zipf weights
    ``1 / rank**zipf`` (group 0 the most popular) when ``zipf`` is set, and sends the group's prefix followed
    by a fresh ``suffix_len``-word suffix. Endless: bound the run.
    """

    groups: int = 8
    prefix_len: int = 1000  # words of each group's prefix
    suffix_len: int = 50  # fresh words after the prefix, per request
    zipf: float | None = None  # Zipf exponent s; None = uniform
    answer_len: int = 100
    qps: float = 1.0
    arrival: Arrival = "poisson"
    seed: int = 0
    name: str = "shared-prefix"

    def __post_init__(self) -> None:
        _positive(groups=self.groups, answer_len=self.answer_len)
        if self.zipf is not None and self.zipf <= 0:
            raise ValueError(f"zipf exponent must be positive, got {self.zipf}")

    @property
    def size(self) -> None:
        return None

    def group_weights(self) -> list[float]:
        """Probability of each group being picked."""
        raw = [1.0 if self.zipf is None else 1.0 / (g + 1) ** self.zipf for g in range(self.groups)]
        total = sum(raw)
        return [w / total for w in raw]

    def turns(self) -> Iterator[Turn]:
        prefixes = [words(_rng(self.seed, "prefix", g), max(self.prefix_len, 0)) for g in range(self.groups)]
        cum = list(itertools.accumulate(self.group_weights()))
        pick, suffix_rng = _rng(self.seed, "groups"), _rng(self.seed, "suffix")
        times = arrival_times(self.qps, self.arrival, _rng(self.seed, "arrivals"))
        for k, t in enumerate(times):
            g = pick.choices(range(self.groups), cum_weights=cum)[0]
            text = _lead(prefixes[g], words(suffix_rng, self.suffix_len))
            yield Turn(
                index=k,
                arrival=t,
                session=k,
                round=0,
                last=True,
                text=text,
                max_tokens=self.answer_len,
                group=g,
            )

    def describe(self) -> dict[str, object]:
        return _describe(self)


@dataclass(frozen=True, kw_only=True)
class LongDocQA:
    """Questions on long documents, interleaved across documents so repeats of one are far apart.

    ``documents`` documents of ``document_len`` words, ``questions_per_document`` questions each, asked in
    passes over all documents (document 0..D-1, then again), so the long prefix of one document recurs
    ``documents`` requests later: with a KV cache smaller than all documents together, LRU eviction makes
    every repeat a miss unless routing keeps documents apart. Size: ``documents * questions_per_document``.
    """

    documents: int = 8
    document_len: int = 10000  # words per document
    questions_per_document: int = 4
    question_len: int = 20
    answer_len: int = 100
    qps: float = 1.0
    arrival: Arrival = "poisson"
    seed: int = 0
    name: str = "long-doc-qa"

    def __post_init__(self) -> None:
        _positive(documents=self.documents, questions_per_document=self.questions_per_document)
        _positive(document_len=self.document_len, answer_len=self.answer_len)

    @property
    def size(self) -> int:
        return self.documents * self.questions_per_document

    def turns(self) -> Iterator[Turn]:
        docs = [words(_rng(self.seed, "document", d), self.document_len) for d in range(self.documents)]
        times = arrival_times(self.qps, self.arrival, _rng(self.seed, "arrivals"))
        for k, t in zip(range(self.size), times, strict=False):
            q, d = divmod(k, self.documents)
            question = words(_rng(self.seed, "question", d, q), self.question_len)
            yield Turn(
                index=k,
                arrival=t,
                session=k,
                round=0,
                last=True,
                text=_lead(docs[d], f"Question: {question}"),
                max_tokens=self.answer_len,
                group=d,
            )

    def describe(self) -> dict[str, object]:
        return _describe(self)


def _describe(workload: MultiRoundQA | SharedPrefix | LongDocQA) -> dict[str, object]:
    return {f: getattr(workload, f) for f in workload.__dataclass_fields__}
