"""The serve lane's workload: routed completions through `vllm-router`, each
answer compared with what P alone answers to the same prompt.

- Prompts: a seeded set of sentence mixes, each several KV blocks long.
- References: P alone (greedy, the routed ``max_tokens``), asked before the faults.
- Stream: requests at seeded exponential gaps, each from its own thread with a
  client timeout; at most ``MAX_IN_FLIGHT`` at once (a wedged fleet does not
  pile up threads); bursts of ``burst_size`` concurrent requests now and then.
- Probes (after the final heal): one routed request at a time, attributed to
  the D whose finished-request counter moved.
- Clients (stream requests only, from a seeded stream of their own): a fraction
  ``abort_frac`` cancels (the client hangs up ``cancel_s`` after sending, while
  the request may wait on D or its READ be in flight: the router and D abort
  it); ``n2_frac`` asks for n = 2 choices (top-1 sampling: vLLM refuses n > 1
  at temperature 0; D's two children share P's ``kv_transfer_params``: two
  readers of one lease); ``dup_frac`` hedges the
  decode step as a router that retries would: P's prefill straight from P, then
  the same ``kv_transfer_params`` to D twice at once (the same D or both Ds).

History: ``routed`` (id, prompt, burst, probe; n, cancel_s or hedge when so)
when sent and ``answer`` (id, status, equal, error, elapsed_s, d for probes;
``copy`` and d for a hedge's two answers; ``cancelled`` when the client hung up)
when it returns.  Every choice of an answer must equal P alone's.
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
ABORT_FRAC = 0.05  # of stream requests, cancelled by their client
N2_FRAC = 0.1  # of stream requests, n = 2
DUP_FRAC = 0.05  # of stream requests, the decode step sent twice with P's params
CANCEL_MAX_S = 2.0  # a cancelling client hangs up within this long
# vLLM refuses n > 1 with greedy sampling (temperature 0); top-1 sampling is greedy all the same.
N_SAMPLING = {"temperature": 1.0, "top_k": 1}
# What the router sends P: prefill, and hold the KV for a D (P answers with its params).
P_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
            "remote_block_ids": None, "remote_host": None, "remote_port": None}  # fmt: skip


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
        self,
        hist: History,
        router_url: str,
        texts: list[str],
        refs: list[str],
        seed: int,
        rate: float,
        direct: tuple[str, dict[str, str]] | None = None,
        fracs: tuple[float, float, float] = (ABORT_FRAC, N2_FRAC, DUP_FRAC),
    ) -> None:
        """``direct``: P's URL and D name -> URL, for hedged decode steps (none without);
        ``fracs``: of stream requests, those cancelled, with n = 2, hedged."""
        self.hist, self.url, self.texts, self.refs = hist, router_url, texts, refs
        self.rng = random.Random(seed ^ 0x5E7E)
        self.xrng = random.Random(seed ^ 0xAB07)
        self.direct = direct
        self.abort_frac, self.n2_frac, self.dup_frac = fracs
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

    def _client(self) -> None:
        """One stream request: cancelled, n = 2, hedged or plain (seeded apart from the prompts)."""
        x = self.xrng.random()
        if x < self.abort_frac:
            self._cancelled(round(self.xrng.uniform(0.05, CANCEL_MAX_S), 3))
        elif x < self.abort_frac + self.n2_frac:
            self._routed_n(2)
        elif x < self.abort_frac + self.n2_frac + self.dup_frac and self.direct is not None:
            self._hedged(self.xrng.random() < 0.5)
        else:
            self._one()

    def _cancelled(self, cancel_s: float) -> None:
        rid = f"s{next(self._ids)}"
        k = self.rng.randrange(len(self.texts))
        self.hist.add("routed", id=rid, prompt=k, burst=False, probe=False, cancel_s=cancel_s)
        r = client.complete(self.url, self.texts[k], MAX_TOKENS, timeout=cancel_s)
        cancelled = not r.ok and r.status == 0 and "timed out" in r.error
        self.hist.add(
            "answer", id=rid, status=r.status, equal=r.ok and r.text == self.refs[k], error=r.error[:160],
            elapsed_s=round(r.elapsed, 3), d=None, cancelled=cancelled,
        )  # fmt: skip

    def _routed_n(self, n: int) -> None:
        rid = f"s{next(self._ids)}"
        k = self.rng.randrange(len(self.texts))
        self.hist.add("routed", id=rid, prompt=k, burst=False, probe=False, n=n)
        r = client.complete(self.url, self.texts[k], MAX_TOKENS, timeout=CLIENT_TIMEOUT_S, n=n, **N_SAMPLING)
        texts = [c.get("text") for c in (r.body or {}).get("choices", [])]
        equal = r.ok and len(texts) == n and all(t == self.refs[k] for t in texts)
        self.hist.add(
            "answer", id=rid, status=r.status, equal=equal, error=r.error[:160],
            elapsed_s=round(r.elapsed, 3), d=None,
        )  # fmt: skip

    def _hedged(self, other_d: bool) -> None:
        """P's prefill straight from P, then its params to D twice at once (as a hedging router)."""
        assert self.direct is not None
        p_url, d_urls = self.direct
        names = sorted(d_urls)
        first = self.xrng.choice(names)
        second = next((d for d in names if d != first), first) if other_d else first
        rid = f"s{next(self._ids)}"
        k = self.rng.randrange(len(self.texts))
        self.hist.add("routed", id=rid, prompt=k, burst=False, probe=False, hedge=[first, second])
        r = client.complete(p_url, self.texts[k], 1, timeout=CLIENT_TIMEOUT_S, kv_transfer_params=P_PARAMS)
        params = (r.body or {}).get("kv_transfer_params")
        if not r.ok or not params:
            self.hist.add(
                "answer", id=rid, status=r.status, equal=False, error=f"P: {r.error or 'no params'}"[:160],
                elapsed_s=round(r.elapsed, 3), d=None,
            )  # fmt: skip
            return
        answers: list[client.Result | None] = [None, None]

        def decode(i: int, d: str) -> None:
            answers[i] = client.complete(
                d_urls[d],
                self.texts[k],
                MAX_TOKENS,
                timeout=CLIENT_TIMEOUT_S,
                kv_transfer_params=dict(params),
            )

        threads = [
            threading.Thread(target=decode, args=(i, d), daemon=True) for i, d in enumerate((first, second))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(CLIENT_TIMEOUT_S + 10)
        for i, (d, a) in enumerate(zip((first, second), answers, strict=True)):
            if a is None:
                continue
            self.hist.add(
                "answer", id=rid, copy=i, d=d, status=a.status, equal=a.ok and a.text == self.refs[k],
                error=a.error[:160], elapsed_s=round(a.elapsed, 3),
            )  # fmt: skip

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
            self._spawn(self._client)

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
