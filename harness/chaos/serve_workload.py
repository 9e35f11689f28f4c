"""The serve lane's workload: routed completions through `vllm-router`, each
answer compared with what P alone answers to the same prompt.

- Prompts: a seeded set of sentence mixes, each several KV blocks long.
- References: P alone (greedy, the routed ``max_tokens``), asked before the faults.
- Stream: requests at seeded exponential gaps, each from its own thread with a
  client timeout; at most ``MAX_IN_FLIGHT`` at once (a wedged fleet does not
  pile up threads); bursts of ``burst_size`` concurrent requests now and then.
- Probes (after the final heal): one routed request at a time, attributed to
  the D whose finished-request counter moved.

History: ``routed`` (id, prompt, burst, probe) when sent and ``answer`` (id,
status, equal, error, elapsed_s, d for probes) when it returns.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections.abc import Callable

from harness.serve import client
from harness.serve.assets import _SENTENCES

from .history import History

MAX_TOKENS = 8
CLIENT_TIMEOUT_S = 60.0
MAX_IN_FLIGHT = 12
D_FINISHED = "vllm:request_success"  # D's counter of finished requests: which D served a probe


def prompts(seed: int, n: int = 16) -> list[str]:
    """``n`` distinct prompts of 6 to 9 sentences (over 3 KV blocks of 32 tokens each)."""
    rng = random.Random(seed)
    out: list[str] = []
    while len(out) < n:
        text = " ".join(rng.choice(_SENTENCES) for _ in range(rng.randint(6, 9)))
        if text not in out:
            out.append(text)
    return out


def references(p_url: str, texts: list[str]) -> list[str]:
    """P alone's answer to each prompt (greedy, ``MAX_TOKENS``)."""
    out = []
    for text in texts:
        r = client.complete(p_url, text, MAX_TOKENS, timeout=CLIENT_TIMEOUT_S)
        if not r.ok:
            raise RuntimeError(f"P alone failed: {r.error}")
        out.append(r.text)
    return out


class ServeWorkload:
    def __init__(
        self, hist: History, router_url: str, texts: list[str], refs: list[str], seed: int, rate: float
    ) -> None:
        self.hist, self.url, self.texts, self.refs = hist, router_url, texts, refs
        self.rng = random.Random(seed ^ 0x5E7E)
        self.rate = rate
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._slots = threading.BoundedSemaphore(MAX_IN_FLIGHT)
        self._threads: list[threading.Thread] = []
        self.skipped = 0  # sends dropped because MAX_IN_FLIGHT were outstanding

    def _one(
        self, burst: bool = False, probe: bool = False, d_urls: dict[str, str] | None = None
    ) -> tuple[bool, str | None]:
        """One routed request, recorded: (answered 200 with P alone's text, the D that
        served it when ``d_urls`` are given)."""
        rid = f"s{next(self._ids)}"
        k = self.rng.randrange(len(self.texts))
        before = {d: _finished(u) for d, u in (d_urls or {}).items()}
        self.hist.add("routed", id=rid, prompt=k, burst=burst, probe=probe)
        r = client.complete(self.url, self.texts[k], MAX_TOKENS, timeout=CLIENT_TIMEOUT_S)
        equal = r.ok and r.text == self.refs[k]
        d = _which(before, d_urls) if d_urls else None
        self.hist.add(
            "answer", id=rid, status=r.status, equal=equal, error=r.error[:160],
            elapsed_s=round(r.elapsed, 3), d=d,
        )  # fmt: skip
        return equal, d

    def _spawn(self, job: Callable[[], object]) -> None:
        """Run ``job`` on its own thread, unless ``MAX_IN_FLIGHT`` are outstanding (counted)."""
        if not self._slots.acquire(blocking=False):
            self.skipped += 1
            return

        def run() -> None:
            try:
                job()
            finally:
                self._slots.release()

        t = threading.Thread(target=run, daemon=True)
        self._threads.append(t)
        t.start()

    def _stream(self, bursts: list[float], burst_size: int) -> None:
        t0 = time.monotonic()
        todo = sorted(bursts)
        while not self._stop.wait(self.rng.expovariate(self.rate)):
            if todo and time.monotonic() - t0 >= todo[0]:
                todo.pop(0)
                self.hist.add("burst", n=burst_size, span_s=1.0)
                for _ in range(burst_size):
                    self._spawn(lambda: self._one(burst=True))
            self._spawn(self._one)

    def start(self, bursts: list[float], burst_size: int) -> None:
        t = threading.Thread(target=self._stream, args=(bursts, burst_size), name="serve-stream", daemon=True)
        self._threads.append(t)
        t.start()

    def stop(self, wait_s: float = CLIENT_TIMEOUT_S + 5) -> None:
        """Stop sending; wait for the requests in flight (each ends by its client timeout)."""
        self._stop.set()
        deadline = time.monotonic() + wait_s
        for t in self._threads:
            t.join(max(0.1, deadline - time.monotonic()))

    def probe(self, d_urls: dict[str, str], limit_s: float) -> dict[str, float]:
        """Routed probes, one at a time, until every D in ``d_urls`` (name -> URL)
        served one correctly or ``limit_s`` passed; D -> seconds until it did."""
        t0 = time.monotonic()
        done: dict[str, float] = {}
        while len(done) < len(d_urls) and time.monotonic() - t0 < limit_s:
            equal, d = self._one(probe=True, d_urls=d_urls)
            if equal and d is not None:
                done.setdefault(d, time.monotonic() - t0)
            elif not equal:
                time.sleep(1.0)
        return done


def _finished(url: str) -> float:
    return client.metric(url, D_FINISHED, timeout=3.0)


def _which(before: dict[str, float], d_urls: dict[str, str]) -> str | None:
    """The D whose finished-request counter moved (metrics lag the answer a little: polled 3 s)."""
    deadline = time.monotonic() + 3.0
    while time.monotonic() < deadline:
        moved = [d for d, u in d_urls.items() if _finished(u) > before[d]]
        if len(moved) == 1:
            return moved[0]
        if len(moved) > 1:
            return None
        time.sleep(0.2)
    return None
