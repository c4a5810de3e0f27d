"""The OpenAI API's shapes: a validated request (`tpkit.serve.protocol`) to prompt ids,
and the JSON of completions, chat completions, their streamed chunks, embeddings, models
and errors
(`ApiError`, answered in OpenAI's shape

    {"error": {"message": "...", "type": "invalid_request_error", "param": "top_p", "code": ...}}
).

Pure Python over the tokenizer, without pydantic (`tpkit generate` uses it too): no
HTTP here (`tpkit.serve.http` is the transport).
"""

from __future__ import annotations

import time

MAX_BODY = 1 << 20  # bytes of a request body (tpkit serve --max-body-bytes)
TYPES = {400: "invalid_request_error", 403: "invalid_request_error",
         404: "not_found_error", 413: "invalid_request_error", 415: "invalid_request_error",
         500: "internal_error", 503: "service_unavailable"}
CODES = {404: "not_found", 413: "request_too_large"}  # the others say what (model, context)


class ApiError(Exception):
    """A request answered with an error `status` in OpenAI's JSON shape."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code or CODES.get(status)

    def body(self) -> dict:
        """{"error": {...}} as OpenAI sends it."""
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "error"),
                          "param": self.param, "code": self.code}}


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


def prompt_ids(prompt: str | list[int], tokenizer, lock) -> list[int]:
    """A completion's prompt (validated: text, or token ids) as token ids."""
    if isinstance(prompt, str):
        with lock:
            return tokenizer.encode(prompt)
    return list(prompt)


def chat_ids(body: dict, tokenizer, lock,
             instead: str = "use /v1/completions with a prompt instead",
             tools: list[dict] | None = None) -> list[int]:
    """The messages of a chat request ({role, content} strings, validated; an assistant's
    `tool_calls`, a tool's `tool_call_id`) and its `tools` rendered by the tokenizer's
    own chat template; a tokenizer without one is an ApiError saying what to
    do `instead` (in the caller's terms: the server's endpoint, the CLI's flag), one
    whose template refuses the messages an ApiError 400 too."""
    hf = getattr(tokenizer, "hf", None)
    if hf is None or not getattr(hf, "chat_template", None):
        raise ApiError(400, f"this model's tokenizer has no chat template: {instead}",
                       "messages")
    try:
        with lock:
            ids = hf.apply_chat_template(body["messages"], tools=tools or None,
                                         add_generation_prompt=True, tokenize=True)
    except Exception as e:  # noqa: BLE001 - a template's raise_exception("roles must ...")
        raise ApiError(400, f"the chat template refused these messages: {e}",
                       "messages") from None
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)  # a BatchEncoding too


def completion(rid: str, model: str, text: str, finish: str | None, usage: dict | None,
               chat: bool, created: int, logprobs: dict | None = None,
               fingerprint: str | None = None) -> dict:
    """A whole (non-streamed) completion or chat completion (`fingerprint`: its
    `system_fingerprint`, `tpkit.serve.app.fingerprint`)."""
    choice = {"index": 0, "logprobs": logprobs, "finish_reason": finish}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {"id": rid, "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": model, "system_fingerprint": fingerprint,
            "choices": [choice], "usage": usage}


def chunk(rid: str, model: str, text: str | None, finish: str | None, chat: bool,
          created: int, first: bool = False, logprobs: dict | None = None,
          index: int = 0, fingerprint: str | None = None) -> dict:
    """One streamed chunk (`data: {...}`) of choice `index`: a piece of text, or the
    finish reason."""
    choice: dict = {"index": index, "logprobs": logprobs, "finish_reason": finish}
    if chat:
        delta = {"role": "assistant", "content": ""} if first else {}
        if text:
            delta["content"] = text
        choice["delta"] = delta
    else:
        choice["text"] = text or ""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "system_fingerprint": fingerprint,
            "choices": [choice]}


def usage_chunk(rid: str, model: str, usage: dict, chat: bool, created: int,
                fingerprint: str | None = None) -> dict:
    """The last chunk when `stream_options.include_usage` is set: no choices, the usage."""
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
            "created": created, "model": model, "system_fingerprint": fingerprint,
            "choices": [], "usage": usage}


def embeddings(model: str, vectors: list, tokens: int) -> dict:
    """POST /v1/embeddings' answer: each vector a list of floats, or (encoding_format
    "base64") the base64 of its little-endian float32 bytes, as OpenAI sends them."""
    return {"object": "list", "model": model,
            "data": [{"object": "embedding", "index": i, "embedding": v}
                     for i, v in enumerate(vectors)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def models(name: str, created: int | None = None, lora: list[tuple[str, str]] = ()) -> dict:
    """GET /v1/models: the base `name`, then its LoRA adapters (name, folder), each with
    `parent` and `root` as vLLM lists them."""
    created = created or int(time.time())
    base = {"id": name, "object": "model", "created": created, "owned_by": "tpkit"}
    return {"object": "list", "data": [base, *({**base, "id": n, "root": f, "parent": name}
                                                for n, f in lora)]}
