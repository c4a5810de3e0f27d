"""`Engine`: continuous batching over a preallocated KV pool (iteration-level scheduling,
as Orca and vLLM do it).

    engine = Engine(model, tokenizer=tok, max_batch=8)
    req = engine.submit(tok.encode("Tensor parallelism"), SamplingParams(max_tokens=32))
    print(tok.decode(list(req)))        # iterating steps the engine when no loop runs it

Every `step()`:
    1. drops the requests that were cancelled (their slot is free again);
    2. admits waiting requests, first come first served, while a slot is free, the
       tokens in flight (prompt + max_tokens of every running request) stay within
       `max_tokens_in_flight` and this step's prompts within `prefill_per_step` tokens
       (one at least; 0: no limit); each is prefilled alone into its slot and gets its
       first token (a request that does not fit waits; nothing running is evicted);
    3. decodes one token for every running request at once, each at its own position;
    4. finishes those that hit max_tokens, an end-of-sequence token or a stop string.
An error in what rank 0 does for one request alone (its generator, sampling,
log-probabilities, detokenizing, stop strings) fails that request with 500 and the
step goes on for the others; an error in a forward (every rank's) still ends the step.
So a short request never waits for a long one to finish. Sampling uses the request's
own seeded generator.

How a decode runs is `decode_chunk` (`tpkit.model.kv_pool`):
- None (the default, `tpkit serve` without --batch-invariant): one forward of the
  running requests' rows only, so one client pays for one row, eight for eight. A
  request's greedy tokens may then differ with what else runs where two tokens' logits
  are within rounding of each other (a 1-row product rounds otherwise than an 8-row).
- C (batch invariant: `--batch-invariant --decode-chunk C`): every decode runs fixed
  chunks of C slots (free ones padded; a chunk with no request is skipped), so the
  shapes of every forward are fixed by (max_batch, max_len, C) alone and a request's
  tokens and log-probabilities are bit for bit the same whatever the batch.

On tp ranks > 0 the same forwards run under `Runner.follow`; only this object (rank 0)
holds requests, the tokenizer and the sampler.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import deque

import torch
from torch import nn

from tpkit.model.sampling import sample
from tpkit.serve.metrics import Metrics
from tpkit.serve.params import SamplingParams, StopText
from tpkit.serve.request import Request, RequestFailed
from tpkit.serve.runner import Runner
from tpkit.spec.errors import UserError
from tpkit.weights.tokenizer import TextStream

PREFILL_PER_STEP = 256  # prompt tokens: at 16 clients of GPT-2 124M (2 cores), against no
# limit, the median time to first token and the 99th-percentile gap between tokens about
# halve, the slowest first token comes 15% later, throughput within 2% (docs/benchmarks.md)


class TooLong(UserError):
    """A request that can never fit the context or the server's budget (HTTP 413)."""


