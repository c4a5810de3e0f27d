"""The server's counters, gauges and histograms, as Prometheus text (`GET /metrics`),
through prometheus_client (a collector: the engine keeps plain numbers, under a lock).

    tpkit_requests_total{finish="stop"|"length"|"cancelled"|"error"|"embedded"}
    tpkit_prompt_tokens_total, tpkit_generation_tokens_total
    tpkit_embedding_inputs_total                       (an encoder: inputs embedded)
    tpkit_batch_size, tpkit_queue_length               (gauges, at the last step)
    tpkit_time_to_first_token_seconds, tpkit_inter_token_latency_seconds  (histograms)
    tpkit_collectives_total{op=...}                    (what the tp group sent, ledger)
    tpkit_prompt_tokens_computed_total                 (prefilled: prefix-cache hits not)
    tpkit_prefix_cache_hit_tokens_total, tpkit_preemptions_total
    tpkit_kv_blocks_used, tpkit_kv_cache_bytes         (gauges: blocks in use, bytes held)
    with prompt pacing on (`--itl-ratio R`, `serve.pacing`; vLLM has no such gauges):
    tpkit_pacing_itl_ratio                             (R)
    tpkit_pacing_prompt_budget_tokens                  (the budget it gave the last step
                                                        with a prompt to compute; 0: a
                                                        decode-only step measuring D)
    tpkit_pacing_decode_step_seconds                   (D, a decode-only step; NaN: unseen)
    tpkit_pacing_cost_seconds{term="token"|"token_kpos"|"kkeys"}  (its learned costs a, b, g)
    with speculation on (`--speculative ngram|draft`, `serve.speculate`):
    tpkit_spec_proposed_tokens_total, tpkit_spec_accepted_tokens_total, and
    tpkit_spec_acceptance_rate                         (accepted / proposed; NaN: none yet)
"""

from __future__ import annotations

import bisect
import math
import threading
from collections import Counter
from typing import NamedTuple

BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Histogram:
    """Cumulative buckets, a sum and a count (Prometheus' histogram)."""

    def __init__(self, buckets: tuple[float, ...] = BUCKETS) -> None:
        self.buckets, self.counts = buckets, [0] * (len(buckets) + 1)
        self.sum, self.n = 0.0, 0

    def observe(self, x: float) -> None:
        """Add one observation."""
        self.counts[bisect.bisect_left(self.buckets, x)] += 1
        self.sum += x
        self.n += 1


class Pacing(NamedTuple):
    """The pacer's state after a step: its ratio, the last budget it gave, a decode-only
    step's seconds (None: not measured yet) and its learned costs (a, b, g)."""

    ratio: float
    budget: int
    decode_s: float | None
    costs: tuple[float, float, float]


class Metrics:
    """Everything `/metrics` shows; updated by the engine, read by the HTTP threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: Counter = Counter()
        self.collectives: Counter = Counter()
        self.prompt_tokens = self.generation_tokens = 0
        self.batch_size = self.queue_length = 0
        self.prompt_tokens_computed = self.prefix_hit_tokens = self.preemptions = 0
        self.kv_blocks_used = self.kv_bytes = 0
        self.embedding_inputs = 0
        self.ttft, self.itl = Histogram(), Histogram()
        self.pacing: Pacing | None = None  # with prompt pacing on
        self.speculated: tuple[int, int] | None = None  # (proposed, accepted) tokens

    def collect(self):
        """The metric families (prometheus_client's collector protocol)."""
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        with self.lock:
            req = CounterMetricFamily("tpkit_requests", "requests ended, by finish reason",
                                      labels=["finish"])
            for k, v in sorted(self.requests.items()):
                req.add_metric([k], v)
            out = [req]
            for name, v, doc in (
                    ("prompt_tokens", self.prompt_tokens, "prompt tokens of ended requests"),
                    ("generation_tokens", self.generation_tokens, "tokens generated"),
                    ("prompt_tokens_computed", self.prompt_tokens_computed,
                     "prompt tokens prefilled (prefix-cache hits are not)"),
                    ("prefix_cache_hit_tokens", self.prefix_hit_tokens,
                     "prompt tokens found in the prefix cache"),
                    ("preemptions", self.preemptions, "requests preempted (recomputed)"),
                    ("embedding_inputs", self.embedding_inputs, "inputs embedded")):
                out.append(CounterMetricFamily(f"tpkit_{name}", doc, value=v))
            for name, v, doc in (
                    ("batch_size", self.batch_size, "requests running at the last step"),
                    ("queue_length", self.queue_length, "requests waiting"),
                    ("kv_blocks_used", self.kv_blocks_used, "KV blocks in use"),
                    ("kv_cache_bytes", self.kv_bytes, "bytes of KV blocks held (rank 0)")):
                out.append(GaugeMetricFamily(f"tpkit_{name}", doc, value=v))
            for name, h, doc in (
                    ("time_to_first_token_seconds", self.ttft, "arrival to first token"),
                    ("inter_token_latency_seconds", self.itl, "gap between two tokens")):
                buckets, total = [], 0
                for le, c in zip((*map(str, h.buckets), "+Inf"), h.counts):
                    total += c
                    buckets.append((le, total))
                out.append(HistogramMetricFamily(f"tpkit_{name}", doc, buckets=buckets,
                                                 sum_value=h.sum))
            if self.pacing is not None:
                out.extend(_pacing(self.pacing, GaugeMetricFamily))
            if self.speculated is not None:
                out.extend(_speculated(*self.speculated, CounterMetricFamily,
                                       GaugeMetricFamily))
            col = CounterMetricFamily("tpkit_collectives", "collectives the tp group ran",
                                      labels=["op"])
            for k, v in sorted(self.collectives.items()):
                col.add_metric([k], v)
            out.append(col)
        return out

    def render(self) -> str:
        """The Prometheus text exposition format, written by prometheus_client."""
        from prometheus_client import CollectorRegistry, generate_latest

        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        return generate_latest(registry).decode()


def _pacing(p: Pacing, gauge) -> list:
    costs = gauge("tpkit_pacing_cost_seconds", "the pacer's learned seconds per prompt "
                  "token (token), per token per 1024 positions of its context (token_kpos), "
                  "per 1024 keys a piece reads (kkeys)", labels=["term"])
    for term, v in zip(("token", "token_kpos", "kkeys"), p.costs):
        costs.add_metric([term], v)
    return [gauge("tpkit_pacing_itl_ratio", "a step with prompt pieces at most this many "
                  "decode-only steps (--itl-ratio)", value=p.ratio),
            gauge("tpkit_pacing_prompt_budget_tokens", "prompt tokens the pacer allowed the "
                  "last step that had a prompt to compute (0: a decode-only step)",
                  value=p.budget),
            gauge("tpkit_pacing_decode_step_seconds", "a decode-only step's seconds, as the "
                  "pacer measured them (NaN: not yet)",
                  value=math.nan if p.decode_s is None else p.decode_s),
            costs]


def _speculated(proposed: int, accepted: int, counter, gauge) -> list:
    return [counter("tpkit_spec_proposed_tokens", "tokens proposed by speculation "
                    "(--speculative)", value=proposed),
            counter("tpkit_spec_accepted_tokens", "proposed tokens the model confirmed",
                    value=accepted),
            gauge("tpkit_spec_acceptance_rate", "accepted / proposed tokens so far (NaN: "
                  "none proposed yet)", value=accepted / proposed if proposed else math.nan)]
