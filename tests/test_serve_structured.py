"""Structured outputs (`response_format`) through the `openai` client, as users call it
(`chat.completions.create(response_format=...)`, `chat.completions.parse(
response_format=PydanticModel)`): every answer is valid against its schema (checked by
jsonschema, an independent validator) for 10 schemas (nested objects, arrays, enums,
anyOf, bounded numbers, patterns, optional fields, const), greedy and sampled, with
n > 1; greedy answers with a schema are bit for bit the same with and without the
prefix cache; a grammar that allows only the end of the sequence ends at once; a schema
that cannot be completed within max_tokens ends with finish_reason "length" (the text
is then a prefix of a valid answer, not one); a schema the engine cannot compile is one
400 naming the construct.
"""

from __future__ import annotations

import json
from enum import Enum

import jsonschema
import openai
import pytest
import torch
from pydantic import BaseModel, Field

from tpkit.kernels import decode_ops
from tpkit.mesh import ParallelMesh
from tpkit.serve import grammar
from tpkit.serve.params import SamplingParams

MSG = [{"role": "user", "content": "Describe tensor parallelism as JSON."}]
OBJ = {"type": "object", "additionalProperties": False}
SCHEMAS = [
    {**OBJ, "properties": {"kind": {"enum": ["tp", "pp", "dp"]},
                           "size": {"type": "integer", "minimum": 1, "maximum": 64}},
     "required": ["kind", "size"]},
    {**OBJ, "properties": {"layer": {**OBJ, "properties": {
        "name": {"type": "string", "maxLength": 8}, "heads": {"type": "integer", "minimum": 1,
                                                             "maximum": 32}},
        "required": ["name", "heads"]}}, "required": ["layer"]},
    {**OBJ, "properties": {"ranks": {"type": "array", "items": {"enum": [0, 1, 2, 3]},
                                     "minItems": 1, "maxItems": 4}}, "required": ["ranks"]},
    {**OBJ, "properties": {"v": {"anyOf": [{"type": "string", "maxLength": 5},
                                           {"type": "integer", "minimum": 0, "maximum": 9}]}},
     "required": ["v"]},
    {**OBJ, "properties": {"lr": {"type": "number", "minimum": 0, "maximum": 1}},
     "required": ["lr"]},
    {**OBJ, "properties": {"code": {"type": "string", "pattern": "^[a-z]{2,5}$"}},
     "required": ["code"]},
    {**OBJ, "properties": {"a": {"type": "boolean"}, "b": {"type": "null"},
                           "c": {"type": "string", "maxLength": 4}}, "required": ["a", "b"]},
    {**OBJ, "properties": {"version": {"const": "v1"}, "ok": {"type": "boolean"}},
     "required": ["version", "ok"]},
    {**OBJ, "properties": {"items": {"type": "array", "maxItems": 2, "items": {
        **OBJ, "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["id"]}}}, "required": ["items"]},
    {"type": "array", "items": {"type": "string", "enum": ["all-reduce", "all-gather"]},
     "minItems": 1, "maxItems": 3},
]


def fmt(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema,
                                                   "strict": True}}


def valid(text: str, schema: dict) -> None:
    jsonschema.validate(json.loads(text), schema)


def greedy(client, schema: dict) -> str:
    """The greedy answer to MSG with `schema`, complete and valid."""
    r = client.chat.completions.create(model="llama", messages=MSG, temperature=0,
                                       response_format=fmt(schema))
    assert r.choices[0].finish_reason == "stop", (schema, r.choices[0])
    valid(r.choices[0].message.content, schema)
    return r.choices[0].message.content


def check_schemas(client, schemas, sampled_seeds=(7,)) -> list[str]:
    """Each schema: greedy, then sampled with n=2; every choice complete and valid. The
    greedy answers."""
    answers = []
    for schema in schemas:
        answers.append(greedy(client, schema))
        for seed in sampled_seeds:
            s = client.chat.completions.create(model="llama", messages=MSG, temperature=1.0,
                                               seed=seed, n=2, response_format=fmt(schema))
            for c in s.choices:
                assert c.finish_reason == "stop", (schema, c)
                valid(c.message.content, schema)
    return answers


def test_ten_schemas_greedy_and_sampled(openai_server):
    check_schemas(openai_server[1], SCHEMAS)


class Parallelism(str, Enum):
    tp = "tp"
    pp = "pp"


class Group(BaseModel):
    kind: Parallelism
    ranks: list[int] = Field(max_length=3)
    note: str | None = Field(default=None, max_length=6)


class Plan(BaseModel):
    name: str = Field(max_length=8)
    groups: list[Group] = Field(max_length=2)


def test_parse_returns_the_pydantic_object(openai_server, chat_llama):
    from tpkit.weights.tokenizer import load_tokenizer

    client, tok = openai_server[1], load_tokenizer(chat_llama)
    close = tok.encode("}")[-1:]
    r = client.chat.completions.parse(model="llama", messages=MSG, temperature=0,
                                      response_format=Plan)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop", r.choices[0]
    assert isinstance(msg.parsed, Plan) and msg.parsed == Plan.model_validate_json(msg.content)
    assert tok.decode(close) == "}"  # favoured: the grammar still opens the object first
    obj = client.chat.completions.create(model="llama", messages=MSG, temperature=0,
                                         response_format={"type": "json_object"},
                                         logit_bias={str(close[0]): 50})
    assert json.loads(obj.choices[0].message.content) == {}


def test_refusals_and_limits(openai_server):
    client = openai_server[1]
    with pytest.raises(openai.BadRequestError, match=r"Unimplemented keys.*if"):
        client.chat.completions.create(model="llama", messages=MSG, response_format=fmt(
            {"type": "object", "if": {"required": ["a"]}}))
    long = {**OBJ, "properties": {"s": {"type": "string", "minLength": 40}}, "required": ["s"]}
    r = client.chat.completions.create(model="llama", messages=MSG, temperature=0,
                                       max_tokens=6, response_format=fmt(long))
    assert r.choices[0].finish_reason == "length"  # cut: the text is not complete JSON
    assert r.choices[0].message.content.startswith('{"s":"')
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.choices[0].message.content)


def test_greedy_with_a_schema_same_with_and_without_prefix_cache(chat_llama):
    from tpkit.serve import Engine
    from tpkit.weights.sources import load_model
    from tpkit.weights.tokenizer import load_tokenizer

    model, tok = load_model(chat_llama, ParallelMesh.single()), load_tokenizer(chat_llama)
    ids = tok.encode("Tensor parallelism splits the weight matrices of each layer " * 2)
    outs, steps = [], []
    for caching in (True, False):
        engine = Engine(model, tokenizer=tok, max_batch=2, prefix_caching=caching)
        lead = engine.runner.lead_step  # greedy with a schema: the shards' best, masked
        engine.runner.lead_step = lambda *a, lead=lead: (steps.append(a[2]), lead(*a))[1]
        for schema in SCHEMAS[:3]:
            p = SamplingParams(max_tokens=40, grammar=grammar.from_schema(schema))
            first, again = engine.generate([ids], p)[0], engine.generate([ids], p)[0]
            assert first.tokens == again.tokens and first.logprobs == again.logprobs
            valid(tok.decode(first.tokens), schema)
            outs.append(first.tokens)
    assert outs[:3] == outs[3:]
    assert steps and all(steps)  # every step on the greedy path (no logits gathered)
    nothing = SamplingParams(max_tokens=8, grammar='start: ""')  # only the end may come
    r = Engine(model, tokenizer=tok, max_batch=1).generate([ids], nothing)[0]
    assert r.finish_reason == "stop" and r.tokens == tok.eos_ids[:1]


def test_every_rank_masks_its_shard_with_rank_0s_bits(chat_llama):
    """`serve.masks`: a follower's mirrors, fed only the plans' trailers, give the same
    bitmasks as rank 0's matchers step after step: rows of several requests (one
    without a grammar: all ones) in any order, a step that is not greedy (the mirrors
    dropped, the grammar and every token sent again after), and the trailer a follower
    expects after a greedy step is the one rank 0 sends."""
    from types import SimpleNamespace as NS

    from tpkit.decode.paged_kv import LAST, Piece
    from tpkit.serve.masks import Lead, Mirrors, expect
    from tpkit.serve.runner import encode
    from tpkit.weights.tokenizer import load_tokenizer

    tok = load_tokenizer(chat_llama)
    vocab = len(tok.hf)
    grammars = grammar.Grammars(tok, vocab)
    reqs = [NS(id=i, tokens=[], params=NS(grammar=g), matcher=g and grammars.matcher(g))
            for i, g in enumerate([grammar.from_schema(SCHEMAS[0]), None,
                                   grammar.from_schema(SCHEMAS[9])])]
    lead, mirrors = Lead(), Mirrors(lambda: grammar.Grammars(tok, vocab))
    steps = [([0, 1, 2], True), ([2, 0], True), ([0, 2], False), ([0], True), ([0], True)]
    want = None  # the trailer a follower expects next
    for k, (order, greedy) in enumerate(steps):
        rows = [reqs[i] for i in order]
        fwd = NS(pieces=[Piece([1], 5, [1], LAST) for _ in rows], reqs=rows)
        trailer, mine = lead.plan([fwd], greedy)
        flat = encode([fwd.pieces]) + trailer
        if k == len(steps) - 1:  # what the follower expected after the greedy step before
            assert trailer == want
        theirs = mirrors.follow(flat, [len(rows)], greedy)
        if not greedy:
            assert mine == theirs == [None]
        else:
            assert torch.equal(mine[0], theirs[0])
            assert (mine[0][order.index(1)] == -1).all() if 1 in order else True
        picked = []
        for r in rows:  # each request's first allowed token, as the shards' best would be
            t = 0 if r.matcher is None else int(decode_ops.unpacked(
                torch.from_numpy(r.matcher.bits()[None].copy()), 0, vocab)[0].nonzero()[0])
            if r.matcher is not None:
                r.matcher.take(t)
            r.tokens.append(t)
            picked.append(t)
        want = expect(flat, picked)
