"""deploy/image/Dockerfile, which no machine here can build: its base is a vLLM release the
adapters support, it installs the wheel `make dist` writes, and the build runs `doctor`."""

from __future__ import annotations

import re

from deploy_manifests import ROOT

from vllm_nixl_lease.adapter.compat import is_supported

DOCKERFILE = ROOT / "deploy" / "image" / "Dockerfile"


def _instructions() -> list[str]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n\s*", " ", DOCKERFILE.read_text())
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_the_default_base_is_a_supported_vllm_openai_image() -> None:
    lines = _instructions()
    (arg,) = [line for line in lines if line.startswith("ARG BASE_IMAGE=")]
    image, tag = arg.split("=", 1)[1].rsplit(":", 1)
    assert image == "vllm/vllm-openai"
    assert is_supported(tag), f"{tag} is not a vLLM release compat.py supports"
    assert lines[lines.index(arg) + 1] == "FROM ${BASE_IMAGE}"


def test_it_installs_the_dist_wheel_and_checks_it_with_doctor() -> None:
    run = " ".join(line for line in _instructions() if line.startswith("RUN "))
    assert any(line.startswith("COPY dist/ ") for line in _instructions())
    # `make dist` names the wheel after the distribution (PEP 427: dashes become underscores).
    assert re.search(r"pip install [^&]*/vllm_nixl_lease-\*\.whl", run), run
    assert run.rstrip().endswith("python3 -m vllm_nixl_lease doctor"), "doctor must be the build's last step"
