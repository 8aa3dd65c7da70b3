"""Metric catalogs and the exposition reader, on dumps taken from real simulator processes (current and
legacy vLLM names) and on hand-written SGLang, TensorRT-LLM and Triton samples."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstack.engines.catalog import CATALOGS, SIGNALS, Read, catalog_for, parse_version
from kvstack.engines.metrics_reader import MetricsParseError, read_signals
from kvstack.engines.state import LoadSignals
from support.engines import EngineProcess, start_sim

VLLM = catalog_for("vllm")
LEGACY_RENAMES = {
    "vllm:kv_cache_usage_perc": "vllm:gpu_cache_usage_perc",
    "vllm:prefix_cache_queries": "vllm:gpu_prefix_cache_queries",
    "vllm:prefix_cache_hits": "vllm:gpu_prefix_cache_hits",
}


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as r:
        return str(r.read().decode())


def _complete(engine: EngineProcess, prompt: str, max_tokens: int = 4) -> dict[str, object]:
    body = {"model": engine.model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
    req = urllib.request.Request(
        f"{engine.url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as r:
        return dict(json.loads(r.read()))


@pytest.fixture(scope="module")
def sim_dumps(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, tuple[str, int]]]:
    """/metrics of a current-names sim and a legacy-names sim after one identical completion, with the
    completion's prompt token count."""
    out: dict[str, tuple[str, int]] = {}
    for mode, extra in (("current", []), ("legacy", ["--legacy-metric-names"])):
        engine = start_sim(tmp_path_factory.mktemp(f"sim-{mode}"), replay=False, extra_args=extra)
        try:
            usage = _complete(engine, "The quick brown fox jumps over the lazy dog " * 4)["usage"]
            assert isinstance(usage, dict)
            out[mode] = (_get(f"{engine.url}/metrics"), int(usage["prompt_tokens"]))
        finally:
            engine.stop()
    yield out


# -- catalogs -------------------------------------------------------------------------------------------


def test_catalog_signals_are_the_load_signal_fields() -> None:
    assert tuple(f.name for f in dataclasses.fields(LoadSignals)) == SIGNALS
    for catalog in CATALOGS:
        for signal, src in catalog.sources().items():
            assert (src.read is Read.LABEL) == (src.label is not None), (catalog.engine_type, signal)


def test_catalog_for_picks_by_type_and_version() -> None:
    assert catalog_for("vllm") is catalog_for("vllm", "0.32.0")
    assert catalog_for("vllm", "0.10.0").kv_usage == VLLM.kv_usage
    assert catalog_for("vllm", "0.11.0rc1+cpu").since == "0.10"
    old = catalog_for("vllm", "0.9.1")
    assert old.until == "0.10" and old.kv_usage is not None
    assert old.kv_usage.name == "vllm:gpu_cache_usage_perc"
    assert VLLM.kv_usage is not None and VLLM.kv_usage.name == "vllm:kv_cache_usage_perc"
    assert [(a.name, a.renamed_in) for a in VLLM.kv_usage.aliases] == [("vllm:gpu_cache_usage_perc", "0.9.2")]
    assert set(LEGACY_RENAMES.values()) <= VLLM.known_names()
    assert not set(LEGACY_RENAMES.values()) & VLLM.expected_names()
    for engine_type in ("sglang", "trtllm", "triton"):
        assert catalog_for(engine_type, "1.2.3").engine_type == engine_type


def test_catalog_errors_say_what_is_known() -> None:
    with pytest.raises(ValueError, match=r"unknown engine type 'tgi'; known engine types: sglang, triton"):
        catalog_for("tgi", None)
    with pytest.raises(ValueError, match="cannot read engine version 'nightly'"):
        catalog_for("vllm", "nightly")


def test_parse_version() -> None:
    assert parse_version("0.10") == parse_version("0.10.0") == (0, 10)
    assert parse_version("v0.9.2.dev3+gabc") == (0, 9, 2)
    assert parse_version("0.9.2") < parse_version("0.10") < parse_version("0.10.1")


# -- real simulator dumps --------------------------------------------------------------------------------


