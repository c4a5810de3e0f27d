"""A generated answer's JSON, from the request handles: a choice of a whole answer
(its text, an echoed prompt first, log-probabilities in each API's shape), and the
streamed chunks of a chat that offered tools (`Tooled`).
"""

from __future__ import annotations

from tpkit.serve import openai_api as api
from tpkit.serve import tools
from tpkit.serve.app import App
from tpkit.serve.request import Request


def echoed(app: App, req: Request, chat: bool) -> tuple[str, dict | None]:
    """An echoed prompt's text and (asked for) its log-probabilities block."""
    with app.engine.tokenizer_lock:
        text = app.tokenizer.decode(req.prompt)
    if req.params.logprobs is None:
        return text, None
    return text, api.logprobs_block(chat, req.prompt, req.prompt_logprobs, req.prompt_top,
                                    app.tokenizer, app.engine.tokenizer_lock)


def choice(app: App, req: Request, chat: bool, index: int) -> dict:
    """Choice `index` of a whole answer: its text (after the prompt, with echo) and
    log-probabilities."""
    text, lps = req.text, token_logprobs(app, req, chat, 0, len(req.tokens))
    if req.params.echo:  # the prompt first (its own log-probabilities, if asked)
        shown, before = echoed(app, req, chat)
        text = shown + text
        if before is not None:
            after = token_logprobs(app, req, chat, 0, len(req.tokens),
                                   offset=sum(map(len, before["tokens"])))
            lps = {k: before[k] + after[k] for k in before}
    whole_choice = api.completion("", "", text, req.finish_reason, None, chat, 0,
                                  lps)["choices"][0]
    return {**whole_choice, "index": index}


def token_logprobs(app: App, req: Request, chat: bool, lo: int, hi: int, offset: int = 0
                   ) -> dict | None:
    """Tokens lo..hi-1's log-probabilities in the API's shape (None: not asked for)."""
    if req.params.logprobs is None:
        return None
    return api.logprobs_block(chat, req.tokens[lo:hi], req.logprobs[lo:hi], req.top[lo:hi],
                              app.tokenizer, app.engine.tokenizer_lock, offset)


def whole(chunk: dict, message: dict) -> dict:
    """`chunk` carrying a whole message as its delta (calls indexed, as OpenAI's)."""
    delta = {k: v for k, v in message.items() if k != "role" and v is not None}
    if "tool_calls" in delta:
        delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(delta["tool_calls"])]
    chunk["choices"][0]["delta"] = delta
    return chunk


class Tooled:
    """A streamed choice of a chat that offered tools (`asked`: its request): a forced
    call's `delta.tool_calls` as its text comes (`tools.Streamed`, vLLM's way); any other
    answer held until its end, when it is known to be calls or text, and sent whole."""

    def __init__(self, app: App, asked) -> None:
        self.app, self.asked = app, asked
        self.calls = tools.Streamed(asked.choice) if asked.forced else None

    def token(self, chunk: dict, text: str) -> dict | None:
        """`chunk` carrying what the answer's next `text` adds (None: nothing yet)."""
        deltas = self.calls.feed(text) if self.calls is not None else []
        if not deltas:
            return None
        chunk["choices"][0]["delta"] = {"tool_calls": deltas}
        return chunk

    def end(self, chunk: dict, text: str, reason: str) -> tuple[dict | None, str]:
        """At the end: `chunk` carrying the whole message (None: a forced call, streamed
        already) and the finish reason ("tool_calls" for calls)."""
        message, reason = self.app.tool_answer(self.asked, text, reason)
        return (None if self.calls is not None else whole(chunk, message)), reason
