"""The OpenAI API's shapes: request bodies in, (prompt ids, SamplingParams) out, and the
JSON of completions, chat completions, their streamed chunks, models and errors.

Pure Python over the tokenizer: no HTTP here (`tpkit.serve.http` is the transport).
A bad body raises `ApiError(status, message, param)`, answered in OpenAI's shape

    {"error": {"message": "...", "type": "invalid_request_error", "param": "top_p", "code": ...}}
"""

from __future__ import annotations

import time

from tpkit.serve.params import SamplingParams
from tpkit.spec.errors import UserError

TYPES = {400: "invalid_request_error", 404: "not_found_error", 413: "invalid_request_error",
         503: "service_unavailable", 500: "internal_error"}
CODES = {404: "model_not_found", 413: "context_length_exceeded"}
KNOWN = {"model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
         "top_p", "top_k", "seed", "stop", "n", "stream", "stream_options", "user",
         "ignore_eos", "presence_penalty", "frequency_penalty", "logprobs", "top_logprobs",
         "echo"}


class ApiError(Exception):
    """A request answered with an error `status` in OpenAI's JSON shape."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def body(self) -> dict:
        """{"error": {...}} as OpenAI sends it."""
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "error"),
                          "param": self.param, "code": CODES.get(self.status)}}


def sampling(body: dict, chat: bool = False) -> SamplingParams:
    """SamplingParams from a request body (OpenAI's defaults: temperature 1, top_p 1).

    Log-probabilities as each API asks for them: a completion's `logprobs: k`, a chat's
    `logprobs: true` with `top_logprobs: k`."""
    unknown = sorted(set(body) - KNOWN)
    if unknown:
        raise ApiError(400, f"unsupported parameters: {', '.join(unknown)}", unknown[0])
    if body.get("n", 1) != 1:
        raise ApiError(400, f"n={body['n']!r}: this server returns one choice (n=1)", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        if body.get(name, 0) not in (0, 0.0, None):
            raise ApiError(400, f"{name} is not supported (only 0)", name)
    stop = body.get("stop")
    stop = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, list | tuple):
        raise ApiError(400, f"stop={stop!r} must be a string or a list of strings", "stop")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    logprobs, echo = _logprobs(body, chat), body.get("echo", False)
    if echo not in (True, False) or (echo and (chat or body.get("stream"))):
        raise ApiError(400, f"echo={echo!r}: a completion (not chat, not streamed) may echo "
                            f"its prompt (echo=true)", "echo")
    try:
        return SamplingParams(
            max_tokens=16 if max_tokens is None else max_tokens,
            temperature=_or(body.get("temperature"), 1.0), top_p=_or(body.get("top_p"), 1.0),
            top_k=_or(body.get("top_k"), 0), seed=body.get("seed"), stop=tuple(stop),
            ignore_eos=bool(body.get("ignore_eos", False)), logprobs=logprobs, echo=echo)
    except UserError as e:
        raise ApiError(400, str(e), str(e).split("=")[0]) from None


def _logprobs(body: dict, chat: bool) -> int | None:
    lp, top = body.get("logprobs"), body.get("top_logprobs")
    if not chat:
        if top is not None:
            raise ApiError(400, "top_logprobs is a chat parameter: a completion takes "
                                "logprobs=k", "top_logprobs")
        return lp
    if lp not in (None, True, False):
        raise ApiError(400, f"logprobs={lp!r} must be true or false (the alternatives: "
                            f"top_logprobs=k)", "logprobs")
    if top is not None and not lp:
        raise ApiError(400, "top_logprobs needs logprobs=true", "top_logprobs")
    return (0 if top is None else top) if lp else None


def token_text(raw: bytes) -> str:
    """A token as the API shows it: its text, or (a piece of a UTF-8 character, which is
    no text) `bytes:\\xe2\\x80`, as OpenAI writes those."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def logprobs_block(chat: bool, tokens: list[int], logprobs: list[float | None],
                   top: list[list[tuple[int, float]] | None], tokenizer, lock, offset: int = 0
                   ) -> dict:
    """The `logprobs` of a choice (or of a streamed chunk's tokens), in each API's shape:
    chat `{"content": [{token, logprob, bytes, top_logprobs}]}`, completion `{tokens,
    token_logprobs, top_logprobs, text_offset}` (an echoed prompt's first token: null,
    nothing came before it). A token's text: `token_text`; `offset`: characters of the
    text before the first of these tokens."""
    with lock:
        raw = {t: tokenizer.token_bytes(t)
               for t in {*tokens, *(i for k in top if k for i, _ in k)}}
    text = {t: token_text(b) for t, b in raw.items()}
    if chat:
        entry = lambda t, lp: {"token": text[t], "logprob": lp,  # noqa: E731
                               "bytes": list(raw[t])}
        return {"content": [{**entry(t, lp), "top_logprobs": [entry(i, v) for i, v in k]}
                            for t, lp, k in zip(tokens, logprobs, top)]}
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(text[t])
    return {"tokens": [text[t] for t in tokens], "token_logprobs": logprobs,
            "top_logprobs": [None if k is None else {text[i]: v for i, v in k} for k in top],
            "text_offset": offsets}


