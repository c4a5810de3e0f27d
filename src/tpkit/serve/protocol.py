"""The OpenAI request bodies as a strict schema (pydantic v2), checked at the edge,
before anything reaches the engine; the HTTP layer's only way in.

    body = parse_json(raw)                       # bytes -> dict; depth and JSON checked
    req = validate(body, chat=False)             # CompletionRequest | ChatRequest
    req.sampling(), req.prompt / req.messages    # SamplingParams; str | list[int]
    validate(body, EmbeddingRequest).input       # POST /v1/embeddings: the inputs

Strict: no bool taken as a number, no string as a bool, no unknown field; every
string must be text (UTF-8: a lone surrogate is refused, in a key too); nesting at
most `MAX_DEPTH` deep, scanned (in linear time) before the JSON is parsed. The sampling
values' bounds are `tpkit.serve.params.RULES` (the same as `tpkit generate`'s flags). A bad body is an
`ApiError` 400 in OpenAI's shape, naming the field:

    {"error": {"message": "temperature=-1 must be ...", "type": "invalid_request_error",
               "param": "temperature", "code": "invalid_value"}}
"""

from __future__ import annotations

import json
import re
import sys
from itertools import accumulate
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from tpkit.serve import grammar, tools
from tpkit.serve.fields import (
    Batch,
    Number,
    Stop,
    StreamOptions,
    Strict,
    Text,
    as_batch,
    compiles,
    few,
    given_or,
    refuse,
    rule,
    short,
)
from tpkit.serve.messages import Chosen, Message, Tool
from tpkit.serve.openai_api import ApiError
from tpkit.serve.params import SamplingError, SamplingParams, problem

MAX_DEPTH = 16  # of [ and { in a body: a chat message's content parts need ~5
ECHO = "echo=True: a completion (not chat) may echo its prompt (echo=true)"
MAX_N, MAX_PROMPTS = 16, 32  # choices per prompt; prompts per completion request
MAX_INPUTS = 2048  # inputs per embeddings request (OpenAI's limit)
COMPLETION_MAX_TOKENS = 16  # a completion without max_tokens (OpenAI's and vLLM's default);
# a chat completion without one generates to the end of its answer or of the context


# -- bytes to a JSON object ------------------------------------------------------------
# A string up to its closing quote, or to the end: an unclosed one matches too, so no
# match ever fails (and is tried again from inside the string, which made the scan
# quadratic): every byte is read once, in time linear in the body's length.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
_NOT_BRACKET = bytes(sorted(set(range(256)) - set(b"[]{}")))
_STEP = {ord("["): 1, ord("{"): 1, ord("]"): -1, ord("}"): -1}


def depth(raw: bytes) -> int:
    """How deep [ and { nest in a JSON text (strings skipped), in time linear in its
    length (a 1 MiB body: tens of ms, whatever its shape)."""
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKET)
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0)


def _no_constant(name: str):
    raise ApiError(400, f"the body is not JSON: {name} is not a JSON number")


