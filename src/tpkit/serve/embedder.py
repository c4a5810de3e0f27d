"""`Embedder`: an encoder's serving engine (POST /v1/embeddings): requests of token-id
inputs in, one pooled vector per input out; what `tpkit serve` runs for a BERT-family
model in place of the generating `Engine`, under the same serving loop (`serve.loop`).

    embedder = Embedder(model, read_pooling(folder))
    vectors = embedder.embed([tok.encode("Tensor parallelism"), tok.encode("a")])  # [2, h]
    job = embedder.submit(inputs, on_done)      # with a serving loop stepping it

Each `step()` runs one forward (`Runner.lead_embed`: on every tp rank, the followers
get the rows through the plan broadcast) of the waiting requests' inputs, in arrival
order, each request's sorted by length, right-padded to the longest of the forward and
masked, at most `tokens_per_forward` padded tokens a forward: concurrent small requests
share a forward, a large one takes several.
Rank 0 pools the final hidden states (`weights.pooling.Pooling`: mean over the mask or
the first token, L2-normalised where the folder says so). An input's vector does not
depend on what shares its forward beyond float32 round-off: padded keys are masked out
of attention and padded rows out of the mean (the tests hold it to 1e-6).
"""

from __future__ import annotations

import threading
from collections import deque

import torch
from torch import nn

from tpkit.serve.engine import Intake, TooLong
from tpkit.serve.metrics import Metrics
from tpkit.serve.runner import Runner
from tpkit.spec.errors import UserError
from tpkit.weights.pooling import Pooling


class EmbedJob:
    """One request's inputs (token ids) and, once `done`, their vectors (or `error`)."""

    def __init__(self, id: int, inputs: list[list[int]], on_done=None) -> None:
        self.id, self.inputs, self.on_done = id, inputs, on_done
        self.order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
        self.next = 0  # how many of `order` are computed
        self.vectors: list[torch.Tensor | None] = [None] * len(inputs)
        self.error: tuple[int, str] | None = None
        self.cancelled, self.done = False, threading.Event()

    @property
    def tokens(self) -> int:
        """Tokens of all the inputs (OpenAI's prompt_tokens)."""
        return sum(map(len, self.inputs))

    def cancel(self) -> None:
        """The client went away: skipped at the next step."""
        self.cancelled = True

    def _end(self, error: tuple[int, str] | None = None) -> None:
        self.error = error
        self.done.set()
        if self.on_done is not None:
            self.on_done()


