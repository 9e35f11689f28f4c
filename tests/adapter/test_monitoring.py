"""The shipped Prometheus alert rules pass `promtool check` and their unit tests; the dashboard's
queries name only metrics we or vLLM export (presence on a live scrape: tests/e2e/test_pd_fencing.py)."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from harness.serve import prom

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason=f"promtool missing (Debian's prometheus package): {prom.INSTALL_HINT}"
)


def _promtool(*args: str) -> str:
    assert PROMTOOL is not None
    proc = subprocess.run([PROMTOOL, *args], cwd=prom.MONITORING, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@needs_promtool
def test_rules_are_valid() -> None:
    assert "SUCCESS" in _promtool("check", "rules", "alerts.yml")


@needs_promtool
def test_rule_unit_tests_pass() -> None:
    assert "SUCCESS" in _promtool("test", "rules", "alerts_test.yml")


@needs_promtool
def test_every_rule_has_a_unit_test() -> None:
    import yaml

    rules = yaml.safe_load(prom.RULES.read_text())
    names = {r["alert"] for g in rules["groups"] for r in g["rules"]}
    tests = yaml.safe_load((prom.MONITORING / "alerts_test.yml").read_text())
    tested = {
        a["alertname"] for t in tests["tests"] for a in t.get("alert_rule_test", []) if a.get("exp_alerts")
    }
    assert names == tested, f"rules without a firing unit test: {sorted(names - tested)}"


def test_dashboard_queries_name_lease_metrics() -> None:
    dash = json.loads(prom.DASHBOARD.read_text())
    assert dash["panels"] and all(p["targets"] for p in dash["panels"])
    names = prom.metric_names()
    assert "vllm:nixl_lease_active" in names and "vllm:nixl_lease_reads_fenced_total" in names
    assert all(n.startswith("vllm:") for n in names)


def test_exposed_names_reads_the_text_format() -> None:
    text = (
        "# HELP vllm:nixl_lease_active x\n# TYPE vllm:nixl_lease_active gauge\n"
        'vllm:nixl_lease_active{engine="0",model_name="tiny"} 3.0\n'
        "vllm:nixl_lease_granted_total 7\n"
    )
    assert prom.exposed_names([text, ""]) == {"vllm:nixl_lease_active", "vllm:nixl_lease_granted_total"}
