"""``python -m vllm_nixl_lease doctor``."""

from __future__ import annotations

import io
from collections.abc import Callable
from importlib import metadata

import vllm_support  # noqa: F401  (sets VLLM_TARGET_DEVICE before vLLM loads)

from vllm_nixl_lease.__main__ import doctor, main
from vllm_nixl_lease.adapter import compat

OUR_ENTRY_POINT = metadata.EntryPoint(
    name="vllm_nixl_lease", value="vllm_nixl_lease.plugin:register", group="vllm.general_plugins"
)


def _entry_points(present: bool) -> Callable[..., metadata.EntryPoints]:
    """importlib.metadata.entry_points as if our plugin's entry point were (or were not) installed,
    so the verdict does not depend on how this tree was installed."""
    real = metadata.entry_points

    def entry_points(**select: str) -> metadata.EntryPoints:
        found = [ep for ep in real(**select) if ep.value != OUR_ENTRY_POINT.value]
        if present and select.get("group") == OUR_ENTRY_POINT.group:
            found.append(OUR_ENTRY_POINT)
        return metadata.EntryPoints(found)

    return entry_points


def test_doctor_reports_supported_setup(monkeypatch) -> None:
    monkeypatch.setenv("VLLM_NIXL_LEASE", "1")
    monkeypatch.setattr(metadata, "entry_points", _entry_points(present=True))
    out = io.StringIO()
    code = doctor(out)
    text = out.getvalue()
    assert f"vLLM: {compat.vllm_version()} (supported)" in text
    assert "NIXL: " in text and "lease core implementation: " in text
    assert "vllm.general_plugins entry point: present" in text
    assert "import hook: VLLM_NIXL_LEASE='1' -> would apply" in text
    assert code == 0 and text.rstrip().endswith("OK"), text


def test_doctor_fails_without_the_entry_point(monkeypatch) -> None:
    monkeypatch.setenv("VLLM_NIXL_LEASE", "1")
    monkeypatch.setattr(metadata, "entry_points", _entry_points(present=False))
    out = io.StringIO()
    assert doctor(out) == 1
    text = out.getvalue()
    assert "vllm.general_plugins entry point: MISSING" in text
    assert "import hook: VLLM_NIXL_LEASE='1' -> would not apply" in text
    assert "PROBLEM: VLLM_NIXL_LEASE is set but no entry point will apply it" in text
    assert text.rstrip().endswith("UNSUPPORTED SETUP")


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
