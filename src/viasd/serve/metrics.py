"""Server metrics in the Prometheus text format, without a client library.

Counters are kept per decoding method so that, for example, the rejection rate of `sd` and the tier
fractions of `via` can be watched side by side. Ratios (tokens/s, rejection rate, tier fractions,
full-target calls per token) are also exported as gauges over everything served so far, for people who
read /metrics by eye; dashboards should prefer `rate()` over the counters. Request latencies (histograms) and
the speculation counters are also exported under vLLM's names in the `viasd:` namespace, so that dashboards made
for vLLM's server work here. Updated from the generation thread and read from the event loop, hence the lock.
"""

from __future__ import annotations

import copy
import threading
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from viasd.decode.stats import GenerationStats
from viasd.serve.latency import (
    REQUEST_LATENCY_BUCKETS,
    TIME_PER_OUTPUT_TOKEN_BUCKETS,
    TIME_TO_FIRST_TOKEN_BUCKETS,
    Histogram,
    RequestTimes,
)

if TYPE_CHECKING:
    from viasd.passes.prefix_cache import PrefixCacheCounts


@dataclass
class MethodTotals:
    """Sums over the finished generations of one method."""

    generations: int = 0
    cancelled: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    new_tokens: int = 0
    seconds: float = 0.0
    target_calls: int = 0
    drafter_calls: int = 0
    slim_calls: int = 0
    drafted: int = 0
    evaluated: int = 0
    accepted: int = 0
    unchecked_tokens: int = 0
    finish_reasons: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    tier_decided: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    tier_accepted: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    tier_rejected: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    source_rounds: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    source_accepted: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    drafts: int = 0  # rounds that proposed a draft (vLLM's num_drafts)
    queue: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))
    first_token: Histogram = field(default_factory=lambda: Histogram(TIME_TO_FIRST_TOKEN_BUCKETS))
    per_output_token: Histogram = field(default_factory=lambda: Histogram(TIME_PER_OUTPUT_TOKEN_BUCKETS))
    end_to_end: Histogram = field(default_factory=lambda: Histogram(REQUEST_LATENCY_BUCKETS))

    def add(self, stats: GenerationStats, times: RequestTimes | None = None) -> None:
        self.generations += 1
        self.prompt_tokens += stats.prompt_tokens
        self.new_tokens += stats.new_tokens
        self.seconds += stats.total_seconds
        self.target_calls += stats.target_calls
        self.drafter_calls += stats.drafter_calls
        self.slim_calls += stats.slim_calls
        self.drafted += stats.drafted
        self.evaluated += stats.evaluated
        self.accepted += stats.accepted
        self.unchecked_tokens += stats.unchecked_tokens
        self.finish_reasons[stats.finish_reason] += 1
        for name, tier in stats.tiers.items():
            self.tier_decided[name] += tier.decided
            self.tier_accepted[name] += tier.accepted
            self.tier_rejected[name] += tier.rejected
        for name, source in stats.sources.items():
            self.source_rounds[name] += source.rounds
            self.source_accepted[name] += source.accepted
        self.drafts += drafting_rounds(stats)
        if times is not None:
            self.queue.observe(times.queue)
            self.first_token.observe(times.first_token)
            self.per_output_token.observe(times.per_output_token)
            self.end_to_end.observe(times.end_to_end)


def drafting_rounds(stats: GenerationStats) -> int:
    """Rounds of a generation that proposed a draft: its draft sources' rounds (a round with an empty draft counts
    for none); a method that names no source but drafted (hf-assisted) verified one draft per round."""
    if stats.sources:
        return sum(source.rounds for source in stats.sources.values())
    return stats.rounds if stats.drafted else 0


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{key}="{_escape(value)}"' for key, value in labels.items()) + "}"


def _number(value: float) -> str:
    return str(value) if isinstance(value, int) else repr(float(value))