class Embedder(Intake):
    """Inputs in (`submit`), pooled vectors out (`EmbedJob`); `step()` runs one forward."""

    def __init__(self, model: nn.Module, pooling: Pooling | None = None, *,
                 max_batch: int = 8, max_len: int | None = None,
                 tokens_per_forward: int | None = None,
                 runner: Runner | None = None) -> None:
        if model.config.causal:
            raise UserError(f"{model.config.name} is a decoder (causal attention): "
                            f"embeddings are served for encoder models only")
        self.model, self.pooling = model, pooling or Pooling()
        limits = [model.config.max_seq_len, max_len, self.pooling.max_len]
        self.max_len = min(v for v in limits if v)
        self.limits = limits
        self.tokens_per_forward = tokens_per_forward or max_batch * self.max_len
        if self.tokens_per_forward < 1:
            raise UserError(f"tokens_per_forward={tokens_per_forward} must be >= 1")
        super().__init__(model, runner)
        self.width = model.config.hidden
        self.metrics, self.tokenizer_lock = Metrics(), threading.Lock()
        self.waiting: deque[EmbedJob] = deque()

    def limit_text(self) -> str:
        """Where the longest input comes from ('max positions 512, max_seq_length 256')."""
        names = ("max positions", "--max-len", "sentence_bert_config.json max_seq_length")
        return ", ".join(f"{n} {v}" for n, v in zip(names, self.limits) if v)

    def check(self, inputs: list[list[int]]) -> None:
        """UserError for inputs this model cannot embed (empty, outside the vocabulary;
        TooLong: longer than `max_len`), naming the input and the lengths."""
        vocab = self.model.config.vocab_size
        for i, ids in enumerate(inputs):
            if not ids:
                raise UserError(f"input[{i}] is empty (it needs at least one token)")
            if len(ids) > self.max_len:
                raise TooLong(f"input[{i}] has {len(ids)} tokens; this model embeds at "
                                f"most {self.max_len} tokens an input ({self.limit_text()})")
            bad = sorted({t for t in ids if not (isinstance(t, int) and 0 <= t < vocab)})
            if bad:
                raise UserError(f"input[{i}]: token ids {bad[:5]} are outside the model's "
                                f"vocabulary [0, {vocab})")

    def submit(self, inputs: list[list[int]], on_done=None) -> EmbedJob:
        """Queue a request's inputs; `on_done()` is called (from the loop's thread) once
        its job is done. UserError for bad inputs, RequestFailed (503) once not accepting."""
        self.check(inputs)
        with self._intake() as rid:
            job = EmbedJob(rid, [list(x) for x in inputs], on_done)
            self.waiting.append(job)
        return job

    def embed(self, inputs: list[list[int]]) -> torch.Tensor:
        """The vectors [len(inputs), h] of `inputs`, stepping here (no serving loop)."""
        if self.looping:
            raise RuntimeError("a serving loop steps this engine: submit() instead")
        job = self.submit(inputs)
        while not job.done.is_set():
            self.step()
        if job.error is not None:
            raise RuntimeError(job.error[1])
        return torch.stack(job.vectors)

    @property
    def busy(self) -> bool:
        """Requests waiting."""
        return bool(self.waiting)

    def _plan(self) -> list[tuple[EmbedJob, list[int]]]:
        """The next forward: the waiting requests' inputs in arrival order (each request's
        shortest first) while the padded tokens fit `tokens_per_forward` (one input
        always); a request that does not fit whole ends the forward (first come, first
        served)."""
        plan, rows, longest = [], 0, 0
        for job in self.waiting:
            take = []
            for i in job.order[job.next:]:
                n = max(longest, len(job.inputs[i]))
                if rows and (rows + 1) * n > self.tokens_per_forward:
                    break
                take.append(i)
                rows, longest = rows + 1, n
            if take:
                plan.append((job, take))
            if job.next + len(take) < len(job.inputs):
                break
        return plan

    @torch.no_grad()
    def step(self) -> bool:
        """One forward of what waits (`_plan`); False if there was nothing."""
        with self._lock:
            for job in [j for j in self.waiting if j.cancelled]:
                self.waiting.remove(job)
                self._finish(job, "cancelled")
            plan = self._plan()
        if not plan:
            return False
        hidden, mask = self.runner.lead_embed([job.inputs[i] for job, take in plan
                                               for i in take])
        self.model.mesh.ledger.clear()  # a long-running server's ledger stays bounded
        try:  # rank 0's alone: an error here fails these requests, not the server
            vectors = iter(self.pooling(hidden, mask))
        except Exception as e:  # noqa: BLE001 - the other requests go on
            for job, _ in plan:
                with self._lock:
                    self.waiting.remove(job)
                self._finish(job, "error", (500, f"the server failed on this request "
                                                 f"({type(e).__name__}: {e})"))
            return True
        for job, take in plan:
            for i in take:
                job.vectors[i] = next(vectors)
            job.next += len(take)
            with self.metrics.lock:
                self.metrics.prompt_tokens_computed += sum(len(job.inputs[i]) for i in take)
            if job.next == len(job.inputs):
                with self._lock:
                    self.waiting.remove(job)
                self._finish(job, "embedded")
        return True

    def _finish(self, job: EmbedJob, reason: str, error: tuple[int, str] | None = None
                ) -> None:
        with self.metrics.lock:
            self.metrics.requests[reason] += 1
            if reason == "embedded":
                self.metrics.prompt_tokens += job.tokens
                self.metrics.embedding_inputs += len(job.inputs)
        job._end(error)

    def fail_all(self, status: int, message: str) -> None:
        """Every waiting request fails with `status` (a worker died, shutting down)."""
        with self._lock:
            self.accepting = False
            doomed, self.waiting = list(self.waiting), deque()
        for job in doomed:
            self._finish(job, "error", (status, message))
