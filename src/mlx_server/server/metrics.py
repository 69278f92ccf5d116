"""Prometheus metrics (``GET /metrics``) through ``prometheus-client``, one registry per app.

Three sources:

- an ASGI middleware counts HTTP requests by route, method and status, and client
  disconnects (the client went away before its response was complete): ``metrics_http``,
  with the ``/metrics`` page;
- the engines' generations are observed as the engine pushes their events (``Metrics``
  is the ``GenerationObserver`` an engine is built with): time to first token (from
  submission, queueing included), the gaps between streamed pieces, the whole generation's
  latency, token counts and finish reasons;
- a collector reads ``engine.stats()`` at scrape time: queue depth, running sequences, KV
  memory in use and its budget, prefix-cache entries, bytes, hits, misses and evictions.
"""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from mlx_server.engine.core.handle import TokenPiece
from mlx_server.engine.core.protocol import EngineCounters, engine_stats
from mlx_server.events import Finished

PREFIX = "mlx_server"
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1, 2.5)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


class Metrics:
    """The server's metrics in their own registry (tests build several apps side by side)."""

    def __init__(self, engine: EngineCounters | None = None):
        """``engine``: the counters read at scrape time (or later, ``count``)."""
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            f"{PREFIX}_requests",
            "HTTP requests by route, method and status",
            ["route", "method", "status"],
            registry=r,
        )
        self.disconnects = Counter(
            f"{PREFIX}_client_disconnects", "Clients gone before their response ended", registry=r
        )
        self.prompt_tokens = Counter(
            f"{PREFIX}_prompt_tokens", "Prompt tokens of finished generations", registry=r
        )
        self.cached_tokens = Counter(
            f"{PREFIX}_prompt_tokens_cached",
            "Prompt tokens served from the prefix cache",
            registry=r,
        )
        self.generation_tokens = Counter(
            f"{PREFIX}_generation_tokens", "Generated tokens", registry=r
        )
        self.draft_tokens = Counter(
            f"{PREFIX}_draft_tokens", "Tokens drafted by speculative decoding", registry=r
        )
        self.draft_accepted = Counter(
            f"{PREFIX}_draft_accepted_tokens",
            "Drafted tokens the model accepted (acceptance rate: this over draft_tokens)",
            registry=r,
        )
        self._drafts = [0, 0]  # drafted, accepted: the rate's terms
        self.draft_acceptance = Gauge(
            f"{PREFIX}_draft_acceptance_rate",
            "Accepted over drafted tokens, over every finished generation so far",
            registry=r,
        )
        self.finished = Counter(
            f"{PREFIX}_generations",
            "Finished generations by finish reason (stop, stop_sequence, length, cancelled, error)",
            ["reason"],
            registry=r,
        )
        self.cancellations = Counter(
            f"{PREFIX}_cancellations",
            "Generations cancelled (client gone, /v1/cancel or shutdown)",
            registry=r,
        )
        self.ttft = TokenHistogram(
            f"{PREFIX}_time_to_first_token_seconds",
            "From submission (queueing included) to the first generated text",
            TTFT_BUCKETS,
        )
        self.itl = TokenHistogram(
            f"{PREFIX}_inter_token_latency_seconds",
            "Between consecutive pieces of generated text of one generation",
            ITL_BUCKETS,
        )
        r.register(self.ttft)
        r.register(self.itl)
        self.e2e = Histogram(
            f"{PREFIX}_e2e_request_latency_seconds",
            "From submission to the end of a generation",
            buckets=E2E_BUCKETS,
            registry=r,
        )
        if engine is not None:
            self.count(engine)

    def count(self, engine: EngineCounters) -> None:
        """Read ``engine``'s counters at scrape time (queue, batch, KV memory, prefix cache)."""
        self.registry.register(EngineCollector(engine))

    def generation(self) -> Callable[[Any], None]:
        """``GenerationObserver``: what sees one generation's events, from its submission on
        (on the engine's thread)."""
        t0 = time.perf_counter()
        last: list[float] = []

        def observed(event: Any) -> None:
            now = time.perf_counter()
            if isinstance(event, TokenPiece) and event.text:
                if last:
                    self.itl.observe(now - last[0])
                else:
                    self.ttft.observe(now - t0)
                last[:] = [now]
            elif isinstance(event, Finished):
                self._finished(event, now - t0)

        return observed

    def _finished(self, ev: Finished, elapsed: float) -> None:
        self.e2e.observe(elapsed)
        self.finished.labels(ev.reason).inc()
        if ev.reason == "cancelled":
            self.cancellations.inc()
        self.prompt_tokens.inc(ev.usage.prompt_tokens)
        self.cached_tokens.inc(ev.usage.cached_tokens)
        self.generation_tokens.inc(ev.usage.completion_tokens)
        if ev.timings is not None and ev.timings.draft_n:
            self.draft_tokens.inc(ev.timings.draft_n)
            self.draft_accepted.inc(ev.timings.draft_n_accepted)
            self._drafts[0] += ev.timings.draft_n
            self._drafts[1] += ev.timings.draft_n_accepted
            self.draft_acceptance.set(self._drafts[1] / self._drafts[0])


