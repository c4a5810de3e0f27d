"""POST /v1/responses (OpenAI's Responses API, what `client.responses.create` and agent
frameworks call), served by the chat machinery: the request becomes a chat request
(`to_chat`), is parsed, submitted and finished as one, and its answer is written as a
response object (`whole`) or as the Responses API's stream of typed events (`stream`).

    input: "text" | [{"role", "content": "text" | [{"type": "input_text", "text"}]},
                     {"type": "function_call", "call_id", "name", "arguments"},
                     {"type": "function_call_output", "call_id", "output"}, ...]
    instructions -> a system message first;  max_output_tokens -> max_tokens
    tools: [{"type": "function", "name", "parameters", ...}];  tool_choice
    text: {"format": {"type": "json_schema", "name", "schema", "strict"}} -> response_format

tpkit keeps no responses (`store` is accepted and nothing is stored;
`previous_response_id` is refused: send the whole conversation as `input`).
"""

from __future__ import annotations

import asyncio
import json
import os

from tpkit.serve import openai_api as api
from tpkit.serve.request import Done, Failed, Token

PASSED = ("model", "temperature", "top_p", "stream", "user", "parallel_tool_calls",
          "seed", "top_logprobs")  # the same name in both APIs
IGNORED = ("store", "metadata", "truncation", "service_tier", "reasoning", "include")


def to_chat(body: dict) -> dict:
    """The chat request of a Responses request (ApiError 400 naming what cannot be)."""
    if body.get("previous_response_id") is not None:
        raise api.ApiError(400, "previous_response_id: tpkit keeps no responses; send the "
                                "whole conversation as input", "previous_response_id")
    if "input" not in body:
        raise api.ApiError(400, "input is required", "input")
    rest = {k: v for k, v in body.items() if k not in (*PASSED, *IGNORED, "input",
            "instructions", "max_output_tokens", "tools", "tool_choice", "text",
            "previous_response_id")}
    if rest:
        raise api.ApiError(400, f"unsupported parameters: {', '.join(rest)}",
                           next(iter(rest)), "unknown_parameter")
    chat = {k: body[k] for k in PASSED if k in body}
    system = [{"role": "system", "content": body["instructions"]}] \
        if body.get("instructions") is not None else []
    chat["messages"] = system + _messages(body["input"])
    if body.get("max_output_tokens") is not None:
        chat["max_tokens"] = body["max_output_tokens"]
    if body.get("tools") is not None:
        chat["tools"] = [_tool(t, i) for i, t in enumerate(_list(body["tools"], "tools"))]
    if body.get("tool_choice") is not None:
        c = body["tool_choice"]
        chat["tool_choice"] = {"type": "function", "function": {"name": c.get("name")}} \
            if isinstance(c, dict) else c
    fmt = (body.get("text") or {}).get("format") if isinstance(body.get("text"), dict) \
        else None
    if fmt is not None:
        chat["response_format"] = _format(fmt)
    return chat


def _list(v, name: str) -> list:
    if not isinstance(v, list):
        raise api.ApiError(400, f"{name} must be a list", name)
    return v


def _messages(items) -> list[dict]:
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    out: list[dict] = []
    for i, item in enumerate(_list(items, "input")):
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message":  # (an earlier answer's item also has an id and a status)
            out.append({"role": item.get("role"), "content": _text(item.get("content"), i)})
        elif kind == "function_call":
            call = {"id": item.get("call_id"), "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments")}}
            if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls"):
                out[-1]["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": item.get("call_id"),
                        "content": item.get("output")})
        else:
            raise api.ApiError(400, f"input[{i}].type={kind!r}: tpkit takes messages, "
                                    f"function_call and function_call_output items",
                               f"input[{i}].type")
    return out


def _text(content, i: int):
    """A message's content: a string, or its input_text / output_text parts as text parts."""
    if not isinstance(content, list):
        return content
    parts = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind not in ("input_text", "output_text", "text"):
            raise api.ApiError(400, f"input[{i}].content[{j}].type={kind!r}: only text "
                                    f"parts are served (this is a text model)",
                               f"input[{i}].content")
        parts.append({"type": "text", "text": p.get("text")})
    return parts


def _tool(t, i: int) -> dict:
    if not isinstance(t, dict) or t.get("type") != "function":
        kind = t.get("type") if isinstance(t, dict) else None
        raise api.ApiError(400, f"tools[{i}].type={kind!r}: only function tools are "
                                f"served", f"tools[{i}].type")
    return {"type": "function", "function": {k: v for k, v in t.items() if k != "type"}}


def _format(fmt) -> dict:
    if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
        spec = {k: v for k, v in fmt.items() if k != "type"}
        return {"type": "json_schema", "json_schema": spec}
    return fmt


