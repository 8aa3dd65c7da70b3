"""kvstack's Prometheus rules under promtool: both rule files load, their unit tests pass, and every alert
has a unit test case where it fires and one where it does not."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from support.prometheus import promtool

pytestmark = pytest.mark.prometheus

RULES = Path(__file__).resolve().parents[2] / "deploy" / "observability" / "rules"
RULE_FILES = [RULES / "kvstack-recording.yaml", RULES / "kvstack-alerts.yaml"]
UNIT_TESTS = sorted((RULES / "tests").glob("*.yaml"))


def _alerts() -> list[dict[str, Any]]:
    groups = yaml.safe_load(RULE_FILES[1].read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def _alert_checks() -> list[dict[str, Any]]:
    checks = []
    for path in UNIT_TESTS:
        for test in yaml.safe_load(path.read_text())["tests"]:
            checks += test.get("alert_rule_test", [])
    return checks


def test_promtool_accepts_both_rule_files() -> None:
    result = promtool("check", "rules", *RULE_FILES)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_pass() -> None:
    assert UNIT_TESTS, f"no promtool unit tests in {RULES / 'tests'}"
    result = promtool("test", "rules", *UNIT_TESTS)
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    checks = _alert_checks()
    firing = {c["alertname"] for c in checks if c.get("exp_alerts")}
    quiet = {c["alertname"] for c in checks if not c.get("exp_alerts")}
    names = {rule["alert"] for rule in _alerts()}
    assert names - firing == set(), "alerts no unit test sees firing"
    assert names - quiet == set(), "alerts no unit test sees quiet"
    assert (firing | quiet) - names == set(), "unit tests of alerts that do not exist"


def test_every_alert_says_how_bad_and_what_happened() -> None:
    for rule in _alerts():
        assert rule.get("for"), rule["alert"]
        assert rule["labels"]["severity"] in {"warning", "critical"}, rule["alert"]
        assert {"summary", "description"} <= set(rule["annotations"]), rule["alert"]