class TokenHistogram(Collector):
    """A histogram observed for every generated piece, on the engine thread: a bucket count
    and a sum under one lock, exported at scrape time (prometheus-client's ``Histogram``
    costs a few times more per observation, which at 32 streams is a share of a GPU step)."""

    def __init__(self, name: str, documentation: str, buckets: Iterable[float]):
        self.name, self.documentation = name, documentation
        self.bounds = sorted(buckets)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound
        self.sum = 0.0
        self._lock = threading.Lock()

    def observe(self, value: float) -> None:
        with self._lock:
            self.counts[bisect.bisect_left(self.bounds, value)] += 1
            self.sum += value

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            counts, total = list(self.counts), self.sum
        cumulative, buckets = 0, []
        labels = [floatToGoString(b) for b in self.bounds] + ["+Inf"]  # as Histogram's
        for bound, n in zip(labels, counts, strict=True):
            cumulative += n
            buckets.append((bound, cumulative))
        yield HistogramMetricFamily(self.name, self.documentation, buckets, sum_value=total)


class EngineCollector(Collector):
    """Reads the engine's live state at scrape time."""

    def __init__(self, engine: EngineCounters):
        self.engine = engine

    def collect(self) -> Iterable[Metric]:
        stats = self._stats()
        yield _gauge("queue_depth", "Requests waiting for a batch slot", stats.get("queued", 0))
        yield _gauge("running_sequences", "Sequences in the running batch", stats.get("active", 0))
        yield _gauge(
            "prefilling_sequences", "Running sequences still prefilling", stats.get("prefilling", 0)
        )
        yield _gauge(
            "kv_bytes_in_use", "KV memory admitted for running requests", stats["kv_in_use_bytes"]
        )
        budget = stats.get("memory_budget_bytes", 0)  # the memory the engine admits KV into
        yield _gauge("kv_budget_bytes", "KV memory budget (--kv-budget-gb)", budget)
        yield _gauge(
            "prefix_cache_entries", "Prefix-cache entries", stats.get("prompt_cache_entries", 0)
        )
        yield _gauge(
            "prefix_cache_bytes", "Prefix-cache KV bytes", stats.get("prompt_cache_bytes", 0)
        )
        for key, help in (
            ("hits", "Prefix-cache lookups that reused a cached prefix"),
            ("misses", "Prefix-cache lookups that found nothing"),
            ("evictions", "Prefix-cache entries evicted for room"),
        ):
            c = CounterMetricFamily(f"{PREFIX}_prefix_cache_{key}", help)
            c.add_metric([], stats.get(f"prompt_cache_{key}", 0))
            yield c
        yield from _cache_misses_and_failures(stats)

    def _stats(self) -> dict[str, Any]:
        return {"kv_in_use_bytes": 0, **engine_stats(self.engine)}


def _cache_misses_and_failures(stats: dict[str, Any]) -> Iterable[Metric]:
    """Prefix-cache misses by reason (``cache_misses.REASONS``) and bookkeeping failures."""
    misses = CounterMetricFamily(
        f"{PREFIX}_prefix_cache_misses_by_reason",
        "Prefix-cache lookups that found nothing, by why",
        labels=["reason"],
    )
    marker = "prompt_cache_miss_"
    for key, value in stats.items():
        if key.startswith(marker):
            misses.add_metric([key[len(marker) :]], value)
    yield misses
    failures = CounterMetricFamily(
        f"{PREFIX}_prefix_cache_failures",
        "Prefix-cache entries dropped because storing, writing or reading them failed",
    )
    failures.add_metric([], stats.get("prompt_cache_failures", 0))
    yield failures


def _gauge(name: str, help: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", help, value=value)
