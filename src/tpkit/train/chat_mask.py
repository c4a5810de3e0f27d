"""The assistant's tokens of a chat, for `tpkit train --loss-on assistant`.

A chat is rendered with the tokenizer's chat template as `prepare-data --chat-field`
always did; each assistant turn's characters are found as TRL finds them, by rendering
prefixes of the conversation:

    before = template(messages[:i], add_generation_prompt=True)   ends with "assistant:"
    through = template(messages[:i + 1])                           ends after turn i
    turn i's span = [len(before), len(through))                    its text and end marker

(both must begin the whole rendering; where a template renders a turn differently once
more turns follow, the data gets no mask and `--loss-on assistant` refuses it, saying so). The rendering is then tokenized whole,
as before, and a token is the assistant's when its first character lies in a span
(the tokenizer's offsets). `ChatText` is the rendered text carrying its spans, so the
mask follows the text through `tokenizing` (worker processes included); the mask of a
token is stored next to it (`tokens.ShardWriter`).
"""

from __future__ import annotations

ASSISTANT = "assistant"


class ChatText(str):
    """A rendered chat: its text, and the character spans of the assistant's turns (None:
    not found, `problem` says why)."""

    spans: tuple[tuple[int, int], ...] | None = None

    def __new__(cls, text: str, spans: tuple[tuple[int, int], ...] | None) -> ChatText:
        out = super().__new__(cls, text)
        out.spans = spans
        return out

    def __reduce__(self):  # to a worker process and back, spans included
        return ChatText, (str(self), self.spans)


UNFOUND = ("the chat template renders an assistant's turn differently once later "
           "messages follow")
SLOW = "the tokenizer is not a fast (tokenizer.json) one, which gives the offsets needed"


def render(hf, messages: list) -> ChatText:
    """`messages` rendered by the chat template of `hf` (a transformers tokenizer), with
    the span of each assistant turn (None when a prefix does not begin the rendering)."""
    text = hf.apply_chat_template(messages, tokenize=False)
    spans = []
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and m.get("role") == ASSISTANT):
            continue
        before = _before(hf, messages[:i])
        through = hf.apply_chat_template(messages[:i + 1], tokenize=False)
        if not (text.startswith(before) and text.startswith(through)
                and len(before) <= len(through)):
            return ChatText(text, None)
        spans.append((len(before), len(through)))
    return ChatText(text, tuple(spans))


def _before(hf, messages: list) -> str:
    """`messages` rendered with the prompt of the assistant's next turn ("" where a
    template cannot render no message)."""
    try:
        return hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template may raise anything on no message
        if messages:
            raise
        return ""


def encode_with_mask(hf, text: ChatText) -> tuple[list[int], list[int] | None, str | None]:
    """(ids, mask, problem) of a rendered chat: the ids `HFTokenizer.encode(text,
    special=False)` gives, 1 for each token whose first character is in an assistant span
    (None when the spans are unknown: `problem` says why)."""
    if text.spans is None or not getattr(hf, "is_fast", False):
        ids = list(hf(str(text), add_special_tokens=False)["input_ids"])
        return ids, None, UNFOUND if text.spans is None else SLOW
    enc = hf(str(text), add_special_tokens=False, return_offsets_mapping=True)
    mask = [int(any(a <= start < b for a, b in text.spans))
            for start, _ in enc["offset_mapping"]]
    return list(enc["input_ids"]), mask, None
