"""Stdlib HTTP client for the P/D harness: every call has a hard timeout and never raises on HTTP errors."""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

MODEL = "tiny"


@dataclass
class Result:
    ok: bool
    status: int  # HTTP status, 0 for connection errors / timeouts
    text: str
    error: str
    t_start: float
    t_end: float
    body: dict | None = None

    @property
    def elapsed(self) -> float:
        return self.t_end - self.t_start


def _request(url: str, payload: dict | None, timeout: float) -> tuple[int, bytes, str]:
    data = None if payload is None else json.dumps(payload).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read(), ""
    except urllib.error.HTTPError as e:
        return e.code, e.read(), f"HTTP {e.code}"  # an error without a body reads b""
    except Exception as e:  # noqa: BLE001 - connection refused/reset, timeouts: reported, not raised
        return 0, b"", f"{type(e).__name__}: {e}"


def healthy(url: str, timeout: float = 2.0) -> bool:
    status, _, _ = _request(f"{url}/health", None, timeout)
    return status == 200


def complete(url: str, prompt: str, max_tokens: int = 16, timeout: float = 60.0, **extra: object) -> Result:
    """Greedy completion (ignore_eos, so lengths are exact)."""
    payload = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
               "ignore_eos": True, **extra}  # fmt: skip
    t0 = time.time()
    status, raw, err = _request(f"{url}/v1/completions", payload, timeout)
    t1 = time.time()
    body = None
    text = ""
    if status == 200:
        try:
            body = json.loads(raw)
            text = body["choices"][0]["text"]
        except (ValueError, KeyError, IndexError) as e:
            return Result(False, status, "", f"bad body: {e}: {raw[:200]!r}", t0, t1)
    elif not err:
        err = raw[:200].decode(errors="replace")
    return Result(status == 200, status, text, err, t0, t1, body)


def complete_many(
    url: str, prompts: Sequence[str], max_tokens: int, timeout: float, workers: int | None = None
) -> list[Result]:
    """Concurrent completions; each thread has its own hard timeout, so this returns within ~timeout."""
    with ThreadPoolExecutor(max_workers=workers or len(prompts) or 1) as ex:
        futs = [ex.submit(complete, url, p, max_tokens, timeout) for p in prompts]
        return [f.result(timeout=timeout + 10) for f in futs]


def metrics_text(url: str, timeout: float = 5.0) -> str:
    status, raw, _ = _request(f"{url}/metrics", None, timeout)
    return raw.decode(errors="replace") if status == 200 else ""


_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def metric_sum(text: str, name: str) -> float:
    """Sum of all samples of `name` (any labels); counters also match with the `_total` suffix."""
    total = 0.0
    for line in text.splitlines():
        m = _LINE.match(line)
        if m and m.group(1) in (name, f"{name}_total"):
            try:
                total += float(m.group(3))
            except ValueError:
                pass
    return total


def metric(url: str, name: str, timeout: float = 5.0) -> float:
    return metric_sum(metrics_text(url, timeout), name)


class Blocker:
    """A long streamed completion sent straight to one server that occupies it until `release()`.

    With `--max-num-seqs 1` on D this is "D is slow": requests routed meanwhile wait in D's queue
    while P holds their KV under a lease. Closing the connection makes the server abort the request
    (vLLM cancels a request whose client disconnected), so the hold lasts exactly as long as the
    caller wants, whatever the machine's speed.
    """

    def __init__(self, url: str, prompt: str, max_tokens: int, max_s: float) -> None:
        u = urllib.parse.urlsplit(url)
        self._conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port, timeout=max_s)
        self.started = threading.Event()  # first token streamed: the server is running it
        self.finished_early = False  # the server completed it before release(): hold too short
        self.released = False
        self.error = ""
        self.tokens = 0
        self.t_start = time.time()
        payload = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                   "ignore_eos": True, "stream": True}  # fmt: skip
        self._thread = threading.Thread(target=self._run, args=(payload,), daemon=True)
        self._thread.start()

    def _run(self, payload: dict) -> None:
        try:
            self._conn.request(
                "POST", "/v1/completions", json.dumps(payload), {"Content-Type": "application/json"}
            )
            resp = self._conn.getresponse()
            if resp.status != 200:
                self.error = f"HTTP {resp.status}: {resp.read(200)!r}"
                return
            for raw in resp:
                line = raw.strip()
                if line == b"data: [DONE]":
                    self.finished_early = not self.released
                    return
                if line.startswith(b"data: "):
                    self.tokens += 1
                    self.started.set()
        except Exception as e:  # noqa: BLE001 - reset by release() or by a killed server: recorded
            if not self.released:
                self.error = f"{type(e).__name__}: {e}"

    def wait_started(self, timeout: float) -> bool:
        return self.started.wait(timeout)

    def release(self) -> None:
        """Disconnect: the server aborts the request and frees its slot."""
        self.released = True
        sock = self._conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._conn.close()
        self._thread.join(timeout=10)


class BlockerChain:
    """Blockers queued one behind the other on a server that runs one request at a
    time (``--max-num-seqs 1``), so the hold outlasts any one of them however fast
    the server decodes: when the first finishes the next starts, and requests
    routed meanwhile still wait behind it.  Same interface as ``Blocker``."""

    def __init__(self, blockers: list[Blocker]) -> None:
        self.blockers = blockers

    @property
    def queued(self) -> int:
        """Blockers waiting in the server's queue (they count as waiting requests)."""
        return sum(not b.started.is_set() and not b.released for b in self.blockers)

    @property
    def finished_early(self) -> bool:
        """Every blocker completed before ``release()``: the hold ended too soon."""
        return all(b.finished_early for b in self.blockers)

    @property
    def error(self) -> str:
        return next((b.error for b in self.blockers if b.error), "")

    @property
    def tokens(self) -> int:
        return sum(b.tokens for b in self.blockers)

    def wait_started(self, timeout: float) -> bool:
        return self.blockers[0].wait_started(timeout)

    def release(self) -> None:
        """Disconnect the queued blockers first, so the server never starts one of
        them after the running one is aborted."""
        for blocker in reversed(self.blockers):
            blocker.release()
