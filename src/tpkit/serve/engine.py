"""`Engine`: continuous batching over a paged KV cache, in three parts with typed data
between them (vLLM v1's shape):

    scheduler (`serve.scheduler`)  -> SchedulerOutput: the forwards of this step
    executor  (`serve.runner`)     -> broadcast of the plan, the forwards on every rank
    outputs   (`serve.output`)     -> sampling, log-probabilities, text, stop strings

    engine = Engine(model, tokenizer=tok, max_batch=8)
    done = engine.generate([tok.encode("Tensor parallelism")], SamplingParams(max_tokens=32))
    print(tok.decode(done[0].tokens))
    req = engine.submit(ids, params)     # with a serving loop stepping it (`serve.loop`)

Every `step()` drops the requests that were cancelled (their blocks are free again),
asks the scheduler for a plan, has the executor run it, and gives each request its
token (or, for a piece of a prompt, nothing yet). An error in what rank 0 does for one
request alone (sampling, log-probabilities, detokenizing, stop strings) fails that
request with 500 and the step goes on for the others; an error in a forward (every
rank's) ends the step. Nothing else steps the engine: a `Request` handle only waits.

KV memory: blocks of 16 tokens (`decode.paged_kv`), taken as requests need them and
kept for the prefix cache, at most `kv_cache_bytes` per rank (default: what
max_batch x max_len tokens take, today's worst case, never reserved up front).

Prompt tokens per step (default mode): at most `prefill_per_step`; while requests
decode and `itl_ratio` > 0 (`tpkit serve --itl-ratio 1.5`; 0, off, the default: pacing
costs throughput when many clients start together), also what keeps the
step within `itl_ratio` x a decode-only step, learnt from the steps' wall times
(`serve.pacing`): a long prompt's time to first token traded for the running streams'
inter-token latency (its budget and learnt costs: the tpkit_pacing_* gauges of /metrics).

How a decode runs is `decode_chunk`:
- None (the default, `tpkit serve` without --batch-invariant): one forward per step of
  every decode and every piece of a prompt, so one client pays for one row. A
  request's greedy tokens may then differ with what else runs where two tokens' logits
  are within rounding of each other.
- C (batch invariant: `--batch-invariant --decode-chunk C`): decodes in forwards of
  exactly C rows, prompts in pieces cut at multiples of `piece` tokens, each its own
  forward: a request's tokens and log-probabilities are bit for bit the same whatever
  else runs, and with or without the prefix cache (`serve.scheduler`), for a model
  with decode-only weights (`decode.forms.for_decode`, what `tpkit serve` loads): MKL's
  `F.linear` of a trainable one may round a row by its place among the rows.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from tpkit.decode.paged_kv import EVERY, LAST, PagedCache
from tpkit.serve.blocks import BlockPool
from tpkit.serve.config import PREFILL_PER_STEP, refuse
from tpkit.serve.logits import shaped
from tpkit.serve.masks import Lead
from tpkit.serve.metrics import Metrics, Pacing
from tpkit.serve.output import OutputProcessor
from tpkit.serve.pacing import Pacer
from tpkit.serve.params import SamplingParams
from tpkit.serve.request import Request, RequestFailed, Token
from tpkit.serve.runner import Runner
from tpkit.serve.scheduler import Scheduler, SchedulerOutput
from tpkit.serve.sequence import Seq
from tpkit.serve.speculate import Speculator
from tpkit.spec.errors import UserError

PIECE = 64  # the batch-invariant mode's prompt pieces (a multiple of the block size)


class TooLong(UserError):
    """A request that can never fit the context or the server's budget (HTTP 413)."""


class Intake:
    """What the serving loop (`serve.loop`) needs of an engine besides its steps: one lock
    over submissions, refused (503) once `stop_accepting` was called, each given the next
    id, and a wake-up for the loop waiting for work; and rank 0's executor (`runner`, the
    one built on rank 0; a follower's: `serve.workers`). `Engine` and `Embedder` are ones."""

    def __init__(self, model: nn.Module, runner: Runner | None = None) -> None:
        self.runner = runner or Runner(model)
        self.looping = False  # True while a serving loop calls step()
        self.stepping: float | None = None  # when the loop's step in flight began (monotonic)
        self.accepting = True
        self._lock, self._wake = threading.Lock(), threading.Condition()
        self._ids = 0

    @property
    def busy(self) -> bool:
        """Work waiting or running (each engine says what)."""
        raise NotImplementedError

    @contextmanager
    def _intake(self) -> Iterator[int]:
        """Under the lock: RequestFailed (503) once not accepting, else the next id; the
        loop is woken after."""
        with self._lock:
            if not self.accepting:
                raise RequestFailed(503, "the server is shutting down")
            self._ids += 1
            yield self._ids
        with self._wake:
            self._wake.notify_all()

    def wait_for_work(self, timeout: float) -> None:
        """Block until a request arrives (or `timeout` seconds)."""
        with self._wake:
            if not self.busy:
                self._wake.wait(timeout)

    def stop_accepting(self) -> None:
        """New submissions get 503; what was submitted runs on."""
        with self._lock:
            self.accepting = False


