"""`kvstack bench` workloads: seeded prompts and arrivals (multi-round QA, shared prefixes, long documents),
conversations that grow with the answers, and bounds."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable

import pytest

from kvstack.bench import BenchConfig, Conversation, LongDocQA, MultiRoundQA, SharedPrefix
from kvstack.bench.workloads import arrival_times


def _some(workload: MultiRoundQA | SharedPrefix | LongDocQA, n: int = 40) -> list[tuple[float, str]]:
    return [(t.arrival, t.text) for t in itertools.islice(workload.turns(), n)]


Make = Callable[[int], MultiRoundQA | SharedPrefix | LongDocQA]


@pytest.mark.parametrize(
    "make",
    [
        lambda seed: MultiRoundQA(
            num_users=4, num_rounds=3, system_prompt_len=30, user_history_len=20, seed=seed
        ),
        lambda seed: SharedPrefix(groups=3, prefix_len=20, suffix_len=5, zipf=1.1, seed=seed),
        lambda seed: LongDocQA(documents=3, document_len=50, questions_per_document=2, seed=seed),
    ],
    ids=["multi-round-qa", "shared-prefix", "long-doc-qa"],
)
def test_same_seed_same_prompts_and_arrivals_other_seed_differs(make: Make) -> None:
    first, again, other = _some(make(7)), _some(make(7)), _some(make(8))
    assert first == again
    assert [a for a, _ in first] != [a for a, _ in other]
    assert [t for _, t in first] != [t for _, t in other]


def test_arrival_processes() -> None:
    import random

    uniform = list(itertools.islice(arrival_times(4.0, "uniform", random.Random(0)), 5))
    assert uniform == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0])
    poisson = list(itertools.islice(arrival_times(10.0, "poisson", random.Random(0)), 4001))
    assert poisson[-1] / 4000 == pytest.approx(0.1, rel=0.1)
    assert len({round(b - a, 9) for a, b in itertools.pairwise(poisson)}) > 100  # not evenly spaced
    assert list(itertools.islice(arrival_times(0, "poisson", random.Random(0)), 3)) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="arrival"):
        next(arrival_times(1.0, "bursty", random.Random(0)))  # type: ignore[arg-type]  # unknown on purpose


def test_multi_round_users_start_staggered_and_round_zero_carries_the_context() -> None:
    wl = MultiRoundQA(num_users=3, num_rounds=2, system_prompt_len=12, user_history_len=10, question_len=4)
    turns = list(wl.turns())
    assert wl.size == len(turns) == 6
    assert [(t.session, t.round, t.last) for t in turns] == [
        (0, 0, False),
        (1, 0, False),
        (2, 0, False),
        (0, 1, True),
        (1, 1, True),
        (2, 1, True),
    ]
    assert [t.arrival for t in turns] == sorted(t.arrival for t in turns)
    system = wl.system_prompt()
    assert system is not None and len(system.split()) == 12
    first = [t for t in turns if t.round == 0]
    assert all(t.system == system for t in first)  # one system prompt shared by every user
    assert len({t.text.split("\n\n")[0] for t in first}) == 3  # each user has its own history
    assert all(len(t.text.split()) == 14 for t in first)  # history 10 words + question 4
    later = [t for t in turns if t.round == 1]
    assert all(t.system is None and len(t.text.split()) == 4 for t in later)


def test_conversation_grows_with_the_answers_received() -> None:
    conv = Conversation(system="be brief")
    conv.ask("history and first question")
    round1 = conv.prompt()
    conv.answer("the first answer")
    conv.ask("second question")
    round2 = conv.prompt()
    assert round2.startswith(round1 + "the first answer")  # a later prompt extends the earlier one
    assert conv.messages() == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "history and first question"},
        {"role": "assistant", "content": "the first answer"},
        {"role": "user", "content": "second question"},
    ]
    with pytest.raises(ValueError, match="no answer yet"):
        conv.ask("a third question before the second answer")
    conv.answer("")
    with pytest.raises(ValueError, match="no question"):
        conv.answer("unasked")


def test_shared_prefix_groups_uniform_and_zipf() -> None:
    def counts(wl: SharedPrefix, n: int = 4000) -> list[int]:
        c = Counter(t.group for t in itertools.islice(wl.turns(), n))
        return [c[g] for g in range(wl.groups)]

    uniform = counts(SharedPrefix(groups=4, prefix_len=5, suffix_len=2, qps=0))
    assert all(abs(c / 4000 - 0.25) < 0.03 for c in uniform)
    zipf = SharedPrefix(groups=4, prefix_len=5, suffix_len=2, zipf=1.2, qps=0)
    weights = zipf.group_weights()
    assert weights == sorted(weights, reverse=True) and weights[0] / weights[1] == pytest.approx(2**1.2)
    observed = counts(zipf)
    assert observed == sorted(observed, reverse=True)
    assert all(abs(c / 4000 - w) < 0.03 for c, w in zip(observed, weights, strict=True))
    # Requests of one group share its prefix exactly and differ in the suffix.
    same = [t.text for t in itertools.islice(zipf.turns(), 50) if t.group == 0][:2]
    assert same[0].split("\n\n")[0] == same[1].split("\n\n")[0] and same[0] != same[1]


def test_long_doc_questions_interleave_documents() -> None:
    wl = LongDocQA(documents=3, document_len=40, questions_per_document=2, question_len=3)
    turns = list(wl.turns())
    assert [t.group for t in turns] == [0, 1, 2, 0, 1, 2]
    docs = [t.text.split("\n\n")[0] for t in turns]
    assert docs[0] == docs[3] and docs[0] != docs[1] and len(docs[0].split()) == 40
    assert turns[0].text != turns[3].text  # another question on the same document


def test_endless_workload_needs_a_bound() -> None:
    config = BenchConfig(url="http://127.0.0.1:9", model="m", workload=SharedPrefix())
    with pytest.raises(ValueError, match="--max-requests"):
        config.validate()
    config.duration = 5.0
    assert config.validate().planned_requests is None