def test_reads_a_real_sim_dump(sim_dumps: dict[str, tuple[str, int]]) -> None:
    text, prompt_tokens = sim_dumps["current"]
    r = read_signals(text, VLLM)
    s = r.signals
    assert (s.queue, s.running) == (0.0, 0.0)
    assert s.kv_usage is not None and 0.0 <= s.kv_usage <= 1.0
    assert s.prefix_cache_queries == prompt_tokens and s.prefix_cache_hits == 0.0
    assert (s.block_size, s.num_blocks) == (128, 64)
    assert r.missing == frozenset() and r.aliases_used == () and r.gaps == ()


def test_legacy_sim_dump_is_read_through_aliases_and_reported(sim_dumps: dict[str, tuple[str, int]]) -> None:
    current = read_signals(sim_dumps["current"][0], VLLM).signals
    r = read_signals(sim_dumps["legacy"][0], VLLM)
    assert r.signals == current  # same load, read under the old names
    assert r.missing == frozenset(LEGACY_RENAMES)
    assert dict(r.aliases_used) == LEGACY_RENAMES
    messages = {g.message("http://10.0.0.5:8000", "vllm") for g in r.gaps}
    assert (
        "engine http://10.0.0.5:8000 exports no vllm:kv_cache_usage_perc "
        "(found legacy vllm:gpu_cache_usage_perc, renamed in vllm 0.9.2; using it)"
    ) in messages


def test_old_vllm_catalog_expects_the_old_names(sim_dumps: dict[str, tuple[str, int]]) -> None:
    old = catalog_for("vllm", "0.9.1")
    assert read_signals(sim_dumps["legacy"][0], old).missing == frozenset()
    # A newer engine read with the old catalog: the renamed signals are unknown, never 0.
    r = read_signals(sim_dumps["current"][0], old)
    assert r.signals.kv_usage is None and r.signals.prefix_cache_queries is None
    assert r.signals.queue == 0.0
    assert r.aliases_used == ()
    messages = {g.message("http://e:1", "vllm") for g in r.gaps}
    assert "engine http://e:1 exports no vllm:gpu_cache_usage_perc and no known alias; KV usage unknown" in (
        messages
    )


def test_a_missing_name_is_none_not_zero(sim_dumps: dict[str, tuple[str, int]]) -> None:
    text = "\n".join(
        line for line in sim_dumps["current"][0].splitlines() if "vllm:num_requests_waiting{" not in line
    )
    r = read_signals(text, VLLM)
    assert r.signals.queue is None
    assert r.signals.running == 0.0
    assert r.missing == {"vllm:num_requests_waiting"}
    (gap,) = r.gaps
    assert gap.message("http://e:1", "vllm") == (
        "engine http://e:1 exports no vllm:num_requests_waiting and no known alias; queue length unknown"
    )


@pytest.mark.slow
def test_queue_and_running_from_a_loaded_sim(tmp_path: Path) -> None:
    # One sequence at a time and slow decoding: one request runs while two wait.
    engine = start_sim(
        tmp_path,
        replay=False,
        extra_args=["--max-num-seqs", "1", "--decode-base", "0.05", "--no-kv-events"],
    )
    try:
        threads = [
            threading.Thread(target=_complete, args=(engine, f"request {i} " * 20, 60), daemon=True)
            for i in range(3)
        ]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        seen = LoadSignals()
        while time.monotonic() < deadline:
            seen = read_signals(_get(f"{engine.url}/metrics"), VLLM).signals
            if (seen.running, seen.queue) == (1.0, 2.0):
                break
            time.sleep(0.05)
        assert (seen.running, seen.queue) == (1.0, 2.0)
        assert seen.kv_usage is not None and seen.kv_usage > 0.0
    finally:
        engine.stop()


# -- hand-written samples ----------------------------------------------------------------------------------

VLLM_TWO_RANKS = """\
# HELP vllm:num_requests_waiting Requests waiting to be scheduled.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="llama"} 3.0
vllm:num_requests_waiting{engine="1",model_name="llama"} 4.0
vllm:num_requests_waiting{engine="0",model_name="llama-lora"} 1.0
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="llama"} 8.0
vllm:num_requests_running{engine="1",model_name="llama"} 7.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="llama"} 0.5
vllm:kv_cache_usage_perc{engine="1",model_name="llama"} 0.25
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="llama"} 1000.0
vllm:prefix_cache_queries_created{engine="0",model_name="llama"} 1.7e9
vllm:prefix_cache_queries_total{engine="1",model_name="llama"} 500.0
vllm:prefix_cache_queries_created{engine="1",model_name="llama"} 1.7e9
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="llama"} 600.0
vllm:prefix_cache_hits_total{engine="1",model_name="llama"} 100.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1000"} 1.0
vllm:cache_config_info{block_size="16",engine="1",num_gpu_blocks="1200"} 1.0
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="llama"} 2.0
"""


