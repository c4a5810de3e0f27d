"""The pieces the OpenAI request schemas are made of (`tpkit.serve.protocol`,
`tpkit.serve.messages`): strict text (UTF-8, no lone surrogate), numbers, stop strings,
token ids, batches, a field's bound from `tpkit.serve.params.RULES`, and `refuse`, the
one way a validator says no (an `invalid_value` naming what is wrong).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
)
from pydantic_core import PydanticCustomError

from tpkit.serve.params import problem, shown
from tpkit.spec.errors import UserError


def given_or(x, default):
    """`x`, or `default` where it is None (absent)."""
    return default if x is None else x


def utf8(s: str) -> str:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise PydanticCustomError("invalid_text", "must be text (a lone surrogate at "
                                  "character {at} is not UTF-8)", {"at": e.start}) from None
    return s


def rule(name: str, as_name: str | None = None) -> AfterValidator:
    """`params.RULES[name]` as a field's validator (None passes: the default)."""
    def check(value):
        why = None if value is None else problem(name, value, as_name)
        if why is not None:
            raise PydanticCustomError("invalid_value", why)
        return value
    return AfterValidator(check)


def refuse(why: str):
    raise PydanticCustomError("invalid_value", why)


def compiles(make, value, field: str):
    """`value`, once `make(value)` (a grammar, cached) compiled it; refused naming `field`."""
    try:
        None if value is None else make(value)
    except UserError as e:
        refuse(f"{field}: {e}")
    return value


Text = Annotated[StrictStr, AfterValidator(utf8)]
Word = Annotated[Text, Field(min_length=1)]
Number = Annotated[StrictInt | StrictFloat | None, Field(description="must be a number")]
Stop = Annotated[Text | Annotated[list[Text], Field(fail_fast=True)] | None,
                 Field(description="must be a string or a list of strings")]
TokenIds = Annotated[list[StrictInt], Field(min_length=1, fail_fast=True)]  # one error: fast
Batch = (Word | TokenIds | Annotated[list[Word], Field(min_length=1, fail_fast=True)] |
         Annotated[list[TokenIds], Field(min_length=1, fail_fast=True)])  # one, or a list


def few(p, field: str, most: int):
    """A batch of at most `most` (checked before the union is tried on each of them)."""
    if isinstance(p, list) and len(p) > most and isinstance(p[0], str | list):
        refuse(f"{field}: a batch of {len(p)} {field}s; at most {most} per request")
    return p


def as_batch(p) -> list:
    """A validated `Batch` as the list of its members."""
    return list(p) if isinstance(p, list) and isinstance(p[0], str | list) else [p]


class Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class StreamOptions(Strict):
    """`stream_options`: the usage counts as a last chunk."""

    include_usage: StrictBool | None = None


def short(value: Any) -> str:
    text = shown(value)
    return text if len(text) <= 40 else text[:37] + "..."
