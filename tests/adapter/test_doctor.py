"""``python -m vllm_nixl_lease doctor``."""

from __future__ import annotations

import io

import vllm_support  # noqa: F401  (sets VLLM_TARGET_DEVICE before vLLM loads)

from vllm_nixl_lease.__main__ import doctor, main
from vllm_nixl_lease.adapter import compat


def test_doctor_reports_supported_setup(monkeypatch) -> None:
    monkeypatch.setenv("VLLM_NIXL_LEASE", "1")
    out = io.StringIO()
    code = doctor(out)
    text = out.getvalue()
    assert f"vLLM: {compat.vllm_version()} (supported)" in text
    assert "NIXL: " in text and "lease core implementation: " in text
    assert "import hook: VLLM_NIXL_LEASE='1'" in text
    if "entry point: present" in text:
        assert code == 0 and text.rstrip().endswith("OK")
        assert "would apply" in text


def test_doctor_fails_on_unsupported_vllm(monkeypatch) -> None:
    monkeypatch.setattr(compat, "vllm_version", lambda: "0.30.2")
    out = io.StringIO()
    assert doctor(out) == 1
    assert "vLLM: 0.30.2 (UNSUPPORTED)" in out.getvalue()
    assert "UNSUPPORTED SETUP" in out.getvalue()


def test_main_dispatches(monkeypatch, capsys) -> None:
    monkeypatch.setattr(compat, "vllm_version", lambda: "0.30.2")
    assert main(["doctor"]) == 1
    assert "UNSUPPORTED SETUP" in capsys.readouterr().out