class Engine:
    """Requests in (`submit`), tokens out (`Request` handles); `step()` runs one iteration."""

    def __init__(self, model: nn.Module, *, tokenizer=None, max_batch: int = 8,
                 max_len: int | None = None, max_tokens_in_flight: int | None = None,
                 decode_chunk: int | None = None, prefill_per_step: int = PREFILL_PER_STEP,
                 runner: Runner | None = None) -> None:
        max_len = max_len or model.config.max_seq_len
        self.runner = runner or Runner(model, max_batch, max_len, decode_chunk)
        self.model, self.tokenizer = model, tokenizer
        self.max_batch, self.max_len = self.runner.slots, self.runner.pool.max_len
        self.budget = max_tokens_in_flight or self.max_batch * self.max_len
        if prefill_per_step < 0:
            raise UserError(f"prefill_per_step={prefill_per_step} must be >= 0 (0: no limit)")
        self.prefill_per_step = prefill_per_step
        self.eos = set(getattr(tokenizer, "eos_ids", None) or [])
        self.metrics = Metrics()
        self.tokenizer_lock = threading.Lock()  # HF tokenizers are not safe across threads
        self.looping = False  # True while a serving loop calls step(): handles just wait
        self.accepting = True
        self._lock, self._wake = threading.Lock(), threading.Condition()
        self._waiting: deque[Request] = deque()
        self._running: dict[int, Request] = {}
        self._ids = 0

    # -- requests in -------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams | None = None) -> Request:
        """Queue a prompt (token ids); returns its handle. `TooLong` if it can never fit,
        `RequestFailed` (503) once the engine stopped accepting."""
        params = params or SamplingParams()
        self.check(prompt_ids, params)
        with self._lock:
            if not self.accepting:
                raise RequestFailed(503, "the server is shutting down")
            self._ids += 1
            req = Request(self, self._ids, list(prompt_ids), params)
            self._waiting.append(req)
        with self._wake:
            self._wake.notify_all()
        return req

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """UserError (TooLong for length) for a request this engine cannot run."""
        n, vocab = len(prompt_ids), self.model.config.vocab_size
        if n == 0:
            raise UserError("the prompt is empty (it needs at least one token)")
        bad = sorted({t for t in prompt_ids if not (isinstance(t, int) and 0 <= t < vocab)})
        if bad:
            raise UserError(f"prompt token ids {bad[:5]} are outside the model's vocabulary [0, {vocab})")
        if params.stop and self.tokenizer is None:
            raise UserError("stop strings need a tokenizer (Engine(..., tokenizer=...))")
        need = n + params.max_tokens
        if need > self.max_len or need > self.budget:
            raise TooLong(f"the prompt ({n} tokens) + max_tokens ({params.max_tokens}) = "
                          f"{need} exceeds the context of {self.max_len} tokens" if need >
                          self.max_len else f"{need} tokens exceed the server's "
                          f"--max-tokens-in-flight={self.budget}")

    def wait_for_work(self, timeout: float) -> None:
        """Block until a request arrives (or `timeout` seconds)."""
        with self._wake:
            if not self._waiting and not self._running:
                self._wake.wait(timeout)

    @property
    def busy(self) -> bool:
        """Requests waiting or running."""
        return bool(self._waiting or self._running)

    # -- one iteration -----------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> bool:
        """Admit and prefill waiting requests, decode one token for all; False if idle."""
        for req in list(self._running.values()):
            if req.cancelled:
                self._end(req, "cancelled")
        admitted = self._admit()
        for req in admitted:
            if req.params.echo and req.params.logprobs is not None:  # the prompt's too
                logits = self.runner.lead_prefill(req.slot, req.prompt, every=True)  # [s, V]
                self._alone(req, self._score_prompt, req, logits[:-1])
                self._alone(req, self._take, req, logits[-1])
            else:
                logits = self.runner.lead_prefill(req.slot, req.prompt)
                self._alone(req, self._take, req, logits)
        active = [r for r in self._running.values() if not r.done]
        if active:
            tokens = torch.full((self.max_batch,), -1, dtype=torch.long)  # -1: a free slot
            lengths = torch.zeros(self.max_batch, dtype=torch.long)
            for r in active:
                tokens[r.slot] = r.tokens[-1]
                lengths[r.slot] = len(r.prompt) + len(r.tokens) - 1  # positions cached
            greedy = self.model.group.size > 1 and all(  # the shards' best, not their logits
                r.params.temperature <= 0 and r.params.logprobs is None for r in active)
            logits = self.runner.lead_decode(tokens, lengths, greedy)  # [max_batch, V or 2]
            for r in active:
                if greedy:
                    self._alone(r, self._push, r, int(logits[r.slot, 0]),
                                float(logits[r.slot, 1]), None)
                else:
                    self._alone(r, self._take, r, logits[r.slot])
        self._account(len(active))
        return bool(admitted or active)

    def _admit(self) -> list[Request]:
        out, prefill = [], 0  # admitted, and their prompt tokens
        with self._lock:
            while self._waiting:
                req = self._waiting[0]
                if req.cancelled:
                    self._waiting.popleft()
                    req.finish("cancelled")
                    continue
                free = [s for s in range(self.max_batch) if s not in self._running]
                held = sum(len(r.prompt) + r.params.max_tokens for r in self._running.values())
                if not free or held + len(req.prompt) + req.params.max_tokens > self.budget:
                    break  # first come, first served: it waits, and those behind it
                if out and self.prefill_per_step and \
                        prefill + len(req.prompt) > self.prefill_per_step:
                    break  # the next step: the running requests decode in between
                self._waiting.popleft()
                try:
                    self._start(req)
                except Exception as e:  # noqa: BLE001 - an unchecked seed: this one fails
                    self._fail(req, e)
                    continue
                prefill += len(req.prompt)
                req.slot = free[0]
                self._running[req.slot] = req
                out.append(req)
        return out

    def _start(self, req: Request) -> None:
        """A request's generator, detokenizer and stop strings, as it is admitted."""
        seed = req.params.seed if req.params.seed is not None else \
            int.from_bytes(os.urandom(8), "little") >> 1
        req.gen = torch.Generator(self.runner.device).manual_seed(seed)
        req.stream = TextStream(self.tokenizer) if self.tokenizer else None
        req.stop_text = StopText(req.params.stop)

    def _alone(self, req: Request, work, *args) -> None:
        """work(*args) for `req` alone (rank 0's, no collective): an error fails `req`."""
        if req.done:  # failed already (scoring its prompt)
            return
        try:
            work(*args)
        except Exception as e:  # noqa: BLE001 - the other requests go on
            with self._lock:
                if self._running.get(req.slot) is req:
                    del self._running[req.slot]
            self._fail(req, e)

    def _fail(self, req: Request, e: Exception) -> None:
        why = f"the server failed on this request ({type(e).__name__}: {e})"
        print(f"tpkit: request {req.id}: {why}", file=sys.stderr, flush=True)
        req.fail(500, why)
        with self.metrics.lock:
            self.metrics.requests["error"] += 1

    def _score_prompt(self, req: Request, logits: torch.Tensor) -> None:
        """Log-probabilities of prompt tokens 1..s-1 from the logits [s-1, V] before them."""
        logp = torch.log_softmax(logits.float(), -1)  # [s-1, V]
        chosen = logp.gather(1, torch.tensor(req.prompt[1:], device=logp.device)[:, None])
        req.prompt_logprobs = [None, *chosen[:, 0].tolist()]
        req.prompt_top = [None, *_likeliest(logp, req.params.logprobs or 0)]

    def _take(self, req: Request, logits: torch.Tensor) -> None:
        """The next token of `req` from its full logits [V]; finish it if it ends here."""
        p = req.params
        tok = int(sample(logits[None], p.temperature, p.top_k, p.top_p, req.gen)[0, 0])
        logp = torch.log_softmax(logits.float(), -1)  # [V]
        top = _likeliest(logp[None], p.logprobs)[0] if p.logprobs is not None else None
        self._push(req, tok, float(logp[tok]), top)

    def _push(self, req: Request, tok: int, logprob: float, top) -> None:
        """Give `req` its next token; finish it if it ends here."""
        p = req.params
        piece = ""
        if req.stream is not None:
            with self.tokenizer_lock:
                piece = req.stream.push([tok])
        shown, hit = req.stop_text.add(piece)
        before = req.last_at
        req.push(tok, logprob, shown, top)
        if before is not None:
            with self.metrics.lock:
                self.metrics.itl.observe(req.last_at - before)
        if hit:
            self._end(req, "stop", by_string=True)
        elif tok in self.eos and not p.ignore_eos:
            self._end(req, "stop")
        elif len(req.tokens) >= p.max_tokens:
            self._end(req, "length")

    def _end(self, req: Request, reason: str, by_string: bool = False) -> None:
        tail = ""
        if reason != "cancelled" and req.stream is not None:
            if not by_string:  # an incomplete character at the end, then what was held
                with self.tokenizer_lock:
                    tail, by_string = req.stop_text.add(req.stream.flush())
            tail += req.stop_text.flush()
        with self._lock:
            self._running.pop(req.slot, None)
        req.finish(reason, tail)
        with self.metrics.lock:
            self.metrics.requests[reason] += 1
            self.metrics.prompt_tokens += len(req.prompt)
            self.metrics.generation_tokens += len(req.tokens)
            if req.first_at is not None:
                self.metrics.ttft.observe(req.first_at - req.arrived)

    def _account(self, batch: int) -> None:
        ledger = self.model.mesh.ledger
        with self.metrics.lock:
            self.metrics.batch_size, self.metrics.queue_length = batch, len(self._waiting)
            self.metrics.collectives.update(r.op for r in ledger.records)
        ledger.clear()  # counted: the ledger of a long-running server stays bounded

    # -- the end -----------------------------------------------------------------------
    def fail_all(self, status: int, message: str) -> None:
        """Every waiting and running request fails with `status` (a worker died...)."""
        with self._lock:
            self.accepting = False
            doomed = list(self._waiting) + list(self._running.values())
            self._waiting.clear()
            self._running.clear()
        for req in doomed:
            req.fail(status, message)
            with self.metrics.lock:
                self.metrics.requests["error"] += 1

    def stop_accepting(self) -> None:
        """New submissions get 503; what was submitted runs on."""
        with self._lock:
            self.accepting = False


def _likeliest(logp: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    """The k likeliest (token, log-probability) of each row of logp [n, V], likeliest first."""
    values, ids = logp.topk(k, dim=-1)  # [n, k]
    return [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
