"""What the HTTP routes serve (`tpkit.serve.http`): the engine, the model's name, the
tokenizer and the limits, with the part of a POST that is not HTTP, in one call
(`post`: a `Posted`): its body to a validated request and prompt ids (`parse`,
`parse_embeddings`), and their submission (`submit`, `embed`: the engine's refusals as
OpenAI's errors). The engine is an `Engine` (a decoder: completions) or, for an
encoder, an `Embedder` (embeddings).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import hmac
import threading
import time
from dataclasses import dataclass

from tpkit.serve import openai_api as api
from tpkit.serve import protocol, tools
from tpkit.serve.embedder import Embedder, EmbedJob
from tpkit.serve.engine import Engine, TooLong
from tpkit.serve.loop import unwell
from tpkit.serve.openai_api import MAX_BODY
from tpkit.serve.params import SamplingParams
from tpkit.serve.request import Done, Request, RequestFailed
from tpkit.serve.responses import to_chat
from tpkit.spec.errors import UserError
from tpkit.weights.tokenizer import bytes_per_token


def fingerprint(model) -> str:
    """`system_fingerprint`: what decides the outputs besides the weights and the
    request: tpkit's version, the weights' dtype, the tensor-parallel size."""
    from tpkit import __version__

    first = next(iter(model.parameters()), None)
    dtype = "?" if first is None else str(first.dtype).removeprefix("torch.")
    mesh = getattr(model, "mesh", None)
    return f"tpkit-{__version__}-{dtype}-tp{mesh.tp_size if mesh else 1}"


COMPLETIONS, CHAT, RESPONSES, EMBEDDINGS = "completions", "chat", "responses", "embeddings"


@dataclass
class Posted:
    """One POST, parsed and submitted (`App.post`): what its answer is made from."""

    kind: str  # COMPLETIONS, CHAT, RESPONSES or EMBEDDINGS: the route
    asked: object  # the validated request (`protocol`)
    prompts: list[list[int]]  # the ids of each prompt (of each input, embeddings)
    handles: list  # its Requests (n choices of each prompt), or its one EmbedJob

    @property
    def chat(self) -> bool:
        """Answered as a chat (the Responses API's too)."""
        return self.kind in (CHAT, RESPONSES)

    @property
    def stream(self) -> bool:
        """Answered as server-sent events."""
        return bool(getattr(self.asked, "stream", False))

    def cancel(self) -> None:
        """Its generations (or its embedding) stop: their blocks are freed at the next step."""
        for h in self.handles:
            h.cancel()


class App:
    """What the routes serve: the engine, the model's name, the tokenizer, the limits."""

    def __init__(self, engine: Engine | Embedder, model_name: str, tokenizer, *, max_body: int = MAX_BODY,
                 timeout: float = 30.0, api_key: str | None = None,
                 metrics_need_key: bool = False) -> None:
        self.engine, self.name, self.tokenizer = engine, model_name, tokenizer
        self.max_body, self.timeout, self.created = max_body, timeout, int(time.time())
        self.active, self._active = 0, threading.Condition()  # POSTs being answered
        if api_key is not None and not api_key.strip():
            raise UserError("--api-key (or TPKIT_API_KEY) must not be empty")
        self._key = None if api_key is None else f"Bearer {api_key}".encode()
        self.metrics_need_key = metrics_need_key
        self.fingerprint = fingerprint(engine.model)
        self.tool_style = tools.style(getattr(getattr(tokenizer, "hf", None),
                                              "chat_template", None))
        served = getattr(getattr(engine, "runner", None), "adapters", None)  # --lora's
        self.lora = {n: (k, f) for k, (n, f) in enumerate(zip(served.names, served.folders))
                     if k} if served else {}  # name -> (adapter index, its folder)
        self.peers = None  # the tp workers (`launch.Followers`), if spawned: /health asks
        # prompts are tokenized by a copy of their own, never under the lock the engine's
        # detokenizer takes (a long prompt stalled every stream); sizes are checked first
        self._encoding = (copy.deepcopy(tokenizer), threading.Lock())
        self._per_token = bytes_per_token(tokenizer) if tokenizer is not None else None

    def refusal(self, path: str, authorization: str | None) -> api.ApiError | None:
        """The 401 of a request without the server's key (None: it may pass). With
        `--api-key`, every /v1/ path needs `Authorization: Bearer KEY` (compared in
        constant time); /health stays open, /metrics too unless `metrics_need_key`."""
        if self._key is None or not (path.startswith("/v1/") or
                                     path == "/metrics" and self.metrics_need_key):
            return None
        given = (authorization or "").encode("utf-8", "surrogateescape")
        if hmac.compare_digest(given, self._key):
            return None
        why = "no API key given" if not authorization else "the API key is not this server's"
        return api.ApiError(401, f"{why}: send the header 'Authorization: Bearer KEY' with "
                                 f"the key the server was started with (--api-key)",
                            None, "invalid_api_key")

    def health(self) -> str | None:
        """Why /health answers 503 (`serve.loop.unwell`), or None: 200."""
        return unwell(self.engine, self.peers)

    def enter(self) -> None:
        """A POST starts being answered."""
        with self._active:
            self.active += 1

    def leave(self) -> None:
        """... and is done."""
        with self._active:
            self.active -= 1
            self._active.notify_all()

    def wait_handlers(self, timeout: float) -> bool:
        """Wait until no POST is being answered (True) or `timeout` seconds."""
        with self._active:
            return self._active.wait_for(lambda: self.active == 0, timeout)

    def parse(self, raw: bytes, chat: bool, responses: bool = False
              ) -> tuple[protocol.CompletionRequest | protocol.ChatRequest, list[list[int]]]:
        """(the request, the ids of each of its prompts) of a POST body (`responses`: a
        Responses API body, taken as the chat request it asks for); ApiError for a bad
        one."""
        body = protocol.parse_json(raw)
        if responses:
            body = to_chat(body)
        req = protocol.validate(body, chat)
        self._served(req.model)
        tok, lock = self._encoding
        if chat:
            messages = [m.for_template() for m in req.messages]
            return req, [api.chat_ids({"messages": messages}, tok, lock, tools=req.offered)]
        for p in req.prompt:
            self._fits(p, req.sampling().max_tokens)
        return req, [api.prompt_ids(p, tok, lock) for p in req.prompt]

    def _fits(self, prompt: str | list[int], max_tokens: int) -> None:
        """A 413 for a text prompt too long for the context whatever its tokens (its bytes
        / the most a token stands for, `bytes_per_token`), before it is tokenized."""
        if not isinstance(prompt, str) or self._per_token is None:
            return
        size = len(prompt.encode("utf-8", "surrogatepass"))
        least = -(-size // self._per_token)
        if least + max_tokens > self.engine.max_len:
            raise api.ApiError(400, f"the prompt ({size} bytes: at least {least} tokens) + "
                                    f"max_tokens ({max_tokens}) exceeds the context of "
                                    f"{self.engine.max_len} tokens", "prompt",
                               "context_length_exceeded")

    def _served(self, model: str | None) -> int:
        """The adapter `model` names (0: the base), or the 404 of an unknown model."""
        if model in (None, self.name):
            return 0
        if model in self.lora:
            return self.lora[model][0]
        raise api.ApiError(404, f"model {model!r} is not served here (GET /v1/models: "
                                f"{', '.join(map(repr, [self.name, *self.lora]))})", "model",
                           "model_not_found")

    def sampling(self, asked) -> SamplingParams:
        """A parsed request's SamplingParams, with the adapter its model names."""
        params, k = asked.sampling(), self._served(asked.model)
        return dataclasses.replace(params, adapter=k) if k else params

    def answering(self, asked) -> str:
        """The model an answer names: the adapter the request asked for, else the base's
        (as vLLM echoes a LoRA's name)."""
        return asked.model if asked.model in self.lora else self.name

    def models(self) -> dict:
        """GET /v1/models: the base, then each adapter with its parent (as vLLM)."""
        return api.models(self.name, self.created,
                          [(n, str(f)) for n, (_, f) in self.lora.items()])

    @property
    def encoder(self) -> bool:
        """Does this server embed (an encoder model) rather than generate?"""
        return not self.engine.model.config.causal

    def not_served(self, embeddings: bool) -> api.ApiError | None:
        """The 400 of an endpoint this model does not serve (None: it does)."""
        if embeddings and not self.encoder:
            return api.ApiError(400, f"model {self.name!r} is not an encoder (it generates: "
                                     f"/v1/completions, /v1/chat/completions); /v1/embeddings"
                                     f" needs an encoder model (BERT family)", "model")
        if self.encoder and not embeddings:
            return api.ApiError(400, f"model {self.name!r} is an encoder: it only serves "
                                     f"/v1/embeddings", "model")
        return None

    def parse_embeddings(self, raw: bytes) -> tuple[protocol.EmbeddingRequest, list[list[int]]]:
        """(the request, the ids of each input) of a POST /v1/embeddings body; ApiError
        for a bad one (dimensions other than the model's width among them)."""
        req = protocol.validate(protocol.parse_json(raw), protocol.EmbeddingRequest)
        self._served(req.model)
        width = self.engine.width
        if req.dimensions is not None and req.dimensions != width:
            raise api.ApiError(400, f"dimensions={req.dimensions}: this model's embeddings "
                                    f"have {width} dimensions (tpkit does not shorten them)",
                               "dimensions", "invalid_value")
        lock = self.engine.tokenizer_lock
        return req, [api.prompt_ids(p, self.tokenizer, lock) for p in req.input]

    def embed(self, inputs: list[list[int]], on_done) -> EmbedJob:
        """Embedder.submit with its errors as ApiErrors (400, too long among them; 503)."""
        try:
            return self.engine.submit(inputs, on_done)
        except TooLong as e:
            raise api.ApiError(400, str(e), "input", "context_length_exceeded") from None
        except UserError as e:
            raise api.ApiError(400, str(e), "input") from None
        except RequestFailed as e:
            raise api.ApiError(e.status, str(e)) from None

    def submit(self, ids: list[int], params, on_event=None, chat: bool = False,
               group: int | None = None) -> Request:
        """Engine.submit (in `group`'s turns) with its errors as ApiErrors (400,
        `context_length_exceeded` among them; 503); its events go to `on_event`
        (`Request.attach`)."""
        try:
            req = self.engine.submit(ids, params, group)
            if on_event is not None:
                req.attach(on_event)
            return req
        except TooLong as e:  # OpenAI's answer to a prompt over the context
            raise api.ApiError(400, str(e), "messages" if chat else "prompt",
                               "context_length_exceeded") from None
        except UserError as e:
            raise api.ApiError(400, str(e)) from None
        except RequestFailed as e:
            raise api.ApiError(e.status, str(e)) from None

    def post(self, kind: str, raw: bytes, put) -> Posted:
        """A POST body of route `kind` parsed and submitted, in one call (the HTTP layer
        makes it in a thread of its pool): its events go to put(index, event) (an
        embedding's: one Done once its job is); ApiError for a bad or refused body,
        nothing of it left running."""
        if kind == EMBEDDINGS:
            asked, inputs = self.parse_embeddings(raw)
            return Posted(kind, asked, inputs, [self.embed(inputs, functools.partial(
                put, 0, Done("embedded")))])
        chat = kind != COMPLETIONS
        asked, prompts = self.parse(raw, chat, kind == RESPONSES)
        return Posted(kind, asked, prompts, self.submit_all(prompts, self.sampling(asked),
                                                            asked.n or 1, put, chat))

    def submit_all(self, prompts: list[list[int]], params, n: int, put, chat: bool
                   ) -> list[Request]:
        """n choices of each prompt (choice i of prompt p: index p * n + i; a seed s gives
        choice i the seed s ^ i); their events go to put(index, event); they take their
        turns as one (the first one's group). One refused: those submitted are
        cancelled, the ApiError raised."""
        reqs: list[Request] = []
        try:
            for ids in prompts:
                for i in range(n):
                    q = params if i == 0 or params.seed is None else \
                        dataclasses.replace(params, seed=params.seed ^ i)
                    reqs.append(self.submit(ids, q, functools.partial(put, len(reqs)), chat,
                                            reqs[0].id if reqs else None))
        except api.ApiError:
            for r in reqs:
                r.cancel()
            raise
        return reqs

    def tool_answer(self, asked, text: str, reason: str | None) -> tuple[dict, str | None]:
        """(the assistant's message, the finish reason) of a chat answer that may call
        tools (`asked.offered`): its calls as `tool_calls` (finish "tool_calls"), or its
        text."""
        calls = tools.calls(text, asked.offered, asked.choice, self.tool_style) \
            if asked.offered and reason == "stop" else None
        if not calls:
            return {"role": "assistant", "content": text}, reason
        rest = None if asked.forced else tools.text_around(text, self.tool_style)
        return {"role": "assistant", "content": rest, "tool_calls": calls}, "tool_calls"

    def usage(self, prompts: list[list[int]], n: int):
        """OpenAI's usage of a request's choices (a function of their handles): each
        prompt counted once, with the tokens of it the prefix cache gave
        (`prompt_tokens_details.cached_tokens`: its first choice's; the others share
        its blocks)."""
        p = sum(map(len, prompts))

        def of(reqs: list[Request]) -> dict:
            c = sum(len(r.tokens) for r in reqs)
            cached = sum(r.cached_tokens for r in reqs[::n])
            return dict(prompt_tokens=p, completion_tokens=c, total_tokens=p + c,
                        prompt_tokens_details={"cached_tokens": cached})
        return of
