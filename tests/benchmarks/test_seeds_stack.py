"""benchmarks/seeds_stack.py's pure parts: its command line, the rows it plans, and the report's ratios and
targets (the scripts import their siblings by bare name, so benchmarks/ goes on the path)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from kvstack.scheduling.config import parse_config
from kvstack.scheduling.presets import preset_config

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _module(name: str) -> ModuleType:
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


def _run(
    stack: str, label: str, computed: float, p50: float, p90: float, shares: list[float]
) -> dict[str, Any]:
    summary = {
        "requests": 32,
        "ok": 31,
        "computed_share": computed,
        "local_hit_share": 0.5,
        "external_share": 0.5 - computed,
        "ttft_p50_s": p50,
        "ttft_p90_s": p90,
        "later_ttft_p50_s": p50 / 2,
        "preemptions": 0.0,
        "bench_engine_view": {"engines": [{"load_share": s} for s in shares]},
    }
    setup = {"label": label, "stack": stack}
    engines = [{"ttft_sum": 1.0, "ttft_count": 10.0}, {"ttft_sum": 3.0, "ttft_count": 10.0}]
    machine = {"machine_busy_pct": 97.0, "this_run_pct": 80.0}
    return {"setup": setup, "summary": summary, "engines": engines, "machine": machine}


def test_the_seeds_stack_needs_production_stack_source(capsys: pytest.CaptureFixture[str]) -> None:
    seeds = _module("seeds_stack")
    with pytest.raises(SystemExit):
        seeds.parse_args([])
    assert "--production-stack-src" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        seeds.parse_args(["--only", "kvstack,vllm-router"])
    assert "unknown stacks ['vllm-router']" in capsys.readouterr().err
    assert seeds.parse_args(["--only", "kvstack"]).stacks == ["kvstack"]


def test_plan_puts_both_stacks_first_then_each_lever() -> None:
    seeds = _module("seeds_stack")
    args = seeds.parse_args(["--production-stack-src", "/ps", "--levers", "--ceiling", "--blocks", "30"])
    setups = seeds.plan(args)
    assert [(s.label, s.stack, s.blocks, s.chunk) for s in setups] == [
        ("kvstack", "kvstack", 30, 128),
        ("seeds", "seeds", 30, 256),
        ("kvstack-no-tail", "kvstack", 30, 128),
        ("kvstack-chunk256", "kvstack", 30, 256),
        ("kvstack-session", "kvstack", 30, 128),
        ("kvstack-tier-weight", "kvstack", 30, 128),
        ("seeds-chunk128", "seeds", 30, 128),
        ("kvstack-spare-kv", "kvstack", 400, 128),
    ]
    assert [s.session_weight for s in setups] == [0, 0, 0, 0, 1, 0, 0, 0]
    assert [s.tier_weight for s in setups] == [None, None, None, None, None, 0.95, None, None]
    assert [dict(s.connector) for s in setups][2] == {"partial_tail": False}
    assert [
        s.label
        for s in seeds.plan(
            seeds.parse_args(["--only", "seeds", "--production-stack-src", "/ps", "--levers"])
        )
    ] == ["seeds", "seeds-chunk128"]


def test_compare_sets_every_kvstack_row_against_the_seeds_row() -> None:
    report = _module("seeds_stack_report")
    runs = [
        _run("kvstack", "kvstack", 0.20, 0.040, 0.200, [0.5, 0.5]),
        _run("seeds", "seeds", 0.25, 0.050, 0.400, [0.625, 0.375]),
        _run("kvstack", "kvstack-chunk256", 0.15, 0.030, 0.100, [0.5, 0.5]),
    ]
    first, lever = report.compare(runs)
    assert first["label"] == "kvstack"
    assert first["not_computed"] == pytest.approx(0.80)
    assert first["not_computed_ratio"] == pytest.approx(0.80 / 0.75)
    assert first["ttft_p50_ratio"] == pytest.approx(0.8)
    assert first["ttft_p90_ratio"] == pytest.approx(0.5)
    assert (first["not_computed_met"], first["ttft_met"]) == (False, True)
    assert (lever["not_computed_met"], lever["ttft_met"]) == (True, True)
    rows = report.rows(runs)
    assert rows[1][:3] == ["seeds", "31 / 1", "75.0%"]
    assert rows[1][9:12] == ["200", "62% / 38%", "-"]
    assert report.compare_rows([first])[0][5:] == ["not met (80.0%)", "met"]
    assert first["of_ceiling"] is None
    ceiling = report.compare([*runs, _run("kvstack", report.CEILING_LABEL, 0.1, 0.03, 0.1, [0.5, 0.5])])
    assert [c["of_ceiling"] for c in ceiling] == pytest.approx([0.8 / 0.9, 0.85 / 0.9, 1.0])


def test_without_a_seeds_row_the_ratios_and_the_ttft_target_are_unknown() -> None:
    report = _module("seeds_stack_report")
    (only,) = report.compare([_run("kvstack", "kvstack", 0.10, 0.040, 0.2, [1.0, 0.0])])
    assert only["not_computed_ratio"] is None and only["ttft_p50_ratio"] is None
    assert (only["not_computed_met"], only["ttft_met"]) == (True, None)
    assert report.compare_rows([only])[0][6] == "unknown"


def test_by_round_counts_computed_tokens_and_requests_over_a_block() -> None:
    report = _module("seeds_stack_report")
    rounds = report.by_round([(0, 1640, 1024), (0, 1640, 0), (1, 1700, 1664), (1, 1700, 1536), (1, 9, None)])
    assert rounds == [
        {"round": 0, "requests": 2, "prompt": 3280, "computed": 2256, "over_block": 2},
        {"round": 1, "requests": 2, "prompt": 3400, "computed": 200, "over_block": 1},
    ]
    run = {"setup": {"label": "seeds"}, "summary": {"by_round": rounds}}
    assert report.round_rows([run]) == [["seeds", "68.8% (2)", "5.9% (1)"]]


def test_the_session_lever_is_kv_aware_plus_session_affinity() -> None:
    stacks = _module("seeds_stack_stacks")
    config = parse_config(stacks.kv_aware_with(1), "<lever>")
    kv_aware = preset_config("kv-aware")
    (profile,) = config.profiles
    (base,) = kv_aware.profiles
    weights = {p.ref: p.weight for p in profile.plugins}
    assert weights.pop("session-affinity-scorer") == 1
    assert weights == {p.ref: p.weight for p in base.plugins}


def test_moves_count_rounds_served_by_another_engine_than_the_previous_round() -> None:
    report = _module("seeds_stack_report")
    served = [
        (0, 0, "A", 1640, 0),
        (0, 1, "A", 1700, 1536),  # stayed: 164 computed
        (0, 2, "B", 1750, 1536),  # moved: 214
        (1, 0, "B", 1640, 0),
        (1, 2, "A", 1750, 1700),  # round 1 failed: not counted
    ]
    m = report.moves(served)
    assert m == {"moved": 1, "later_rounds": 2, "computed_mean_moved": 214, "computed_mean_stayed": 164}
    assert report.move_cell({"moves": m}) == "1/2 (214 / 164)"
    assert report.moves([(0, 0, None, 1640, 0), (0, 1, None, 1700, 1536)]) is None


def test_production_stack_source_is_the_checkout_or_its_src(tmp_path: Path) -> None:
    stacks = _module("seeds_stack_stacks")
    (tmp_path / "src" / "vllm_router").mkdir(parents=True)
    (tmp_path / "src" / "vllm_router" / "requirements.txt").write_text("fastapi\n")
    assert stacks.production_stack_root(tmp_path) == tmp_path
    assert stacks.production_stack_root(tmp_path / "src") == tmp_path
    with pytest.raises(stacks.BenchError, match="archive HEAD src"):
        stacks.production_stack_root(tmp_path / "src" / "vllm_router")


def test_the_tier_weight_lever_sets_only_the_prefix_scorers_cpu_weight() -> None:
    stacks = _module("seeds_stack_stacks")
    config = parse_config(stacks.kv_aware_with(tier_weight=0.95), "<lever>")
    kv_aware = preset_config("kv-aware")
    params = {p.type: dict(p.parameters) for p in config.plugins}
    assert params.pop("precise-prefix-scorer") == {"cpuWeight": 0.95}
    base = {p.type: dict(p.parameters) for p in kv_aware.plugins}
    assert base.pop("precise-prefix-scorer") == {}
    assert params == base and config.profiles == kv_aware.profiles


def test_rows_keeps_only_the_named_rows_in_plan_order() -> None:
    seeds = _module("seeds_stack")
    argv = [
        "--production-stack-src",
        "/ps",
        "--levers",
        "--ceiling",
        "--rows",
        "kvstack-spare-kv,seeds,kvstack",
    ]
    assert [s.label for s in seeds.plan(seeds.parse_args(argv))] == ["kvstack", "seeds", "kvstack-spare-kv"]
    with pytest.raises(SystemExit, match="not planned"):
        seeds.plan(seeds.parse_args([*argv[:-1], "kvstack,nope"]))