def _or(x, default):
    return default if x is None else x


def prompt_ids(body: dict, tokenizer, lock) -> list[int]:
    """The prompt of a completion request as token ids (text, or a list of ids)."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], str | list):
        p = p[0]  # a batch of one
    if isinstance(p, str) and p:
        with lock:
            return tokenizer.encode(p)
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool)
                                         for t in p):
        return p
    raise ApiError(400, "prompt must be a non-empty string or a list of token ids "
                        "(one prompt per request)", "prompt")


def chat_ids(body: dict, tokenizer, lock,
             instead: str = "use /v1/completions with a prompt instead") -> list[int]:
    """The messages of a chat request rendered by the tokenizer's own chat template; a
    tokenizer without one is an ApiError saying what to do `instead` (in the caller's
    terms: the server's endpoint, the CLI's flag)."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and
            isinstance(m.get("content"), str) for m in msgs):
        raise ApiError(400, "messages must be a non-empty list of {role, content} strings",
                       "messages")
    hf = getattr(tokenizer, "hf", None)
    if hf is None or not getattr(hf, "chat_template", None):
        raise ApiError(400, f"this model's tokenizer has no chat template: {instead}",
                       "messages")
    with lock:
        ids = hf.apply_chat_template([{"role": m["role"], "content": m["content"]}
                                      for m in msgs], add_generation_prompt=True,
                                     tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding too


def completion(rid: str, model: str, text: str, finish: str | None, usage: dict | None,
               chat: bool, created: int, logprobs: dict | None = None) -> dict:
    """A whole (non-streamed) completion or chat completion."""
    choice = {"index": 0, "logprobs": logprobs, "finish_reason": finish}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": model, "choices": [choice], "usage": usage}


def chunk(rid: str, model: str, text: str | None, finish: str | None, chat: bool,
          created: int, first: bool = False, logprobs: dict | None = None) -> dict:
    """One streamed chunk (`data: {...}`): a piece of text, or the finish reason."""
    choice: dict = {"index": 0, "logprobs": logprobs, "finish_reason": finish}
    if chat:
        delta = {"role": "assistant", "content": ""} if first else {}
        if text:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "choices": [choice]}


def usage_chunk(rid: str, model: str, usage: dict, chat: bool, created: int) -> dict:
    """The last chunk when `stream_options.include_usage` is set: no choices, the usage."""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "choices": [], "usage": usage}


def models(name: str, created: int | None = None) -> dict:
    """GET /v1/models."""
    return {"object": "list", "data": [{"id": name, "object": "model",
                                        "created": created or int(time.time()),
                                        "owned_by": "tpkit"}]}