def parse_json(raw: bytes) -> dict:
    """The JSON object of a body; ApiError 400 for text that is not UTF-8, nesting
    deeper than MAX_DEPTH, anything that is not JSON (NaN, Infinity too) or not an
    object, an integer too long to read (naming where it is)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the body is not UTF-8 text: {e}") from None
    if depth(raw) > MAX_DEPTH:
        raise ApiError(400, f"the body nests deeper than {MAX_DEPTH} levels")
    try:
        body = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise ApiError(400, f"the body is not JSON: {e}") from None
    except ValueError as e:  # an integer of more digits than int() reads
        raise _long_integer(text, e) from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


class _Digits(str):
    """An integer too long for int(): its digits, where it stood in the body."""


def _long_integer(text: str, e: ValueError) -> ApiError:
    """The 400 of a body holding an integer longer than int() reads, naming its field."""
    most = sys.get_int_max_str_digits()
    body = json.loads(text, parse_int=lambda s: _Digits(s) if len(s.lstrip('-')) > most else int(s))
    found = _first_long(body, "")
    if found is None:
        return ApiError(400, f"the body is not JSON: {e}")
    path, digits = found
    return ApiError(400, f"{path}: an integer of {len(digits.lstrip('-'))} digits (at most "
                         f"{most} are read)", path, "invalid_value")


def _first_long(value: Any, path: str) -> tuple[str, _Digits] | None:
    """(its path, itself) of the first `_Digits` in a parsed body (nested at most
    MAX_DEPTH deep: the recursion is bounded)."""
    if isinstance(value, _Digits):
        return path or "the body", value
    inner = value.items() if isinstance(value, dict) else \
        enumerate(value) if isinstance(value, list) else ()
    for k, v in inner:
        where = f"{path}[{k}]" if isinstance(k, int) else f"{path}.{k}" if path else k
        if (found := _first_long(v, where)) is not None:
            return found
    return None


class _Request(Strict):
    """The fields both endpoints take (OpenAI's defaults: temperature 1, top_p 1)."""

    model: Text | None = None
    max_tokens: Annotated[StrictInt | None, rule("max_tokens")] = None
    temperature: Annotated[Number, rule("temperature")] = None
    top_p: Annotated[Number, rule("top_p")] = None
    top_k: Annotated[StrictInt | None, rule("top_k")] = None
    seed: Annotated[StrictInt | None, rule("seed")] = None
    stop: Stop = None
    n: StrictInt | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    user: Text | None = None
    ignore_eos: StrictBool = False
    presence_penalty: Annotated[Number, rule("presence_penalty")] = None
    frequency_penalty: Annotated[Number, rule("frequency_penalty")] = None
    repetition_penalty: Annotated[Number, rule("repetition_penalty")] = None  # vLLM's
    logit_bias: dict[str, StrictInt | StrictFloat] | None = None
    min_tokens: Annotated[StrictInt | None, rule("min_tokens")] = None  # vLLM's

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        if v is None:
            return v
        stop = (v,) if isinstance(v, str) else tuple(v)
        why = problem("stop", stop)
        return refuse(why) if why else stop

    @field_validator("n")
    @classmethod
    def _choices(cls, v):
        return refuse(f"n={v!r} must be an integer in [1, {MAX_N}] (choices per prompt)") \
            if v is not None and not 1 <= v <= MAX_N else v

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v):
        if v is None:
            return v
        bad = [k for k in v if not (k.isascii() and k.isdigit())]
        if bad:
            refuse(f"logit_bias: the key {short(bad[0])} is not a token id (a decimal "
                    f"integer as a string)")
        pairs = tuple((int(k), b) for k, b in v.items())
        why = problem("logit_bias", pairs)
        return refuse(why) if why else pairs

    def _params(self, max_tokens: int | None, logprobs: int | None, echo: bool
                ) -> SamplingParams:
        given = given_or
        try:
            return self._sampling(max_tokens, logprobs, echo, given)
        except SamplingError as e:  # what no one field shows (min_tokens > max_tokens)
            raise ApiError(400, str(e), e.problems[0][0], "invalid_value") from None

    def _sampling(self, max_tokens, logprobs, echo, given) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens, temperature=given(self.temperature, 1.0),
            top_p=given(self.top_p, 1.0), top_k=given(self.top_k, 0), seed=self.seed,
            stop=self.stop or (), ignore_eos=self.ignore_eos, logprobs=logprobs, echo=echo,
            presence_penalty=given(self.presence_penalty, 0.0),
            frequency_penalty=given(self.frequency_penalty, 0.0),
            repetition_penalty=given(self.repetition_penalty, 1.0),
            logit_bias=self.logit_bias or (), min_tokens=given(self.min_tokens, 0),
            grammar=self._grammar())

    def _grammar(self) -> str | None:
        if getattr(self, "forced", False):
            return tools.forced_grammar(self.offered, self.choice,
                                        self.parallel_tool_calls is not False)
        fmt = getattr(self, "response_format", None)
        return grammar.from_response_format(fmt) if fmt is not None else None

    @property
    def include_usage(self) -> bool:
        """Does a stream end with a usage chunk?"""
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Request):
    """POST /v1/completions: a prompt (text or token ids) or a batch of them (at most
    `MAX_PROMPTS`); `prompt` is always the list of prompts once validated."""

    prompt: Annotated[Batch, Field(description="must be a non-empty string, a list of token "
                                               "ids, or a list of those (a batch of prompts)")]
    logprobs: Annotated[StrictInt | None, rule("logprobs")] = None
    echo: StrictBool = False
    top_logprobs: Annotated[None, Field(description="is a chat parameter: a completion "
                                                    "takes logprobs=k")] = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _few_prompts(cls, p):  # before the union is tried on each of a batch's prompts
        return few(p, "prompt", MAX_PROMPTS)

    @field_validator("prompt")
    @classmethod
    def _batch(cls, p):
        return as_batch(p)

    def sampling(self) -> SamplingParams:
        """The SamplingParams asked for (`logprobs: k`: the k likeliest per token)."""
        return self._params(given_or(self.max_tokens, COMPLETION_MAX_TOKENS), self.logprobs,
                            self.echo)