class _Writer:
    """Collects metric families as text lines."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str, samples: Iterable[tuple[dict[str, str], float]]) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")
        self.lines.extend(f"{name}{_labels(labels)} {_number(value)}" for labels, value in samples)

    def histogram(self, name: str, help_text: str, series: Iterable[tuple[dict[str, str], Histogram]]) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} histogram")
        for labels, histogram in series:
            for le, count in histogram.cumulative():
                self.lines.append(f"{name}_bucket{_labels({**labels, 'le': le})} {count}")
            self.lines.append(f"{name}_sum{_labels(labels)} {_number(histogram.total)}")
            self.lines.append(f"{name}_count{_labels(labels)} {histogram.count}")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


class Metrics:
    """Thread-safe counters of HTTP requests and generations, rendered as Prometheus text."""

    def __init__(self, methods: Iterable[str], model_name: str | None = None) -> None:
        self._model_name = model_name  # a label of the vLLM-named families, as vLLM labels them
        self._lock = threading.Lock()
        self._requests: dict[tuple[str, str], int] = defaultdict(int)
        self._methods: dict[str, MethodTotals] = {method: MethodTotals() for method in methods}

    def count_request(self, path: str, status: int) -> None:
        with self._lock:
            self._requests[(path, str(status))] += 1

    def record(self, method: str, stats: GenerationStats, times: RequestTimes | None = None) -> None:
        """Count a finished generation, and its request's latencies when given."""
        with self._lock:
            self._methods.setdefault(method, MethodTotals()).add(stats, times)

    def record_cancelled(self, method: str) -> None:
        with self._lock:
            self._methods.setdefault(method, MethodTotals()).cancelled += 1

    def record_failed(self, method: str) -> None:
        with self._lock:
            self._methods.setdefault(method, MethodTotals()).failed += 1

    def _render_vllm_named(self, out: _Writer, methods: dict[str, MethodTotals]) -> None:
        """The families vLLM's server exports, under its names in the `viasd:` namespace: request latencies of the
        finished generations, and the speculation counters."""
        model = {} if self._model_name is None else {"model_name": self._model_name}

        def labels(method: str) -> dict[str, str]:
            return {**model, "method": method}

        for name, help_text, table in (
            ("viasd:request_queue_time_seconds", "Seconds requests waited in the queue.", "queue"),
            ("viasd:time_to_first_token_seconds", "Seconds from arrival to the first token.", "first_token"),
            (
                "viasd:request_time_per_output_token_seconds",
                "Per request: seconds from its first token to its end over its tokens after the first.",
                "per_output_token",
            ),
            ("viasd:e2e_request_latency_seconds", "Seconds from arrival to the end of generation.", "end_to_end"),
        ):
            out.histogram(name, help_text, ((labels(m), getattr(t, table)) for m, t in methods.items()))
        for name, help_text, count in (
            ("viasd:spec_decode_num_drafts_total", "Rounds that proposed a draft, each verified once.", "drafts"),
            ("viasd:spec_decode_num_draft_tokens_total", "Draft tokens proposed.", "drafted"),
            ("viasd:spec_decode_num_accepted_tokens_total", "Draft tokens accepted.", "accepted"),
        ):
            out.family(name, "counter", help_text, ((labels(m), getattr(t, count)) for m, t in methods.items()))

    def render(self, waiting: int, running: int, capacity: int) -> str:
        """The exposition text; queue figures are passed in as they live in the generation service."""
        with self._lock:
            requests = dict(self._requests)
            methods = copy.deepcopy(self._methods)  # render outside the lock
        out = _Writer()
        out.family(
            "viasd_http_requests_total",
            "counter",
            "HTTP requests by path and status code.",
            ((({"path": path, "status": status}), count) for (path, status), count in sorted(requests.items())),
        )
        out.family("viasd_queue_depth", "gauge", "Generation requests waiting for the model.", [({}, waiting)])
        out.family("viasd_requests_running", "gauge", "Generations running now (up to --max-active).", [({}, running)])
        out.family("viasd_queue_capacity", "gauge", "Requests that may wait before new ones get 503.", [({}, capacity)])

        def per_method(name: str, kind: str, help_text: str, value: Callable[[MethodTotals], float]) -> None:
            out.family(name, kind, help_text, (({"method": m}, value(t)) for m, t in methods.items()))

        per_method("viasd_generations_total", "counter", "Finished generations.", lambda t: t.generations)
        per_method(
            "viasd_generations_cancelled_total",
            "counter",
            "Generations stopped because the client went away.",
            lambda t: t.cancelled,
        )
        per_method("viasd_generations_failed_total", "counter", "Generations that raised an error.", lambda t: t.failed)
        out.family(
            "viasd_generations_finished_total",
            "counter",
            "Finished generations by finish reason (eos, stop, length).",
            (
                ({"method": m, "reason": reason}, count)
                for m, t in methods.items()
                for reason, count in sorted(t.finish_reasons.items())
            ),
        )
        per_method("viasd_prompt_tokens_total", "counter", "Prompt tokens processed.", lambda t: t.prompt_tokens)
        per_method("viasd_generated_tokens_total", "counter", "Tokens generated.", lambda t: t.new_tokens)
        per_method("viasd_generation_seconds_total", "counter", "Time spent generating.", lambda t: t.seconds)
        per_method(
            "viasd_tokens_per_second",
            "gauge",
            "Generated tokens per second of generation time, over all generations so far.",
            lambda t: _ratio(t.new_tokens, t.seconds),
        )
        per_method(
            "viasd_target_calls_total", "counter", "Forward passes of the full target.", lambda t: t.target_calls
        )
        per_method(
            "viasd_target_calls_per_token",
            "gauge",
            "Full-target forward passes per generated token (plain decoding: about 1).",
            lambda t: _ratio(t.target_calls, t.new_tokens),
        )
        per_method(
            "viasd_drafter_calls_total", "counter", "Forward passes of the drafter model.", lambda t: t.drafter_calls
        )
        per_method("viasd_slim_calls_total", "counter", "Forward passes of the slim verifier.", lambda t: t.slim_calls)
        per_method("viasd_draft_tokens_total", "counter", "Draft tokens proposed.", lambda t: t.drafted)
        per_method(
            "viasd_draft_tokens_evaluated_total", "counter", "Draft tokens some verifier judged.", lambda t: t.evaluated
        )
        per_method("viasd_draft_tokens_accepted_total", "counter", "Draft tokens kept.", lambda t: t.accepted)
        per_method(
            "viasd_rejection_rate",
            "gauge",
            "Judged draft tokens that were rejected, over judged draft tokens.",
            lambda t: _ratio(t.evaluated - t.accepted, t.evaluated),
        )
        per_method(
            "viasd_unchecked_tokens_total",
            "counter",
            "Committed tokens the full target never verified (relaxed VIA-SD tiers).",
            lambda t: t.unchecked_tokens,
        )
        tiers = [(m, t, tier) for m, t in methods.items() for tier in sorted(t.tier_decided)]
        for name, help_text, table in (
            ("viasd_tier_decided_total", "Draft tokens each verification tier decided.", "tier_decided"),
            ("viasd_tier_accepted_total", "Draft tokens each tier kept.", "tier_accepted"),
            ("viasd_tier_rejected_total", "Draft tokens each tier rejected and replaced.", "tier_rejected"),
        ):
            out.family(
                name, "counter", help_text, (({"method": m, "tier": k}, getattr(t, table)[k]) for m, t, k in tiers)
            )
        sources = [(m, t, source) for m, t in methods.items() for source in sorted(t.source_rounds)]
        for name, help_text, table in (
            ("viasd_draft_source_rounds_total", "Rounds whose draft each draft source proposed.", "source_rounds"),
            (
                "viasd_draft_source_accepted_total",
                "Draft tokens kept, by the source that drafted them.",
                "source_accepted",
            ),
        ):
            out.family(
                name, "counter", help_text, (({"method": m, "source": k}, getattr(t, table)[k]) for m, t, k in sources)
            )
        out.family(
            "viasd_tier_fraction",
            "gauge",
            "Share of decided draft tokens that each tier decided.",
            (({"method": m, "tier": k}, _ratio(t.tier_decided[k], sum(t.tier_decided.values()))) for m, t, k in tiers),
        )
        self._render_vllm_named(out, methods)
        return out.text()


def prefix_cache_text(counts: PrefixCacheCounts) -> str:
    """The prefix cache's figures (passes/prefix_cache.py) in the exposition format, after `Metrics.render`'s."""
    out = _Writer()
    for name, kind, help_text, value in (
        ("hits_total", "counter", "Prompts that started from kept KV entries.", counts.hits),
        ("misses_total", "counter", "Prompts that found no kept entries to start from.", counts.misses),
        ("reused_tokens_total", "counter", "Prompt tokens whose target KV came from the cache.", counts.reused_tokens),
        (
            "evictions_total",
            "counter",
            "Entries dropped, least recently used, to stay within the bound.",
            counts.evictions,
        ),
        (
            "refused_total",
            "counter",
            "Finished generations not kept: their entries alone exceed the bound (--prefix-cache-mb).",
            counts.refused,
        ),
        ("entries", "gauge", "Entries kept now.", counts.entries),
        ("bytes", "gauge", "Bytes of KV entries kept now.", counts.bytes),
        ("capacity_bytes", "gauge", "Most bytes the cache keeps (--prefix-cache-mb).", counts.capacity_bytes),
    ):
        out.family(f"viasd_prefix_cache_{name}", kind, help_text, [({}, value)])
    return out.text()
