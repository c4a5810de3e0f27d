"""Tool calls (OpenAI's `tools` / `tool_choice`): what the chat template is given, what
the output must match, and how the output becomes `message.tool_calls`.

    tool_choice "none"       the tools are not rendered; plain text
    tool_choice "auto"       the template renders the tools; the answer is parsed in the
                             template's own format: Hermes-style `<tool_call>{"name",
                             "arguments"}</tool_call>` (Qwen2.5, Hermes), Llama 3.x's JSON
                             `{"name", "parameters"}`; text otherwise (a template with no
                             tool format cannot call tools by itself)
    tool_choice "required"   forced by the grammar engine, whatever the template: a JSON
                             array of {"name": one of the tools, "parameters": its schema},
                             one call at least (at most one without parallel_tool_calls)
    {"type": "function", "function": {"name": F}}
                             forced: the arguments of F, as its schema says (vLLM's shape)

A call's `arguments` are a JSON string, as OpenAI sends them; its id `call_` + 24 hex.
A forced call's `arguments` are the generated text of its arguments as it is (compact
JSON), so that streamed (`Streamed`: `delta.tool_calls` fragments as they are
generated, vLLM's way) they add up to the same string.
"""

from __future__ import annotations

import json
import os
import re

from tpkit.serve import grammar

_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


def style(template: str | None) -> str | None:
    """The tool-call format a chat template defines: "hermes", "llama3", or None."""
    if not template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "tools" in template and '"parameters"' in template:
        return "llama3"
    return None


def forced_grammar(tools: list[dict], choice, parallel: bool) -> str | None:
    """The grammar of a forced call ("required" or a named function); None for
    "auto"/"none"."""
    if isinstance(choice, dict):
        return grammar.from_schema(_params(_named(tools, choice["function"]["name"])))
    if choice != "required":
        return None
    one = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                             "parameters": _params(t)},
            "required": ["name", "parameters"], "additionalProperties": False}
           for t in tools]
    schema = {"type": "array", "items": {"anyOf": one}, "minItems": 1}
    return grammar.from_schema({**schema, **({} if parallel else {"maxItems": 1})})


def calls(text: str, tools: list[dict], choice, fmt: str | None) -> list[dict] | None:
    """The tool calls in an answer (None: it is text). A forced call's output is
    parsed as the grammar shaped it; "auto"'s as the template's format."""
    try:
        if isinstance(choice, dict) or choice == "required":
            json.loads(text)  # complete
            return [_call(name, args) for name, args in forced(text, choice)]
        if fmt == "hermes":
            found = [json.loads(m) for m in _HERMES.findall(text)]
            return [_call(c["name"], json.dumps(c.get("arguments", {}))) for c in found] \
                or None
        if fmt == "llama3":
            c = json.loads(text.removeprefix("<|python_tag|>").strip())
            return [_call(c["name"], json.dumps(c.get("parameters", c.get("arguments", {}))))]
    except (ValueError, KeyError, TypeError, AttributeError):
        return None  # not a call: the answer is text
    return None


def text_around(text: str, fmt: str | None) -> str | None:
    """What an "auto" answer says besides its calls (None: nothing)."""
    rest = _HERMES.sub("", text).strip() if fmt == "hermes" else ""
    return rest or None


def known(tools: list[dict], choice) -> None:
    """KeyError naming a named tool_choice that is not among the tools."""
    if isinstance(choice, dict):
        _named(tools, choice["function"]["name"])


def _named(tools: list[dict], name: str) -> dict:
    for t in tools:
        if t["function"]["name"] == name:
            return t
    raise KeyError(f"tool_choice names the function {name!r}, which is not among the "
                   f"tools ({', '.join(t['function']['name'] for t in tools)})")


def _params(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


def _call(name: str, arguments: str) -> dict:
    return {"id": "call_" + os.urandom(12).hex(), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def forced(text: str, choice) -> list[tuple[str | None, str]]:
    """The calls a forced answer (`forced_grammar`'s) has begun, cut anywhere: each
    (its function's name, None until complete; the raw text of its arguments so far)."""
    if isinstance(choice, dict):
        return [(choice["function"]["name"], text)]
    out: list[list] = []  # "required": [{"name": ..., "parameters": {...}}, ...]
    depth, key, begun, quote, escaped = 0, None, None, None, False
    for i, ch in enumerate(text):
        if quote is not None:  # in a string
            if escaped or ch == "\\":
                escaped = not escaped
            elif ch == '"':
                word, quote = json.loads(text[quote:i + 1]), None
                if depth == 2 and key is None:
                    key = word  # a call's key
                elif depth == 2:
                    out[-1][0] = word if key == "name" else out[-1][0]
                    key = None
        elif ch == '"':
            quote = i
        elif ch in "[{":
            depth += 1
            if depth == 2:
                out.append([None, ""])
            if depth == 3 and key == "parameters":
                begun = i
        elif ch in "]}":
            if depth == 3 and begun is not None:
                out[-1][1], begun, key = text[begun:i + 1], None, None
            depth -= 1
    if begun is not None:
        out[-1][1] = text[begun:]
    return [(name, args) for name, args in out]


class Streamed:
    """A forced call streamed: each piece of text in, OpenAI's `delta.tool_calls` out (a
    call's id, type and name first, once its name is complete; then its arguments' new
    text), which the client adds up to the calls `calls()` gives."""

    def __init__(self, choice) -> None:
        self.choice, self.text = choice, ""
        self.sent: list[list] = []  # per call begun: [its id, its arguments' length sent]

    def feed(self, piece: str) -> list[dict]:
        """The deltas `piece` (the answer's next text) adds."""
        self.text += piece
        out = []
        for k, (name, args) in enumerate(forced(self.text, self.choice)):
            if name is None:
                break
            if k == len(self.sent):
                self.sent.append([_call(name, "")["id"], 0])
                out.append({"index": k, "id": self.sent[k][0], "type": "function",
                            "function": {"name": name, "arguments": ""}})
            if len(args) > self.sent[k][1]:
                out.append({"index": k, "function": {"arguments": args[self.sent[k][1]:]}})
                self.sent[k][1] = len(args)
        return out