class ChatRequest(_Request):
    """POST /v1/chat/completions: messages, rendered by the tokenizer's chat template."""

    messages: Annotated[list[Message], Field(min_length=1, fail_fast=True, description=
                        "must be a non-empty list of {role, content} strings")]
    max_completion_tokens: Annotated[StrictInt | None, rule("max_tokens",
                                                             "max_completion_tokens")] = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt | None, rule("logprobs", "top_logprobs")] = None
    echo: StrictBool = False
    tools: list[Tool] | None = None  # null or []: no tools, as some clients always send
    tool_choice: Literal["none", "auto", "required"] | Chosen | None = None
    parallel_tool_calls: StrictBool | None = None
    response_format: dict | None = None

    @model_validator(mode="after")
    def _tools_agree(self):
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            refuse(f"tool_choice={short(self.choice)} needs tools")
        try:
            tools.known(self.offered, self.choice)
        except KeyError as e:
            refuse(e.args[0])
        if self.forced and self.response_format not in (None, {"type": "text"}):
            refuse("response_format and a forced tool call (tool_choice) cannot be asked "
                   "together")
        return self

    @property
    def offered(self) -> list[dict]:
        """The tools the template renders (none with tool_choice "none")."""
        return [] if self.tool_choice == "none" else \
            [t.model_dump(exclude_none=True) for t in self.tools or ()]

    @property
    def choice(self):
        """tool_choice as `tpkit.serve.tools` takes it (default "auto")."""
        c = self.tool_choice or "auto"
        return c if isinstance(c, str) else c.model_dump()

    @property
    def forced(self) -> bool:
        """Must the answer be a tool call (the grammar makes it one)?"""
        return bool(self.offered) and self.choice not in ("auto", "none")

    @field_validator("response_format")
    @classmethod
    def _compiles(cls, v):
        return compiles(grammar.from_response_format, v, "response_format")

    @field_validator("echo")
    @classmethod
    def _echo(cls, v):
        return refuse(ECHO) if v else v

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, v, info: ValidationInfo):
        return refuse("top_logprobs needs logprobs=true") if v is not None and not \
            info.data.get("logprobs") else v

    def sampling(self) -> SamplingParams:
        """The SamplingParams asked for (`logprobs` + `top_logprobs: k`)."""
        lp = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(self.max_completion_tokens or self.max_tokens, lp, False)


class EmbeddingRequest(Strict):
    """POST /v1/embeddings: a string, a list of token ids, or a list of those (at most
    `MAX_INPUTS`); `input` is always the list of inputs once validated."""

    input: Annotated[Batch, Field(description="must be a non-empty string, a list of token "
                                              "ids, or a list of those")]
    model: Text | None = None
    encoding_format: Annotated[Literal["float", "base64"] | None, Field(
        description='must be "float" or "base64"')] = None
    dimensions: StrictInt | None = None
    user: Text | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _few_inputs(cls, p):
        return few(p, "input", MAX_INPUTS)

    @field_validator("input")
    @classmethod
    def _batch(cls, p):
        return as_batch(p)


# -- pydantic's errors as OpenAI's -----------------------------------------------------
WORDS = {"int_type": "must be an integer", "float_type": "must be a number",
         "bool_type": "must be true or false", "string_type": "must be a string",
         "list_type": "must be a list", "model_type": "must be an object",
         "dict_type": "must be an object", "missing": "is required",
         "too_short": "must not be empty", "string_too_short": "must not be empty",
         "none_required": "is not taken here"}


def validate(body: dict, chat: bool | type[BaseModel]
             ) -> CompletionRequest | ChatRequest | EmbeddingRequest:
    """The request of a parsed body (a completion, a chat completion, or the model class
    given, `EmbeddingRequest`), or ApiError 400 naming its first bad field."""
    model = chat if isinstance(chat, type) else ChatRequest if chat else CompletionRequest
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise _api_error(e.errors(include_url=False), body, model) from None


def _api_error(errors: list[dict], body: dict, model: type[BaseModel]) -> ApiError:
    unknown = [e["loc"][0] for e in errors if e["type"] == "extra_forbidden"]
    if unknown:
        return ApiError(400, f"unsupported parameters: {', '.join(map(str, unknown))}",
                        str(unknown[0]), "unknown_parameter")
    e = errors[0]
    path, value = _where(body, e["loc"])
    if e["type"] == "string_unicode":  # a key (pydantic reads keys as UTF-8) that is not
        key = f"{path}.{ascii(e['input'])[1:-1]}" if path else ascii(e["input"])[1:-1]
        return ApiError(400, f"{key}: a key must be text (a lone surrogate is not UTF-8)",
                        key, "invalid_value")
    if e["type"] in ("invalid_value", "invalid_text"):
        why = e["msg"] if e["type"] == "invalid_value" else f"{path} {e['msg']}"
        return ApiError(400, why, path, "invalid_value")
    field = model.model_fields.get(str(e["loc"][0])) if e["loc"] else None
    top = field is not None and "." not in path and "[" not in path and e["type"] != "missing"
    words = (field.description if top else None) or WORDS.get(e["type"], e["msg"].lower())
    got = f"={short(value)}" if e["type"] != "missing" else ""
    return ApiError(400, f"{path}{got} {words}", path, "invalid_type")


def _where(body: Any, loc: tuple) -> tuple[str, Any]:
    """'messages[0].content' and its value: the part of `loc` that is in the body (a
    union's member names are not)."""
    path, value = "", body
    for k in loc:
        if isinstance(value, dict) and k in value:
            path, value = f"{path}.{k}" if path else str(k), value[k]
        elif isinstance(value, list) and isinstance(k, int) and 0 <= k < len(value):
            path, value = f"{path}[{k}]", value[k]
        elif isinstance(value, dict) and isinstance(k, str):  # a missing field
            path = f"{path}.{k}" if path else k
            break
        else:
            break
    return path, value