def test_vllm_series_of_several_models_and_ranks_are_combined() -> None:
    s = read_signals(VLLM_TWO_RANKS, VLLM).signals
    assert s == LoadSignals(
        queue=8.0,
        running=15.0,
        kv_usage=0.375,  # a ratio: averaged over ranks, not summed
        prefix_cache_queries=1500.0,
        prefix_cache_hits=700.0,
        block_size=16,
        num_blocks=2200,
    )


SGLANG = """\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="qwen",engine_type="unified",tp_rank="0",pp_rank="0"} 12.0
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="qwen",engine_type="unified",tp_rank="0",pp_rank="0"} 5.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="qwen",engine_type="unified",tp_rank="0",pp_rank="0"} 0.62
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{model_name="qwen",engine_type="unified",tp_rank="0",pp_rank="0"} 0.4
# HELP sglang:cache_config_info Cache configuration.
# TYPE sglang:cache_config_info gauge
sglang:cache_config_info{num_pages="40000",page_size="1"} 1.0
"""

TRTLLM = """\
# TYPE trtllm_num_requests_waiting gauge
trtllm_num_requests_waiting{engine_type="pytorch",model_name="m"} 2.0
# TYPE trtllm_num_requests_running gauge
trtllm_num_requests_running{engine_type="pytorch",model_name="m"} 6.0
# TYPE trtllm_kv_cache_utilization gauge
trtllm_kv_cache_utilization{engine_type="pytorch",model_name="m"} 0.3
# TYPE trtllm_kv_cache_tokens_per_block gauge
trtllm_kv_cache_tokens_per_block{engine_type="pytorch",model_name="m",pid="1"} 32.0
# TYPE trtllm_kv_cache_max_blocks gauge
trtllm_kv_cache_max_blocks{engine_type="pytorch",model_name="m"} 62762.0
# TYPE trtllm_kv_cache_missed_blocks_total counter
trtllm_kv_cache_missed_blocks_total{engine_type="pytorch",model_name="m"} 50.0
"""

TRITON = """\
# HELP nv_inference_pending_request_count Instantaneous number of pending requests awaiting execution.
# TYPE nv_inference_pending_request_count gauge
nv_inference_pending_request_count{model="ensemble",version="1"} 3
nv_inference_pending_request_count{model="preprocessing",version="1"} 1
# HELP nv_inference_exec_count Number of model executions performed (does not include cached requests)
# TYPE nv_inference_exec_count counter
nv_inference_exec_count{model="ensemble",version="1"} 1234
"""


def test_sglang_sample() -> None:
    r = read_signals(SGLANG, catalog_for("sglang"))
    assert r.signals == LoadSignals(queue=5.0, running=12.0, kv_usage=0.62, block_size=1, num_blocks=40000)
    assert r.missing == frozenset()


def test_trtllm_sample() -> None:
    r = read_signals(TRTLLM, catalog_for("trtllm"))
    assert r.signals == LoadSignals(queue=2.0, running=6.0, kv_usage=0.3, block_size=32, num_blocks=62762)
    assert r.missing == frozenset()


def test_triton_sample() -> None:
    r = read_signals(TRITON, catalog_for("triton"))
    # Triton exports no running gauge: unknown, and not reported missing since the catalog expects none.
    assert r.signals == LoadSignals(queue=4.0)
    assert r.missing == frozenset()


def test_an_engine_of_another_type_reads_as_unknown_everywhere() -> None:
    r = read_signals(SGLANG, VLLM)
    assert r.signals == LoadSignals()
    assert r.missing == VLLM.expected_names()
    (info_gap,) = [g for g in r.gaps if g.metric == "vllm:cache_config_info"]
    assert info_gap.signals == ("block_size", "num_blocks")
    assert info_gap.message("http://e:1", "vllm").endswith("; block size and KV block count unknown")


def test_counter_without_total_suffix_and_untyped_lines() -> None:
    text = "vllm:prefix_cache_queries 40\nvllm:prefix_cache_hits_total 10\nvllm:num_requests_waiting 2\n"
    s = read_signals(text, VLLM).signals
    assert (s.prefix_cache_queries, s.prefix_cache_hits, s.queue) == (40.0, 10.0, 2.0)


