"""A chat message as OpenAI's API sends it: a role, its content (a string or a list of
text parts), an assistant's `tool_calls`, a tool's answer (`tool_call_id`); and the
`tools` a request offers (`tpkit.serve.tools` renders, forces and parses them).
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import Field, StrictBool, ValidationInfo, field_validator, model_validator

from tpkit.serve import grammar
from tpkit.serve.fields import Strict, Text, compiles, refuse
from tpkit.serve.params import shown

Name = Annotated[Text, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$", description="must be 1 to "
                                   "64 letters, digits, _ or - (OpenAI's function names)")]


def _parts(content):
    """A message's content as one text: a string, or a list of text parts
    (`[{"type": "text", "text": ...}]`, as LangChain and many SDKs send it) joined with
    newlines, as vLLM joins them; another part type is refused by name."""
    if not isinstance(content, list):
        return content
    texts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            refuse(f"content[{i}].type={shown(kind)}: only text parts are served "
                    f"({{\"type\": \"text\", \"text\": ...}}); this is a text model")
        if set(part) - {"type", "text"} or not isinstance(part.get("text"), str):
            refuse(f"content[{i}] must be {{\"type\": \"text\", \"text\": a string}}")
        texts.append(part["text"])
    return "\n".join(texts)


class Called(Strict):
    """The function of an assistant's earlier tool call: its name and JSON arguments."""

    name: Name
    arguments: Text


class ToolCall(Strict):
    """An assistant's earlier tool call, sent back in the history."""

    id: Text
    type: Literal["function"] = "function"
    function: Called


class Message(Strict):
    """One chat message: a role and its text (a string or a list of text parts; an
    assistant's may be null, with tool calls); a tool's answer names its call."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | None  # required, but an assistant's may be absent (tool calls)
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: Text | None = None

    @model_validator(mode="before")
    @classmethod
    def _calls_alone(cls, data):
        if isinstance(data, dict) and data.get("role") == "assistant" and "content" not in data:
            return {**data, "content": None}
        return data

    @field_validator("content", mode="before")
    @classmethod
    def _text(cls, v):
        return _parts(v)

    @field_validator("content")
    @classmethod
    def _needed(cls, v, info: ValidationInfo):
        return refuse("content must be a string or a list of text parts (null only in "
                      "an assistant's message)") if v is None and \
            info.data.get("role") != "assistant" else v

    def for_template(self) -> dict:
        """As chat templates take it (a call's arguments as an object, as vLLM gives
        them; the text "" where there is none)."""
        out = {"role": self.role, "content": self.content or ""}
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _loaded(c.function.arguments)}}
                for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


def _loaded(arguments: str):
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


class Function(Strict):
    """A function a request offers: its name, what it does, its parameters' schema."""

    name: Name
    description: Text | None = None
    parameters: dict | None = None
    strict: StrictBool | None = None

    @field_validator("parameters")
    @classmethod
    def _compiles(cls, v):
        return compiles(grammar.from_schema, v, "parameters")


class Tool(Strict):
    """`tools[i]`: a function."""

    type: Literal["function"]
    function: Function


class ChosenName(Strict):
    """The function `tool_choice` names."""

    name: Name


class Chosen(Strict):
    """`tool_choice` naming one function: it must be called."""

    type: Literal["function"]
    function: ChosenName
