"""`Seq`: a request as the engine runs it — the scheduler's and the output processor's
state of one sequence, beside its caller's handle (`serve.request.Request`).

    handle = Request(rid, prompt, params)    # what the caller and the HTTP threads hold
    seq = Seq(handle, group)                 # what the engine's thread writes

Who writes what (structural, not a convention):
- `Seq`: made in `Engine.submit` (the caller's thread, before the engine sees it), then
  written by the engine's thread alone: the scheduler (`serve.scheduler`: slot, blocks,
  computed, ...), the output processor (`serve.output`: tokens, generator, text
  stream, stop strings, grammar matcher, prompt scores) and speculation
  (`serve.speculate`, `serve.draft`: read only; their own state is keyed by `id`).
- `Request`: the caller's threads call `cancel`, `attach`, iterate and read; the engine's
  thread writes it only through `push`, `finish` and `fail` (its events and output).
The engine reads one thing of the handle while it runs: `cancelled` (a threading.Event).
"""

from __future__ import annotations

from tpkit.serve.request import Request


class Seq:
    """One sequence's scheduling and output state (the engine's thread writes it)."""

    def __init__(self, handle: Request, group: int | None = None) -> None:
        self.handle = handle  # the caller's: events and output go there (push/finish/fail)
        self.id, self.prompt, self.params = handle.id, handle.prompt, handle.params
        self.group = handle.id if group is None else group  # one POST's share one: they
        # take turns with others' (`Scheduler._turns`)
        self.tokens: list[int] = []  # generated so far (the handle gets each by `push`)
        # the scheduler's (`serve.scheduler`)
        self.slot: int | None = None  # its place among the running (None: not running)
        self.preempted = False  # waiting to be computed again (first in line)
        self.blocks: list[int] = []  # its KV block table
        self.computed = 0  # tokens (prompt, then generated) whose keys are in its blocks
        self.cached = 0  # blocks of its prompt found in the prefix cache (not computed)
        self.registered = 0  # its full blocks entered in the prefix cache
        self.prefill_end = 0  # tokens computed as a prefill since it was (re)admitted
        self.keys: tuple[int, list[int]] = (0, [])  # its full blocks' chain keys, at a length
        self.waits: tuple[Seq, int, int] | None = None  # (the sequence computing its
        # prefix, that one's computed tokens when last seen, steps without progress since)
        # the output processor's (`serve.output.OutputProcessor.start`)
        self.gen = None  # its torch.Generator (its seed's)
        self.stream = None  # its detokenizer (`TextStream`; None: no tokenizer)
        self.stop_text = None  # its stop strings' matcher (`StopText`)
        self.stopped_by_string = False
        self.matcher = None  # its grammar's matcher (structured outputs), or None
        self.prompt_logprobs: list[float | None] = []  # with echo + logprobs: None, then
        self.prompt_top: list[list[tuple[int, float]] | None] = []  # each prompt token's
        self.scored = False  # prompt scores the handle has not been given yet

    @property
    def cancelled(self) -> bool:
        """Did its caller cancel it (`Request.cancel`)?"""
        return self.handle.cancelled

    @property
    def done(self) -> bool:
        """Finished, cancelled or failed (its handle was told)."""
        return self.handle.done

    def cached_tokens(self, block_size: int) -> int:
        """Its prompt's tokens the prefix cache gave (OpenAI's usage `cached_tokens`)."""
        return min(len(self.prompt), self.cached * block_size)
