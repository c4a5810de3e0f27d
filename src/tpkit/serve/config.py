"""`ServeConfig`: every knob of `tpkit serve` (and the ones `tpkit generate` shares),
declared once (`tpkit.spec.knobs`). From these declarations come the flags with their
help (`tpkit.commands.common.add_knobs`), their checks (`problems`: the lines a bad
value gets, named by its flag), the engine's keywords (`engine_options`,
`embedder_options`) and what a follower rank starts with (`serve.workers.follow` takes
the config whole), so rank 0 and its followers cannot drift apart.

Adding a serving knob is one entry here plus its use:

    draft_checkpoint: str | None = ENGINE.knob(
        None, "with --speculative draft: the draft model ...", metavar="PATH")

- its section says which commands take it: `GENERATE` (the engine's sections, shown by
  `tpkit generate` too) or a section of `tpkit serve` alone (`MODEL`, `PARALLELISM`,
  `SERVING`); the section's name is the --help heading;
- its type is the field's annotation (`X | None`: unset allowed; `tuple[str, ...]`: a
  repeatable flag; a bool: --name, or --no-name when its default is True);
- `check(label, value)` lists its problems; a rule between knobs goes in `_crossed`;
- the engine reads it from `engine_options` (rank 0) or from the config itself
  (`serve.workers.follow`, every other rank); the CLI reference (docs) follows by itself.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tpkit.comm.failure import DEFAULT_COLLECTIVE_TIMEOUT_S
from tpkit.host.web import ALLOWED_HOST_HELP, HOST, MAX_PORT
from tpkit.serve.openai_api import MAX_BODY
from tpkit.serve.pacing import ITL_RATIO, check_ratio
from tpkit.serve.scheduler import FLOOR
from tpkit.serve.speculate import Speculator
from tpkit.spec import speculative as speculate
from tpkit.spec.config import QUANTIZE
from tpkit.spec.errors import UserError
from tpkit.spec.knobs import Check, Knob, Section, knobs

PREFILL_PER_STEP = 256  # prompt tokens computed per step (pieces of longer prompts)
DTYPES = ("float32", "bfloat16", "float16")  # --dtype's
INVARIANT_CHUNK = 8  # --decode-chunk's default under --batch-invariant

AT_LEAST_1 = Check(lambda v: v >= 1, "must be >= 1")
SECONDS = Check(lambda v: math.isfinite(v) and v > 0, "must be a number of seconds > 0")


def _said(check, *args) -> list[str]:
    """The UserError line of check(*args), as a list of problems."""
    try:
        check(*args)
    except UserError as e:
        return [str(e)]
    return []


MODEL = Section("model", "the model served")
TP = Section("parallelism", "tensor-parallel processes")
PARALLELISM = Section("parallelism", "tensor-parallel processes and their collectives")
ENGINE = Section("engine", "the serving engine's KV cache and decode (tpkit generate and "
                           "tpkit serve alike)")
SERVING = Section("serving", "the HTTP server and its scheduling")
GENERATE = (TP, ENGINE)  # the sections `tpkit generate` takes too (sections are equal
# when their name and line are: each section here has its own line)


@dataclass(frozen=True)
class ServeConfig:
    """A server's (or `tpkit generate`'s) knobs; each field's declaration is its flag."""

    served_model_name: str | None = MODEL.knob(
        None, "the model id clients send (default: the checkpoint folder's name)",
        metavar="NAME")
    lora: tuple[str, ...] = MODEL.knob(
        (), "serve a PEFT LoRA adapter folder over the base as model NAME (a request's "
        "\"model\": NAME; batched with the base's requests); repeatable",
        metavar="NAME=ADAPTER_DIR")
    tp: int = TP.knob(1, "tensor-parallel processes", metavar="N", check=AT_LEAST_1)
    collective_timeout: float = PARALLELISM.knob(
        DEFAULT_COLLECTIVE_TIMEOUT_S, "seconds a step may wait for a stuck worker; then its "
        "requests get 503 and the server exits 1 naming the rank", metavar="S",
        check=Check(lambda v: 0 < v < math.inf, "must be a number > 0"))
    host: str = SERVING.knob(HOST, "address to listen on (127.0.0.1: this machine only)",
                             metavar="HOST")
    port: int = SERVING.knob(8000, "port (0: a free one, printed)", metavar="PORT",
                             check=Check(lambda v: 0 <= v <= MAX_PORT,
                                         f"must be in [0, {MAX_PORT}]"))
    allowed_host: tuple[str, ...] = SERVING.knob((), ALLOWED_HOST_HELP, metavar="NAME")
    allow_origin: tuple[str, ...] = SERVING.knob(
        (), "a web page's origin (http://app.example:3000; *: any) whose browser requests "
        "are served, with CORS headers; repeatable (default: none, cross-origin requests "
        "are refused)", metavar="ORIGIN")
    api_key: str | None = SERVING.knob(
        None, "every /v1/ request needs 'Authorization: Bearer KEY' (401 otherwise; "
        "/health stays open); default: the environment variable TPKIT_API_KEY, else no key",
        metavar="KEY")
    metrics_need_key: bool = SERVING.knob(
        False, "/metrics needs the API key too (default: open, as /health)")
    dtype: str = ENGINE.knob(
        "float32", "weights, activations and KV cache in this dtype (bfloat16, float16: "
        "half the memory); the logits' softmax and the sampling run in float32 whatever "
        "it is", choices=DTYPES)
    quantize: str | None = ENGINE.knob(
        None, "int8: every linear weight and the head as int8 with a scale per row, a "
        "quarter of float32's bytes per token (bfloat16 activations in the product; its "
        "quality cost: docs/benchmarks.md); default: none, the weights as --dtype says",
        choices=QUANTIZE)
    max_batch: int = ENGINE.knob(
        8, "sequences generated at once: KV slots per rank (default: 8; tpkit generate: "
        "the number of prompts, at most 8)", metavar="B", check=AT_LEAST_1)
    max_len: int | None = ENGINE.knob(
        None, "tokens per sequence, prompt included (default: the model's max_seq_len)",
        metavar="L", check=AT_LEAST_1)
    batch_invariant: bool = ENGINE.knob(
        False, "decode in forwards of --decode-chunk rows (padded) and prompts in pieces "
        "cut at multiples of 64 tokens, so a request's tokens are bit for bit the same "
        "whatever else runs; without it each decode computes the running requests' rows "
        "only (fastest at any load; a token may then change with the batch where two "
        "logits are within rounding)")
    decode_chunk: int | None = ENGINE.knob(
        None, f"with --batch-invariant: rows per decode forward (default: {INVARIANT_CHUNK}"
        f"; 8 serves many clients best, 1 decodes each sequence alone)", metavar="C",
        check=AT_LEAST_1)
    speculative: str | None = ENGINE.knob(
        None, "ngram: propose the tokens that followed the latest earlier match of the last "
        "few tokens (prompt lookup); draft: a smaller model's (--draft-checkpoint); either "
        "verified in one forward, the output unchanged (docs/serving.md); default: none",
        choices=speculate.METHODS)
    speculative_tokens: int = ENGINE.knob(
        speculate.TOKENS, f"with --speculative: tokens proposed at most per sequence and "
        f"step (1..{speculate.MAX_TOKENS}, default {speculate.TOKENS})", metavar="K",
        check=lambda _, v: _said(speculate.check, None, v))
    draft_checkpoint: str | None = ENGINE.knob(
        None, "with --speculative draft: the draft model (any checkpoint tpkit loads, with "
        "the model's tokenizer), run at tp=1 on rank 0; default: none", metavar="PATH")
    prefill_per_step: int = SERVING.knob(
        PREFILL_PER_STEP, "prompt tokens prefilled per step, at most (a longer prompt "
        "alone; 0: no limit): the running requests decode in between", metavar="T",
        check=Check(lambda v: v >= 0, "must be >= 0 (0: no limit)"))
    itl_ratio: float = SERVING.knob(
        0.0, "while requests decode, a step computes only the prompt tokens that keep it "
        "within R x a decode-only step (learnt from the steps' times; at least "
        f"{FLOOR} tokens a step): the decoding streams' inter-token latency bought with a "
        "long prompt's time to first token, and throughput when many clients start at "
        f"once (e.g. {ITL_RATIO}; default 0: off, --prefill-per-step alone; not used with "
        "--batch-invariant)", metavar="R", check=lambda name, v: _said(check_ratio, v, name))
    max_tokens_in_flight: int | None = SERVING.knob(
        None, "prompt + max_tokens summed over the running requests; more waits in the "
        "queue (an encoder: padded tokens of one embedding forward) (default: max-batch x "
        "max-len)", metavar="T", check=AT_LEAST_1)
    kv_cache_bytes: int | None = SERVING.knob(
        None, "bytes of KV blocks per rank, at most (default: what max-batch x max-len "
        "tokens take); taken as requests need them, never up front", metavar="N",
        check=AT_LEAST_1)
    prefix_cache: bool = SERVING.knob(
        True, "compute every prompt in full (default: a prompt's full 16-token blocks that "
        "an earlier request computed are reused)")
    max_body_bytes: int = SERVING.knob(MAX_BODY, "largest request body", metavar="N",
                                       check=AT_LEAST_1)
    timeout: float = SERVING.knob(30.0, "seconds an idle connection is kept", metavar="S",
                                  check=SECONDS)
    drain_seconds: float = SERVING.knob(
        5.0, "on SIGTERM, how long running requests may still finish", metavar="S",
        check=Check(lambda v: math.isfinite(v) and v >= 0, "must be a number of seconds >= 0"))

    def problems(self, flags: bool = True) -> list[str]:
        """Why this config cannot serve, one line a problem (empty: it can); each knob
        named by its flag (`flags=False`: by its field, as the Python API's users)."""
        out = [p for k in knobs(type(self))
               for p in k.problems(getattr(self, k.name), _label(k, flags))]
        return out + self._crossed()

    def _crossed(self) -> list[str]:
        """The rules between knobs."""
        out = []
        if self.decode_chunk is not None and not self.batch_invariant:
            out.append(f"--decode-chunk={self.decode_chunk} needs --batch-invariant (without "
                       f"it a decode computes the running requests' rows)")
        if self.speculative is None and self.speculative_tokens != speculate.TOKENS:
            out.append(f"--speculative-tokens={self.speculative_tokens} needs --speculative "
                       f"ngram or draft")
        out += _said(speculate.check_draft, self.speculative,
                     self.draft_checkpoint)  # draft <-> its checkpoint, which exists
        return out

    def check(self) -> ServeConfig:
        """This config, or UserError naming every problem (`problems`) on one line."""
        bad = self.problems()
        if bad:
            raise UserError("; ".join(bad))
        return self

    @property
    def chunk(self) -> int | None:
        """The engine's `decode_chunk`: None (the running rows) without --batch-invariant,
        else --decode-chunk (default INVARIANT_CHUNK)."""
        if not self.batch_invariant:
            return None
        return INVARIANT_CHUNK if self.decode_chunk is None else self.decode_chunk

    def speculator(self, model=None, tokenizer=None):
        """The engine's `serve.speculate.Speculator` (--speculative), or None; a draft's
        (--draft-checkpoint) loaded at tp=1 and checked against the target `model` and
        its `tokenizer` (`serve.draft`)."""
        if self.speculative is None:
            return None
        if self.speculative == "ngram":
            return Speculator(self.speculative_tokens)
        from tpkit.serve.draft import draft_speculator  # loads a model: only where it runs

        return draft_speculator(self.draft_checkpoint, model, tokenizer,
                                self.speculative_tokens, self.max_batch, self.max_len,
                                self.dtype)

    def engine_options(self, model=None, tokenizer=None) -> dict:
        """`Engine`'s keywords (besides the model and the tokenizer, which a draft model's
        speculator is checked against)."""
        return dict(max_batch=self.max_batch, max_len=self.max_len,
                    max_tokens_in_flight=self.max_tokens_in_flight,
                    prefill_per_step=self.prefill_per_step, decode_chunk=self.chunk,
                    itl_ratio=self.itl_ratio, kv_cache_bytes=self.kv_cache_bytes,
                    prefix_caching=self.prefix_cache,
                    speculator=self.speculator(model, tokenizer))

    def embedder_options(self) -> dict:
        """`Embedder`'s keywords (besides the model and the pooling)."""
        return dict(max_batch=self.max_batch, max_len=self.max_len,
                    tokens_per_forward=self.max_tokens_in_flight)


def _label(k: Knob, flag: bool) -> str:
    """How a problem line names knob `k`: its flag (--max-batch) or its field."""
    return k.option if flag else k.name


def refuse(**values) -> None:
    """UserError naming, by their fields, the problems of these knobs' `values` (the
    Python API's checks: `Engine`'s arguments are knobs of `ServeConfig`)."""
    declared = {k.name: k for k in knobs(ServeConfig)}
    bad = [p for name, v in values.items() for p in declared[name].problems(v)]
    if bad:
        raise UserError("; ".join(bad))
