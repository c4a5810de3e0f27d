"""The output processor: what rank 0 makes of a step's logits, request by request —
sampling (each request's own seeded generator), log-probabilities, the detokenizer
(text safe to show) and stop strings — into each sequence's state (`serve.sequence.Seq`)
and its handle's events (`Request.push`).

    outputs = OutputProcessor(tokenizer, eos_ids)
    outputs.start(seq)                              # its generator, text stream, stops
    why = outputs.take(seq, logits)                 # None, or "stop" / "length"
    why = outputs.chosen(seq, token, logprob)       # a token chosen on the greedy path
    tail = outputs.tail(seq)                        # the text still held at the end

Nothing here runs a forward or touches the KV cache; an error here is one request's
(`Engine` fails it alone).
"""

from __future__ import annotations

import os
import threading

import torch

from tpkit.decode.sampling import sample, seeded
from tpkit.serve.grammar import Grammars
from tpkit.serve.logits import process
from tpkit.serve.params import StopText
from tpkit.serve.sequence import Seq
from tpkit.weights.tokenizer import TextStream


class OutputProcessor:
    """Tokens and text out of logits, for rank 0's requests."""

    def __init__(self, tokenizer=None, eos: set[int] | None = None, vocab: int = 0) -> None:
        self.tokenizer, self.eos = tokenizer, eos or set()
        self.lock = threading.Lock()  # HF tokenizers are not safe across threads
        self.grammars = Grammars(tokenizer, vocab)  # structured outputs' matchers

    def start(self, req: Seq, device=None) -> None:
        """A request's generator (its seed, or a fresh one), detokenizer, stop strings."""
        seed = req.params.seed if req.params.seed is not None else \
            int.from_bytes(os.urandom(8), "little") >> 1
        req.gen = seeded(seed, device or "cpu")  # all 64 bits of the seed count
        req.stream = TextStream(self.tokenizer) if self.tokenizer else None
        req.stop_text = StopText(req.params.stop)
        req.stopped_by_string = False
        req.matcher = self.grammars.matcher(req.params.grammar) if req.params.grammar \
            else None
        if req.params.echo and req.params.logprobs is not None:
            req.prompt_logprobs, req.prompt_top = [None], [None]  # nothing before token 0
            req.scored = True

    def score(self, req: Seq, logits: torch.Tensor, first: int) -> None:
        """Log-probabilities of prompt tokens first.. from the logits [n, V] before them."""
        n = min(logits.shape[0], len(req.prompt) - first)
        if n <= 0:
            return
        logp = torch.log_softmax(logits[:n].float(), -1)  # [n, V]
        ids = torch.tensor(req.prompt[first:first + n], device=logp.device)[:, None]
        req.prompt_logprobs += logp.gather(1, ids)[:, 0].tolist()
        req.prompt_top += _likeliest(logp, req.params.logprobs or 0)
        req.scored = True  # the handle gets them with the next token

    def take(self, req: Seq, logits: torch.Tensor) -> str | None:
        """The next token of `req` from its full logits [V] (shaped by its penalties and
        bias first, `serve.logits`; its log-probabilities are the model's); why it ends
        here, if it does."""
        p = req.params
        chosen = process(logits, p, req.prompt, req.tokens, self.eos)  # penalties, bias
        if req.matcher is not None:  # the grammar's mask (structured outputs)
            chosen = chosen.float().masked_fill(~req.matcher.allowed(chosen.shape[-1]),
                                                float("-inf"))
        tok = int(sample(chosen[None], p.temperature, p.top_k, p.top_p, req.gen)[0, 0])
        logp = torch.log_softmax(logits.float(), -1)  # [V]
        top = _likeliest(logp[None], p.logprobs)[0] if p.logprobs is not None else None
        return self.chosen(req, tok, float(logp[tok]), top)

    def chosen(self, req: Seq, tok: int, logprob: float, top=None) -> str | None:
        """`req`'s next token, chosen (by `take`, or on the greedy path: the shards' best,
        its grammar's mask applied on every rank, `serve.masks`): its grammar moved on,
        then `push`; why it ends here ("stop" too once the grammar is complete)."""
        if req.matcher is not None:
            req.matcher.take(tok)
        why = self.push(req, tok, logprob, top)
        return "stop" if why is None and req.matcher is not None and req.matcher.done \
            else why

    def push(self, req: Seq, tok: int, logprob: float, top=None) -> str | None:
        """Give `req` and its handle its next token (the handle: and the text it makes
        safe to show, and the prompt's scores if new); why it ends here ("stop",
        "length"), or None."""
        p = req.params
        piece = ""
        if req.stream is not None:
            with self.lock:
                piece = req.stream.push([tok])
        shown, hit = req.stop_text.add(piece)
        req.tokens.append(tok)
        scores = (list(req.prompt_logprobs), list(req.prompt_top)) if req.scored else None
        req.scored = False
        req.handle.push(tok, logprob, shown, top, scores)
        if hit:
            req.stopped_by_string = True
            return "stop"
        if tok in self.eos and not p.ignore_eos:
            return "stop"
        return "length" if len(req.tokens) >= p.max_tokens else None

    def tail(self, req: Seq) -> str:
        """The text still held back at the end (an incomplete character, a stop string's
        possible beginning)."""
        if req.stream is None:
            return ""
        text, by_string = "", req.stopped_by_string
        if not by_string:
            with self.lock:
                text, by_string = req.stop_text.add(req.stream.flush())
        return text + req.stop_text.flush()


def _likeliest(logp: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
    """The k likeliest (token, log-probability) of each row of logp [n, V], likeliest first."""
    values, ids = logp.topk(k, dim=-1)  # [n, k]
    return [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
