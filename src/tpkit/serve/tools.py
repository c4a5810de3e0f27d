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
        if isinstance(choice, dict):
            json.loads(text)
            return [_call(choice["function"]["name"], text)]
        if choice == "required":
            return [_call(c["name"], json.dumps(c["parameters"])) for c in json.loads(text)]
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
