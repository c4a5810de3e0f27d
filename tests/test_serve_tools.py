"""Tool calls through the `openai` client: `tool_choice="required"` and a named function
are forced by the grammar engine, so that a model whose chat template has no tool
format (the test model's) still returns valid calls: each call names an offered
function and its `arguments` are a JSON string valid against that function's schema
(checked by jsonschema), finish_reason "tool_calls"; `parallel_tool_calls=false` gives
one call; streamed, the `delta.tool_calls` chunks carry each call's arguments as they
are generated and assemble (the openai client's stream) into the same calls; a round
trip (the call, the client's answer as a `role: "tool"` message, the model's next
turn) is taken; `tool_choice="none"` renders no tools. The template formats that
"auto" parses (Hermes' `<tool_call>`, Llama 3's JSON) are checked on their text.
"""

from __future__ import annotations

import json

import jsonschema

from tpkit.serve import tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8},
        "unit": {"enum": ["c", "f"]}}, "required": ["city", "unit"],
        "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a", "b"],
        "additionalProperties": False}}}
TOOLS = [WEATHER, ADD]
SCHEMA = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MSG = [{"role": "user", "content": "What is the weather in Paris?"}]


def chat(client, **kw):
    return client.chat.completions.create(model="llama", messages=kw.pop("messages", MSG),
                                          temperature=0, **kw)


def valid_calls(message, most: int | None = None) -> list:
    calls = message.tool_calls
    assert calls and (most is None or len(calls) <= most), message
    for c in calls:
        assert c.type == "function" and c.id.startswith("call_")
        jsonschema.validate(json.loads(c.function.arguments), SCHEMA[c.function.name])
    return calls


def check_forced(client) -> None:
    r = chat(client, tools=TOOLS, tool_choice="required")
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    valid_calls(r.choices[0].message)
    one = chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
    assert len(valid_calls(one.choices[0].message)) == 1
    named = chat(client, tools=TOOLS, tool_choice={"type": "function",
                                                   "function": {"name": "add"}})
    [call] = valid_calls(named.choices[0].message)
    assert call.function.name == "add"


def test_forced_calls_valid_against_their_schemas(openai_server):
    check_forced(openai_server[1])


def test_streamed_calls_assemble_into_the_same_calls(openai_server):
    """Forced calls stream as they are generated (vLLM's way): a call's id and name
    once its name is complete, then its arguments in fragments, token by token; the
    openai client's stream assembly gives the calls of the same request unstreamed."""
    client = openai_server[1]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        whole = chat(client, tools=TOOLS, tool_choice=choice).choices[0].message.tool_calls
        with client.chat.completions.stream(model="llama", messages=MSG, temperature=0,
                                            tools=TOOLS, tool_choice=choice) as stream:
            fragments = [d.function.arguments for e in stream if e.type == "chunk"
                         for d in e.chunk.choices[0].delta.tool_calls or ()
                         if d.function.arguments]
            final = stream.get_final_completion().choices[0]
        assert final.finish_reason == "tool_calls"
        assert [(c.function.name, c.function.arguments) for c in final.message.tool_calls] \
            == [(c.function.name, c.function.arguments) for c in whole]
        assert len(fragments) > 3 * len(whole)  # incremental: many pieces of arguments
        valid_calls(final.message)


def test_a_round_trip_and_none(openai_server):
    client = openai_server[1]
    first = chat(client, tools=TOOLS, tool_choice={"type": "function",
                                                   "function": {"name": "get_weather"}})
    asked = first.choices[0].message
    history = [*MSG, asked.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": asked.tool_calls[0].id, "content": "sunny, 21 C"}]
    answer = chat(client, messages=history, tools=TOOLS, max_tokens=8)
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens  # the call and its answer
    plain, none = chat(client, max_tokens=4), chat(client, max_tokens=4, tools=TOOLS,
                                                   tool_choice="none")
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens  # no tools rendered
    assert none.choices[0].message.content == plain.choices[0].message.content


def test_the_formats_auto_parses():
    hermes = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": ' \
             '{"city": "Paris", "unit": "c"}}\n</tool_call>'
    [c] = tools.calls(hermes, TOOLS, "auto", "hermes")
    assert c["function"] == {"name": "get_weather",
                             "arguments": '{"city": "Paris", "unit": "c"}'}
    assert tools.text_around(hermes, "hermes") == "Let me look."
    llama = '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}'
    assert tools.calls(llama, TOOLS, "auto", "llama3")[0]["function"]["name"] == "add"
    assert tools.calls("It is sunny.", TOOLS, "auto", "hermes") is None  # text
    assert tools.style("{% for t in tools %}<tool_call>{% endfor %}") == "hermes"
    assert tools.style("{{ messages }}") is None