def test_info_gauge_without_the_label() -> None:
    text = 'vllm:cache_config_info{block_size="16",engine="0"} 1.0\n'
    r = read_signals(text, VLLM)
    assert (r.signals.block_size, r.signals.num_blocks) == (16, None)
    assert "vllm:cache_config_info{num_gpu_blocks}" in r.missing
    assert "vllm:cache_config_info" not in r.missing
    (gap,) = [g for g in r.gaps if g.label]
    assert gap.message("http://e:1", "vllm") == (
        "engine http://e:1 exports vllm:cache_config_info without label num_gpu_blocks; "
        "KV block count unknown"
    )


def test_non_finite_values_are_unknown() -> None:
    text = "vllm:kv_cache_usage_perc NaN\nvllm:num_requests_waiting +Inf\nvllm:num_requests_running 1\n"
    r = read_signals(text, VLLM)
    assert (r.signals.kv_usage, r.signals.queue, r.signals.running) == (None, None, 1.0)
    assert "vllm:kv_cache_usage_perc" not in r.missing  # exported, just not a number


# -- malformed input ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("<html><body><h1>502 Bad Gateway</h1></body></html>\n", "line 1"),
        ("# TYPE x gauge\nx 1\n\x00\x01\x02garbage\n", "line 3"),
        ('vllm:num_requests_waiting{model_name="m" 3\n', "line 1"),
        ("vllm:num_requests_waiting three\n", "line 1"),
        ("vllm:num_requests_running 1\nvllm:cache_config_info{block_size=16} 1\n", "line 2"),
        ('vllm:num_requests_waiting{a="1" b="2"} 3\n', "line 1"),  # no comma between labels
        ('vllm:num_requests_waiting{a="1",a="2"} 3\n', "line 1"),  # a label twice
        ("vllm:num_requests_waiting{,} 3\n", "line 1"),
        ('vllm:num_requests_waiting{a="x\ny"} 3\n', "line 1"),  # a raw newline ends the line inside a value
        ("vllm:num_requests_waiting 1_000\n", "line 1"),  # float() would take it
        ("vllm:num_requests_waiting\n", "line 1"),  # no value
        ("vllm:num_requests_waiting 1 2 3\n", "line 1"),  # more than a timestamp
        ("vllm:num_requests_waiting 1 1.5\n", "line 1"),  # a timestamp is an integer
        ("vllm:num_requests_waiting} 1\n", "line 1"),
    ],
)
def test_malformed_text_raises_a_typed_error(text: str, where: str) -> None:
    with pytest.raises(MetricsParseError, match=where):
        read_signals(text, VLLM)


def _random_sample_line(rng: random.Random) -> tuple[str, dict[str, str], float]:
    """A valid exposition line for vllm:num_requests_waiting, written with the format's latitude (blanks,
    escapes, a trailing comma, a timestamp), and the labels and value it stands for."""
    labels: dict[str, str] = {}
    for _ in range(rng.randint(0, 4)):
        key = rng.choice("abcxyz") + "".join(rng.choice("abc019_") for _ in range(rng.randint(0, 6)))
        labels[key] = "".join(rng.choice('ab ,}={"\\\nλ😀') for _ in range(rng.randint(0, 8)))
    blank = lambda: rng.choice(["", " ", "\t", "  "])  # noqa: E731
    esc = {"\\": "\\\\", '"': '\\"', "\n": "\\n"}
    pairs = [
        f'{blank()}{k}{blank()}={blank()}"{"".join(esc.get(c, c) for c in v)}"{blank()}'
        for k, v in labels.items()
    ]
    label_text = ""
    if labels or rng.random() < 0.2:
        label_text = "{" + ",".join(pairs) + ("," if pairs and rng.random() < 0.3 else "") + blank() + "}"
    value_text, value = rng.choice(
        [
            ("3", 3.0),
            ("-2.5", -2.5),
            ("1e3", 1000.0),
            ("1.5E-2", 0.015),
            ("+Inf", math.inf),
            ("-Inf", -math.inf),
            ("0", 0.0),
            (".5", 0.5),
            ("7.", 7.0),
            (str(rng.random() * 1e6), 0.0),
        ]
    )
    if value == 0.0 and value_text != "0":
        value = float(value_text)
    sep = rng.choice([" ", "\t", "   "]) if not label_text or rng.random() < 0.8 else ""
    stamp = f"{rng.choice([' ', chr(9)])}{rng.randint(-5, 10**13)}" if rng.random() < 0.3 else ""
    return f"vllm:num_requests_waiting{label_text}{sep}{value_text}{stamp}{blank()}", labels, value