class Engine(Intake):
    """Requests in (`submit`), tokens out (`Request` handles); `step()` runs one iteration."""

    def __init__(self, model: nn.Module, *, tokenizer=None, max_batch: int = 8,
                 max_len: int | None = None, max_tokens_in_flight: int | None = None,
                 decode_chunk: int | None = None, prefill_per_step: int = PREFILL_PER_STEP,
                 kv_cache_bytes: int | None = None, prefix_caching: bool = True,
                 piece: int = PIECE, itl_ratio: float = 0.0,
                 runner: Runner | None = None, speculator: Speculator | None = None,
                 adapters=None) -> None:
        refuse(itl_ratio=itl_ratio, prefill_per_step=prefill_per_step, max_batch=max_batch,
               decode_chunk=decode_chunk)  # `ServeConfig`'s checks, by their fields
        max_len = max_len or model.config.max_seq_len
        if max_len > model.config.max_seq_len:
            raise UserError(f"max_len={max_len} exceeds the model's max_seq_len="
                            f"{model.config.max_seq_len}")
        super().__init__(model, runner or Runner(model, adapters=adapters))
        self.n_adapters = len(self.runner.adapters or ())  # served LoRA adapters 1..n
        block_size = self.runner.cache.block_size  # every rank's (runner.BLOCK_SIZE)
        self.model, self.tokenizer = model, tokenizer
        self.max_batch, self.max_len = max_batch, max_len
        self.block_bytes = PagedCache.block_bytes(model, block_size)
        per_seq = -(-max_len // block_size)
        blocks = max_batch * per_seq if kv_cache_bytes is None else \
            kv_cache_bytes // self.block_bytes
        if blocks < 1:
            raise UserError(f"kv_cache_bytes={kv_cache_bytes} holds no block of "
                            f"{self.block_bytes} bytes ({block_size} tokens)")
        self.kv_cache_bytes = blocks * self.block_bytes
        self.pool = BlockPool(block_size, blocks + 1, caching=prefix_caching)
        self.budget = max_tokens_in_flight or max_batch * max_len
        self.scheduler = Scheduler(self.pool, max_batch=max_batch,
                                   max_tokens_in_flight=self.budget,
                                   prefill_per_step=prefill_per_step,
                                   chunk=None if decode_chunk is None
                                   else min(decode_chunk, max_batch),
                                   piece=max(block_size, piece // block_size * block_size),
                                   speculator=speculator)
        self.speculator = speculator  # n-gram speculation (`serve.speculate`), or None
        # the batch-invariant mode's pieces are fixed: nothing to pace
        self.pacer = Pacer(itl_ratio) if itl_ratio and decode_chunk is None else None
        self.paced = 0  # the pacer's budget for the last step with a prompt to compute
        self.outputs = OutputProcessor(tokenizer, set(getattr(tokenizer, "eos_ids", None)
                                                      or []), model.config.vocab_size)
        self.tokenizer_lock = self.outputs.lock
        self.masks = Lead(model.group.size > 1)  # grammars' masks on every rank's shard
        self.metrics = Metrics()

    # -- requests in -------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], params: SamplingParams | None = None,
               group: int | None = None) -> Request:
        """Queue a prompt (token ids); returns its handle. `TooLong` if it can never fit,
        `RequestFailed` (503) once the engine stopped accepting. `group`: an earlier
        request's id, whose turns it shares (one POST's prompts and choices: `scheduler`)."""
        params = self.to_the_end(len(prompt_ids), params or SamplingParams())
        self.check(prompt_ids, params)
        with self._intake() as rid:
            req = Request(rid, list(prompt_ids), params)  # the caller's handle
            seq = Seq(req, group)  # the engine's: its thread alone writes it from here on
            try:
                self.outputs.start(seq, self.runner.device)
            except Exception as e:  # noqa: BLE001 - an unchecked seed: this one fails
                self._fail(seq, e)
                return req
            self.scheduler.waiting.append(seq)
        return req

    def generate(self, prompts: list[list[int]], params: SamplingParams |
                 list[SamplingParams] | None = None, on_token=None) -> list[Request]:
        """Run `prompts` (token ids) to the end, stepping the engine here; the finished
        requests in order (`tpkit generate` and the Python API). `on_token(req, text)`:
        called with each piece of text as it becomes safe to show."""
        if self.looping:
            raise RuntimeError("a serving loop steps this engine: submit() instead")
        each = params if isinstance(params, list) else [params] * len(prompts)
        reqs = [self.submit(p, q) for p, q in zip(prompts, each)]
        while not all(r.done for r in reqs):
            self.step()
            while on_token is not None and any(not r.events.empty() for r in reqs):
                for r in reqs:
                    while not r.events.empty():
                        ev = r.events.get_nowait()
                        if isinstance(ev, Token) and ev.text:
                            on_token(r, ev.text)
        return reqs

    def to_the_end(self, n: int, params: SamplingParams) -> SamplingParams:
        """`params` with max_tokens None (a chat request without one, as OpenAI's) made
        what is left after a prompt of `n` tokens: of the context, the server's budget
        and the KV cache, whichever is least; TooLong if nothing is left."""
        if params.max_tokens is not None:
            return params
        room = min(self.max_len, self.budget,
                   (self.pool.max_blocks - 1) * self.pool.block_size) - n
        if room < 1:
            raise TooLong(f"the prompt ({n} tokens) leaves no room to generate in the "
                          f"context of {min(self.max_len, self.budget)} tokens")
        return dataclasses.replace(params, max_tokens=room)

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """UserError (TooLong for length) for a request this engine cannot run."""
        n, vocab = len(prompt_ids), self.model.config.vocab_size
        if n == 0:
            raise UserError("the prompt is empty (it needs at least one token)")
        bad = sorted({t for t in prompt_ids if not (isinstance(t, int) and 0 <= t < vocab)})
        if bad:
            raise UserError(f"prompt token ids {bad[:5]} are outside the model's vocabulary [0, {vocab})")
        far = [t for t, _ in params.logit_bias if t >= vocab]
        if far:
            raise UserError(f"logit_bias names token ids {far[:5]} outside the model's "
                            f"vocabulary [0, {vocab})")
        if not 0 <= params.adapter <= self.n_adapters:
            raise UserError(f"adapter={params.adapter} is not served (0..{self.n_adapters})")
        if params.stop and self.tokenizer is None:
            raise UserError("stop strings need a tokenizer (Engine(..., tokenizer=...))")
        need = n + params.max_tokens
        if need > self.max_len:
            raise TooLong(f"the prompt ({n} tokens) + max_tokens ({params.max_tokens}) = "
                          f"{need} exceeds the context of {self.max_len} tokens")
        if need > self.budget:
            raise TooLong(f"{need} tokens exceed the server's --max-tokens-in-flight="
                          f"{self.budget}")
        if -(-need // self.pool.block_size) > self.pool.max_blocks - 1:
            raise TooLong(f"{need} tokens exceed the KV cache of {self.pool.max_blocks - 1} "
                          f"blocks of {self.pool.block_size} (--kv-cache-bytes="
                          f"{self.kv_cache_bytes})")

    @property
    def busy(self) -> bool:
        """Requests waiting or running."""
        return bool(self.scheduler.waiting or self.scheduler.running)

    # -- one iteration -----------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> bool:
        """Schedule, run, and hand out one step's tokens; False if there was nothing."""
        began = time.perf_counter()
        with self._lock:
            for seq in [*self.scheduler.running, *self.scheduler.waiting]:
                if seq.cancelled:
                    self._end(seq, "cancelled")
            start = self.scheduler.prompt_start() if self.pacer else None
            budget = None if start is None else self.pacer.budget(start)
            out = self.scheduler.schedule(budget)
        if budget is not None:
            self.paced = budget
        for seq in out.preempted:  # recomputed from its first token: scored again
            seq.prompt_logprobs, seq.prompt_top = seq.prompt_logprobs[:1], seq.prompt_top[:1]
        if out.empty:
            self._account(out)
            return False
        grew = out.blocks > self.runner.cache.blocks  # copies the cache: not the pieces' cost
        reqs = [r for f in out.forwards for r in f.reqs if r is not None]
        greedy = all(r.params.temperature <= 0 and r.params.logprobs is None and not
                     shaped(r.params)  # the shards' best, not their logits (tp=1: one
                     for r in reqs)  # native pass); penalties and bias need the logits
        masks = self.masks.plan(out.forwards, greedy)  # grammars': every rank's shard
        results = self.runner.lead_step([f.pieces for f in out.forwards], out.blocks, greedy,
                                        masks)
        computed = time.perf_counter()  # the tokens' delivery after: paid with or without rows
        self.scheduler.computed(out)
        verify: dict[Seq, list[torch.Tensor]] = {}  # a speculated sequence's rows
        for fwd, (last, rest) in zip(out.forwards, results):
            j = k = 0  # rows of `last`, entries of `rest`
            for piece, seq in zip(fwd.pieces, fwd.reqs):
                row = None
                if piece.logits in (LAST, EVERY):
                    row, j = last[j], j + 1
                if seq is None or row is None:
                    continue
                if seq.id in out.drafts:
                    verify.setdefault(seq, []).append(row)
                    continue
                other = None
                if piece.logits == EVERY:
                    other, k = rest[k], k + 1
                self._alone(seq, self._take, seq, piece, row, other, greedy)
        for seq, rows in verify.items():
            self._alone(seq, self._verify, seq, out.drafts[seq.id], rows, greedy)
        if self.pacer is not None and not grew:  # this step's cost, tokens handed out too
            self.pacer.observe(time.perf_counter() - began, out.decodes, out.prefill)
        if self.speculator is not None and not grew and not out.prefill:  # a row's cost
            self.speculator.observe(out, computed - began)
        self._account(out)
        return True

    def _take(self, seq: Seq, piece, row: torch.Tensor, other, greedy: bool) -> None:
        end = piece.start + len(piece.tokens) == len(seq.prompt) + len(seq.tokens)
        if other is not None:  # an echoed prompt's own log-probabilities
            logits = torch.cat([other, row[None]]) if end is False else other
            self.outputs.score(seq, logits, piece.start + 1)
        if not end:
            return
        why = self._give(seq, row, greedy)
        if why is not None:
            self._end(seq, why)

    def _give(self, seq: Seq, row: torch.Tensor, greedy: bool) -> str | None:
        """`seq`'s next token from its row (greedy: [token, log-probability]; else its
        full logits); why it ends there, or None."""
        if greedy:
            why = self.outputs.chosen(seq, int(row[0]), float(row[1]))
        else:
            why = self.outputs.take(seq, row)
        if len(seq.tokens) > 1:
            with self.metrics.lock:
                self.metrics.itl.observe(seq.handle.last_at - seq.handle.prev_at)
        return why

    def _verify(self, seq: Seq, draft: list[int], rows: list, greedy: bool) -> None:
        """A speculated request's tokens from its verify rows, its KV rolled back past
        the last one kept (`serve.speculate`)."""
        why = self.speculator.accept(seq, draft, rows, lambda r: self._give(seq, r, greedy))
        if why is not None:
            self._end(seq, why)
        else:
            self.scheduler.rolled_back(seq)

    def _alone(self, seq: Seq, work, *args) -> None:
        """work(*args) for `seq` alone (rank 0's, no collective): an error fails `seq`."""
        if seq.done:
            return
        try:
            work(*args)
        except Exception as e:  # noqa: BLE001 - the other requests go on
            self._fail(seq, e)

    def _fail(self, seq: Seq, e: Exception) -> None:
        why = f"the server failed on this request ({type(e).__name__}: {e})"
        print(f"tpkit: request {seq.id}: {why}", file=sys.stderr, flush=True)
        self.scheduler.finish(seq)
        seq.handle.fail(500, why)
        with self.metrics.lock:
            self.metrics.requests["error"] += 1

    def _end(self, seq: Seq, reason: str) -> None:
        tail = self.outputs.tail(seq) if reason != "cancelled" else ""
        self.scheduler.finish(seq)
        seq.handle.finish(reason, tail, seq.cached_tokens(self.pool.block_size))
        with self.metrics.lock:
            self.metrics.requests[reason] += 1
            self.metrics.prompt_tokens += len(seq.prompt)
            self.metrics.generation_tokens += len(seq.tokens)
            if (at := seq.handle.first_at) is not None:
                self.metrics.ttft.observe(at - seq.handle.arrived)

    def _account(self, out: SchedulerOutput) -> None:
        ledger = self.model.mesh.ledger
        with self.metrics.lock:
            m = self.metrics
            m.batch_size, m.queue_length = len(self.scheduler.running), len(self.scheduler.waiting)
            m.collectives.update(r.op for r in ledger.records)
            m.prompt_tokens_computed += out.prompt_tokens
            m.prefix_hit_tokens += sum(r.cached for r in out.admitted) * self.pool.block_size
            m.kv_blocks_used, m.kv_bytes = self.pool.in_use, self.runner.cache.nbytes()
            m.preemptions += len(out.preempted)
            if self.speculator is not None:
                m.speculated = (self.speculator.proposed, self.speculator.accepted)
            if self.pacer is not None:
                p = self.pacer
                m.pacing = Pacing(p.ratio, self.paced, p.decode_s, p.costs())
        ledger.clear()  # counted: the ledger of a long-running server stays bounded

    # -- the end -----------------------------------------------------------------------
    def fail_all(self, status: int, message: str) -> None:
        """Every waiting and running request fails with `status` (a worker died...)."""
        with self._lock:
            self.accepting = False
            doomed = [*self.scheduler.waiting, *self.scheduler.running]
            for seq in doomed:
                self.scheduler.finish(seq)
        for seq in doomed:
            seq.handle.fail(status, message)
            with self.metrics.lock:
                self.metrics.requests["error"] += 1

