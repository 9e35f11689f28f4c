"""A real Prometheus server for the P/D harness (Debian's `prometheus` package), started and torn
down by PID, with the shipped alert rules loaded; plus the metric names the rules and dashboard use.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
import urllib.parse
from collections.abc import Iterable
from pathlib import Path

import yaml

from harness.procs import Managed, free_ports
from harness.serve import client

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "monitoring"
RULES = MONITORING / "alerts.yml"
DASHBOARD = MONITORING / "grafana-dashboard.json"
INSTALL_HINT = "`make system-deps` as root, or `sudo apt-get install -y prometheus` (Debian/Ubuntu)"

_NAME = re.compile(r"\bvllm:[a-zA-Z0-9_:]+")


def binary(name: str = "prometheus") -> str | None:
    return shutil.which(name)


def exprs() -> list[str]:
    """Every PromQL expression in the shipped alert rules and dashboard (panels and annotations)."""
    rules = yaml.safe_load(RULES.read_text())
    out = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    dash = json.loads(DASHBOARD.read_text())
    out += [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    out += [a["expr"] for a in dash.get("annotations", {}).get("list", []) if "expr" in a]
    out += [v["definition"] for v in dash.get("templating", {}).get("list", []) if v.get("definition")]
    return out


def metric_names() -> set[str]:
    """The `vllm:` series names the rules and dashboard query, as exposed (`_total`, `_bucket`)."""
    return {m for e in exprs() for m in _NAME.findall(e)}


def exposed_names(texts: Iterable[str]) -> set[str]:
    """Series names present in Prometheus text-format scrapes."""
    names = set()
    for text in texts:
        for line in text.splitlines():
            if line and not line.startswith("#"):
                names.add(re.split(r"[{\s]", line, maxsplit=1)[0])
    return names


class Prometheus:
    """`prometheus` scraping `targets` ({job: [host:port, ...]}) every second, evaluating RULES every
    second, with its data in a temporary directory removed on close."""

    def __init__(self, targets: dict[str, list[str]], log_dir: Path, scrape_s: float = 1.0) -> None:
        exe = binary()
        if exe is None:
            raise FileNotFoundError(f"prometheus not installed: {INSTALL_HINT}")
        self.data = Path(tempfile.mkdtemp(prefix="demo-prom-"))
        (self.port,) = free_ports(1)
        every = f"{round(scrape_s * 1000)}ms"
        cfg = self.data / "prometheus.yml"
        cfg.write_text(yaml.safe_dump({
            "global": {"scrape_interval": every, "scrape_timeout": every, "evaluation_interval": every},
            "rule_files": [str(RULES)],
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": hosts}]}
                               for job, hosts in targets.items()],
        }))  # fmt: skip
        argv = [exe, f"--config.file={cfg}", f"--storage.tsdb.path={self.data / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"]  # fmt: skip
        self.proc = Managed("prometheus", argv, {"PATH": "/usr/bin:/bin"}, log_dir / "prometheus.log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.proc.alive():
                raise RuntimeError(f"prometheus exited:\n{self.proc.log_tail()}")
            if client._request(f"{self.url}/-/ready", None, 2.0)[0] == 200:
                return
            time.sleep(0.3)
        raise TimeoutError(f"prometheus not ready in {timeout:.0f}s:\n{self.proc.log_tail()}")

    def _api(self, path: str, **params: object) -> dict:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        status, raw, err = client._request(url, None, 10.0)
        if status != 200:
            raise RuntimeError(f"prometheus {path} {params}: {err or raw[:200]!r}")
        return json.loads(raw)["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict]:
        return self._api("query", query=expr, **({"time": at} if at is not None else {}))["result"]

    def series(self, expr: str, start: float, end: float, step: float = 1.0) -> list[tuple[dict, list]]:
        """[(labels, [(t, value), ...]), ...] of a range query."""
        res = self._api("query_range", query=expr, start=start, end=end, step=step)["result"]
        return [(r["metric"], [(float(t), float(v)) for t, v in r["values"]]) for r in res]

    def rule_health(self) -> dict[str, str]:
        """Rule name -> "ok" / "err" / "unknown" (not evaluated yet), with the error if any."""
        groups = self._api("rules")["groups"]
        return {r["name"]: r["health"] + (f": {r['lastError']}" if r.get("lastError") else "")
                for g in groups for r in g["rules"]}  # fmt: skip

    def alert_onsets(self, start: float, end: float) -> list[tuple[float, dict]]:
        """(time, labels) each time an alert went to firing between `start` and `end`."""
        out = []
        for labels, values in self.series('ALERTS{alertstate="firing"}', start, end):
            prev = None
            for t, _v in values:
                if prev is None or t - prev > 1.5:  # absent at the previous step: a new onset
                    out.append((t, labels))
                prev = t
        return sorted(out, key=lambda x: x[0])

    def close(self) -> None:
        self.proc.stop(grace=3.0)
        shutil.rmtree(self.data, ignore_errors=True)

    def __enter__(self) -> Prometheus:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
