"""POST /v1/responses through the `openai` client's `responses.create`, as agent
frameworks call it: a text input with `instructions` and `max_output_tokens` answers
what the same chat completion answers (greedy: the same text, the same token counts),
`incomplete` with reason max_output_tokens when cut; streamed, the output_text deltas
add up to that text and the events come in the Responses API's order; message items
with input_text parts, and an earlier response's own output items, are taken as
input; function tools (`tool_choice` "required") give function_call items whose
arguments fit their schema, and a function_call_output continues the conversation;
`text.format` json_schema gives valid JSON; what tpkit does not do is one 400 naming it.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

ADD = {"type": "function", "name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["a"], "additionalProperties": False}}
SCHEMA = {"type": "object", "properties": {"k": {"enum": ["tp", "pp"]}}, "required": ["k"],
          "additionalProperties": False}


def check_responses(client) -> None:
    """What both layouts check."""
    r = client.responses.create(model="llama", input="Tensor parallelism", temperature=0,
                                instructions="Answer briefly.", max_output_tokens=6)
    chat = client.chat.completions.create(model="llama", temperature=0, max_tokens=6,
                                          messages=[{"role": "system", "content": "Answer briefly."},
                                                    {"role": "user", "content": "Tensor parallelism"}])
    assert r.output_text == chat.choices[0].message.content
    assert (r.usage.input_tokens, r.usage.output_tokens) == \
        (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    cut = chat.choices[0].finish_reason == "length"
    assert r.status == ("incomplete" if cut else "completed")
    assert (r.incomplete_details.reason if cut else r.incomplete_details) == \
        ("max_output_tokens" if cut else None)
    called = client.responses.create(model="llama", input="add", tools=[ADD],
                                     tool_choice="required", temperature=0)
    calls = [o for o in called.output if o.type == "function_call"]
    assert calls and called.status == "completed"
    for c in calls:
        assert c.name == "add" and c.call_id.startswith("call_")
        jsonschema.validate(json.loads(c.arguments), ADD["parameters"])
    more = client.responses.create(model="llama", tools=[ADD], max_output_tokens=4,
                                   temperature=0, input=[
                                       {"role": "user", "content": "add"}, *calls,
                                       *({"type": "function_call_output", "call_id": c.call_id,
                                          "output": "5"} for c in calls)])
    assert more.usage.input_tokens > called.usage.input_tokens


def test_responses_at_tp1(openai_server):
    check_responses(openai_server[1])


def test_streamed_events_add_up(openai_server):
    client = openai_server[1]
    kw = dict(model="llama", input="Tensor parallelism", temperature=0, max_output_tokens=6)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == f"response.{whole.status}"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
        whole.output_text == events[-1].response.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    tool_events = [e.type for e in client.responses.create(
        model="llama", input="add", tools=[ADD], tool_choice="required", temperature=0,
        stream=True)]
    assert "response.function_call_arguments.done" in tool_events
    assert tool_events[-1] == "response.completed"


def test_items_formats_and_refusals(openai_server):
    client = openai_server[1]
    first = client.responses.create(model="llama", temperature=0, max_output_tokens=4, input=[
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Tensor"}]}])
    again = client.responses.create(model="llama", temperature=0, max_output_tokens=4,
                                    input=[{"role": "user", "content": "Tensor"},
                                           *first.output, {"role": "user", "content": "and?"}])
    assert again.usage.input_tokens > first.usage.input_tokens
    typed = client.responses.create(model="llama", input="x", temperature=0, text={
        "format": {"type": "json_schema", "name": "o", "schema": SCHEMA, "strict": True}})
    jsonschema.validate(json.loads(typed.output_text), SCHEMA)
    for bad, named in [({"previous_response_id": "resp_1"}, "previous_response_id"),
                       ({"tools": [{"type": "web_search"}]}, "web_search"),
                       ({"input": [{"role": "user", "content": [
                           {"type": "input_image", "image_url": "http://x/y.png"}]}]},
                        "input_image")]:
        with pytest.raises(openai.BadRequestError, match=named):
            client.responses.create(**{"model": "llama", "input": "x", **bad})
