"""The server's counters, gauges and histograms, as Prometheus text (`GET /metrics`).

    tpkit_requests_total{finish="stop"|"length"|"cancelled"|"error"}
    tpkit_prompt_tokens_total, tpkit_generation_tokens_total
    tpkit_batch_size, tpkit_queue_length               (gauges, at the last step)
    tpkit_time_to_first_token_seconds, tpkit_inter_token_latency_seconds  (histograms)
    tpkit_collectives_total{op=...}                    (what the tp group sent, ledger)
    tpkit_prompt_tokens_computed_total                 (prefilled: prefix-cache hits not)
    tpkit_prefix_cache_hit_tokens_total, tpkit_preemptions_total
    tpkit_kv_blocks_used, tpkit_kv_cache_bytes         (gauges: blocks in use, bytes held)
"""

from __future__ import annotations

import bisect
import threading
from collections import Counter

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

    def lines(self, name: str) -> list[str]:
        """Prometheus exposition lines."""
        out, total = [f"# TYPE {name} histogram"], 0
        for le, c in zip((*map(str, self.buckets), "+Inf"), self.counts):
            total += c
            out.append(f'{name}_bucket{{le="{le}"}} {total}')
        return out + [f"{name}_sum {self.sum:.6f}", f"{name}_count {self.n}"]


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
        self.ttft, self.itl = Histogram(), Histogram()

    def render(self) -> str:
        """The Prometheus text exposition format."""
        with self.lock:
            lines = ["# TYPE tpkit_requests_total counter"]
            lines += [f'tpkit_requests_total{{finish="{k}"}} {v}'
                      for k, v in sorted(self.requests.items())]
            for name, v in (("prompt_tokens_total", self.prompt_tokens),
                            ("generation_tokens_total", self.generation_tokens),
                            ("prompt_tokens_computed_total", self.prompt_tokens_computed),
                            ("prefix_cache_hit_tokens_total", self.prefix_hit_tokens),
                            ("preemptions_total", self.preemptions)):
                lines += [f"# TYPE tpkit_{name} counter", f"tpkit_{name} {v}"]
            for name, v in (("batch_size", self.batch_size),
                            ("queue_length", self.queue_length),
                            ("kv_blocks_used", self.kv_blocks_used),
                            ("kv_cache_bytes", self.kv_bytes)):
                lines += [f"# TYPE tpkit_{name} gauge", f"tpkit_{name} {v}"]
            lines += self.ttft.lines("tpkit_time_to_first_token_seconds")
            lines += self.itl.lines("tpkit_inter_token_latency_seconds")
            lines.append("# TYPE tpkit_collectives_total counter")
            lines += [f'tpkit_collectives_total{{op="{k}"}} {v}'
                      for k, v in sorted(self.collectives.items())]
        return "\n".join(lines) + "\n"