def test_sample_lines_read_as_prometheus_client_reads_them() -> None:
    """kvstack reads sample lines with its own small parser; on 2,000 random valid lines it agrees with
    prometheus_client's parser, the reference, on labels and value."""
    from prometheus_client.parser import text_string_to_metric_families

    from kvstack.engines.metrics_reader import _parse

    rng = random.Random(11)
    for _ in range(2000):
        line, labels, value = _random_sample_line(rng)
        (ours,) = _parse(line + "\n", frozenset({"vllm:num_requests_waiting"}))["vllm:num_requests_waiting"]
        (family,) = text_string_to_metric_families(line + "\n")
        (reference,) = family.samples
        assert ours.labels == reference.labels == labels, line
        assert ours.value == reference.value == value, line


def test_empty_body_is_all_missing_not_an_error() -> None:
    r = read_signals("", VLLM)
    assert r.signals == LoadSignals() and r.missing == VLLM.expected_names()


def test_line_endings_indents_and_longer_names() -> None:
    text = (
        "# HELP x\r\n"
        "vllm:num_requests_running_by_lora 50\r\n"  # starts with a catalog name, is another metric
        '  \tvllm:num_requests_running{model_name="m"} 3 1700000000000\r\n'
        "\r\n"
        "vllm:num_requests_waiting\t2\t\r\n"
    )
    s = read_signals(text, VLLM).signals
    assert (s.running, s.queue) == (3.0, 2.0)
    # The line number of a bad line counts every line before it, skipped or read.
    lines = ["vllm:num_requests_running 1", "# c", "", 'x_bucket{le="1"} 2'] * 50
    with pytest.raises(MetricsParseError, match=r"^line 202 is not"):
        read_signals("\n".join([*lines, "  ", "<html>"]), VLLM)
    with pytest.raises(MetricsParseError, match=r"^line 201: "):
        read_signals("\n".join([*lines, "vllm:num_requests_waiting x"]), VLLM)


def test_lines_the_catalog_does_not_read_are_only_checked_for_a_name() -> None:
    # A bad line of an unrelated histogram does not cost the load signals.
    text = 'vllm:e2e_request_latency_seconds_bucket{le="1.0" 3\nvllm:num_requests_waiting 2\n'
    assert read_signals(text, VLLM).signals.queue == 2.0


def test_mutated_dumps_never_crash(sim_dumps: dict[str, tuple[str, int]]) -> None:
    """Random byte edits of a real dump give a reading or MetricsParseError, nothing else."""
    base = sim_dumps["current"][0].encode()
    rng = random.Random(7)
    for _ in range(300):
        data = bytearray(base)
        for _ in range(rng.randint(1, 20)):
            pos = rng.randrange(len(data))
            data[pos : pos + rng.randint(0, 3)] = bytes(rng.randrange(256) for _ in range(rng.randint(0, 3)))
        text = data.decode("utf-8", errors="replace")
        try:
            r = read_signals(text, VLLM)
        except MetricsParseError:
            continue
        for value in dataclasses.astuple(r.signals):
            assert value is None or math.isfinite(value)


@pytest.mark.vllm
def test_reads_real_vllm(vllm_engine: EngineProcess) -> None:
    """The catalog against vLLM 0.32 itself: every expected name exported, nothing read as a default."""
    _complete(vllm_engine, "The quick brown fox jumps over the lazy dog")
    r = read_signals(_get(f"{vllm_engine.url}/metrics"), catalog_for("vllm", "0.32.0"))
    assert r.missing == frozenset() and r.aliases_used == ()
    s = r.signals
    assert (s.queue, s.running) == (0.0, 0.0)
    assert s.kv_usage is not None and 0.0 <= s.kv_usage <= 1.0
    assert s.prefix_cache_queries is not None and s.prefix_cache_queries > 0
    assert s.prefix_cache_hits is not None
    assert (s.block_size, s.num_blocks) == (vllm_engine.block_size, 64)
