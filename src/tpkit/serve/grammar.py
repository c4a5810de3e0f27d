"""Structured outputs: a request's `response_format` as a grammar, and per request a
matcher that says which tokens may come next (llguidance, a Rust engine with no
dependencies: it computes each step's mask on the fly, ~0.1 ms for a JSON schema here,
with no per-tokenizer compilation; xgrammar would pull triton into a CPU install).

    grammar = from_response_format({"type": "json_schema", "json_schema": {...}})
    matcher = Grammars(tokenizer, vocab).matcher(grammar)    # one per request (choice)
    logits[~matcher.allowed()] = -inf; ...; matcher.take(token)

JSON is compact (no free whitespace: a model cannot wander in blanks). A schema the
engine cannot compile is a `UserError` naming the construct; schemas are compiled once
and kept (`from_response_format` caches by the schema's text). A greedy request's mask
is applied on every tp rank to its own vocabulary shard (`bits()`, the same on every
rank: `serve.masks`); a sampled request's to rank 0's full logits before the draw
(which needs them gathered anyway): the same mask at any tp.
"""

from __future__ import annotations

import functools
import json

import numpy as np
import torch

from tpkit.spec.errors import UserError

COMPACT = {"whitespace_flexible": False}


def from_response_format(fmt: dict) -> str | None:
    """The grammar of OpenAI's `response_format` (None: plain text); UserError for one
    that is not valid or that the engine cannot compile, naming the construct."""
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return _compiled(json.dumps({"type": "object"}))
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
            raise UserError("json_schema must be an object with a 'schema' object (and a "
                            "'name')")
        return _compiled(json.dumps(spec.get("schema", {}), sort_keys=True))
    raise UserError(f"type={kind!r} must be 'text', 'json_object' or 'json_schema'")


def from_schema(schema: dict) -> str:
    """The grammar of a JSON schema (tool calls' arguments use it too)."""
    return _compiled(json.dumps(schema, sort_keys=True))


@functools.lru_cache(maxsize=256)
def _compiled(schema: str) -> str:
    import llguidance

    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=COMPACT)
    except ValueError as e:
        raise UserError(f"the schema is not valid JSON schema: {e}") from None
    why = llguidance.LLMatcher.validate_grammar(grammar)
    if why and not why.startswith("WARNING"):
        raise UserError(f"the schema cannot be compiled: {why}")
    return grammar


class Grammars:
    """The engine's tokenizer as llguidance sees it (built once, on first use)."""

    def __init__(self, tokenizer, vocab: int) -> None:
        self.tokenizer, self.vocab = tokenizer, vocab

    @functools.cached_property
    def _ll(self):
        import llguidance.hf

        hf = getattr(self.tokenizer, "hf", None)
        if hf is None:
            raise UserError("structured outputs need a Hugging Face tokenizer")
        eos = list(getattr(self.tokenizer, "eos_ids", None) or []) or None
        return llguidance.hf.from_tokenizer(hf, n_vocab=self.vocab, eos_token=eos)

    def matcher(self, grammar: str) -> Matcher:
        """A fresh matcher of `grammar` (one per generated sequence)."""
        import llguidance

        m = llguidance.LLMatcher(self._ll, grammar, log_level=0)
        if m.is_error():
            raise UserError(f"the grammar cannot be used: {m.get_error()}")
        return Matcher(m, self.vocab)


class Matcher:
    """Where one sequence is in its grammar: the tokens allowed next, the token taken."""

    def __init__(self, m, vocab: int) -> None:
        self.m, self.vocab = m, vocab

    def allowed(self, width: int) -> torch.Tensor:
        """bool [width]: the tokens the grammar allows next (none past the vocabulary)."""
        bits = np.unpackbits(np.frombuffer(self.m.compute_bitmask(), np.uint8),
                             bitorder="little")[:min(width, self.vocab)].astype(bool)
        return torch.from_numpy(np.pad(bits, (0, width - len(bits))))

    @property
    def words(self) -> int:
        """32-bit words of `bits()`."""
        return -(-self.vocab // 32)

    def bits(self) -> np.ndarray:
        """int32 [words]: the tokens allowed next as a bitmask (token t: bit t % 32 of
        word t // 32), the same on every rank in the same state (`serve.masks`)."""
        return np.frombuffer(self.m.compute_bitmask(), np.int32)[:self.words]

    def take(self, token: int) -> None:
        """The sequence goes on with `token` (one `allowed()` let through)."""
        if not self.m.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self.m.get_error()}")

    @property
    def done(self) -> bool:
        """Nothing but the end of the sequence may come (the output is complete)."""
        return self.m.is_stopped()