# -- the answer --------------------------------------------------------------------------
def _items(message: dict, rid: str) -> list[dict]:
    """A chat answer's message as the Responses API's output items."""
    items = [{"type": "function_call", "id": f"fc_{os.urandom(12).hex()}",
              "call_id": c["id"], "name": c["function"]["name"],
              "arguments": c["function"]["arguments"], "status": "completed"}
             for c in message.get("tool_calls") or ()]
    if message.get("content") is not None or not items:
        items.insert(0, {"type": "message", "id": f"msg_{rid}", "status": "completed",
                         "role": "assistant", "content": [_part(message.get("content") or "")]})
    return items


def _part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _response(app, rid: str, status: str, output: list, usage: dict | None,
              finish: str | None = None) -> dict:
    cut = finish == "length"
    return {"id": rid, "object": "response", "created_at": app.created, "model": app.name,
            "status": "incomplete" if cut else status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "output": output, "usage": usage and _usage(usage), "parallel_tool_calls": True,
            "tool_choice": "auto", "tools": [], "metadata": {}}


def _usage(u: dict) -> dict:
    return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
            "total_tokens": u["total_tokens"],
            "input_tokens_details": {"cached_tokens":
                                     u["prompt_tokens_details"]["cached_tokens"]},
            "output_tokens_details": {"reasoning_tokens": 0}}


def whole(app, rid: str, body: dict) -> dict:
    """The response object of a finished chat answer's body."""
    choice = body["choices"][0]
    return _response(app, "resp_" + rid, "completed",
                     _items(choice["message"], rid), body["usage"], choice["finish_reason"])


def _event(kind: str, n: int, **fields) -> bytes:
    payload = json.dumps({"type": kind, "sequence_number": n, **fields}, ensure_ascii=False)
    return f"event: {kind}\ndata: {payload}\n\n".encode("utf-8", "backslashreplace")


async def stream(app, req, events: asyncio.Queue, rid: str, asked, usage):
    """The Responses API's events of one answer: created, in_progress, the message's
    text as output_text deltas (with tools offered: each item whole at the end), and
    completed (or incomplete) with the usage."""
    rid, n = "resp_" + rid, iter(range(1 << 62))
    yield _event("response.created", next(n), response=_response(app, rid, "in_progress",
                                                                  [], None))
    yield _event("response.in_progress", next(n), response=_response(app, rid, "in_progress",
                                                                      [], None))
    msg = {"type": "message", "id": f"msg_{rid}", "status": "in_progress", "role": "assistant",
           "content": []}
    held, opened = bool(asked.offered), False
    while True:
        _, ev = await events.get()
        if isinstance(ev, Failed):
            yield _event("error", next(n), code=api.CODES.get(ev.status), message=ev.message,
                         param=None)
            return
        if isinstance(ev, Token) and not held and ev.text:
            if not opened:
                opened = True
                yield _event("response.output_item.added", next(n), output_index=0, item=msg)
                yield _event("response.content_part.added", next(n), item_id=msg["id"],
                             output_index=0, content_index=0, part=_part(""))
            yield _event("response.output_text.delta", next(n), item_id=msg["id"],
                         output_index=0, content_index=0, delta=ev.text, logprobs=[])
        if isinstance(ev, Done):
            break
    message, finish = app.tool_answer(asked, req.text, req.finish_reason) if held else \
        ({"role": "assistant", "content": req.text}, req.finish_reason)
    items = _items(message, rid)
    for i, item in enumerate(items):
        async for chunk in _item_events(item, i, n, opened and i == 0):
            yield chunk
    done = _response(app, rid, "completed", items, usage([req]), finish)
    yield _event("response.completed" if done["status"] == "completed" else
                 "response.incomplete", next(n), response=done)


async def _item_events(item: dict, i: int, n, opened: bool):
    """An output item's closing events (and, unless its text was streamed, its opening)."""
    if not opened:
        yield _event("response.output_item.added", next(n), output_index=i,
                     item={**item, "status": "in_progress"})
    if item["type"] == "message":
        text = item["content"][0]["text"]
        if not opened:
            yield _event("response.content_part.added", next(n), item_id=item["id"],
                         output_index=i, content_index=0, part=_part(""))
            yield _event("response.output_text.delta", next(n), item_id=item["id"],
                         output_index=i, content_index=0, delta=text, logprobs=[])
        yield _event("response.output_text.done", next(n), item_id=item["id"],
                     output_index=i, content_index=0, text=text, logprobs=[])
        yield _event("response.content_part.done", next(n), item_id=item["id"],
                     output_index=i, content_index=0, part=_part(text))
    else:
        yield _event("response.function_call_arguments.delta", next(n), item_id=item["id"],
                     output_index=i, delta=item["arguments"])
        yield _event("response.function_call_arguments.done", next(n), item_id=item["id"],
                     output_index=i, arguments=item["arguments"])
    yield _event("response.output_item.done", next(n), output_index=i, item=item)
