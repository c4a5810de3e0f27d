"""What real OpenAI clients send, through the `openai` client: a message's content as a
list of text parts (LangChain's habit) renders as the same string, joined by newlines;
`tools: null`/`[]`, `tool_choice: "auto"` and `response_format: {"type": "text"}` are
no tools and plain text, while real tools, other response formats and other part
types are one 400 naming them; a chat completion without `max_tokens` runs to the end
of its answer or of the context (OpenAI's default), a completion keeps OpenAI's 16;
`usage.prompt_tokens_details.cached_tokens` counts the prefix cache's tokens;
`system_fingerprint` names tpkit's version, dtype and tp; a prompt over the context is
a 400 `context_length_exceeded`; `--api-key` (or TPKIT_API_KEY) guards every /v1/ path
with a 401 in OpenAI's shape, /health stays open; logit_bias and the penalties shape
the logits as their formulas say. At tp=1 in this process, and at tp=2 through `tpkit
serve` as a user runs it (with structured outputs, forced tool calls and the Responses
API of their own files).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from tpkit.mesh import ParallelMesh
from tpkit.weights.tokenizer import load_tokenizer

SRC = str(Path(__file__).resolve().parents[1] / "src")
MSG = [{"role": "user", "content": "Tensor parallelism\nsplits the weight"}]
PARTS = [{"role": "user", "content": [{"type": "text", "text": "Tensor parallelism"},
                                      {"type": "text", "text": "splits the weight"}]}]


def chat(client, messages, **kw):
    return client.chat.completions.create(model="llama", messages=messages, temperature=0,
                                          **kw)


def status(url: str, path: str, key: str | None = None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url + path, headers=headers),
                                    timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def check_surface(client, max_len: int, tp: int, tok) -> None:
    """The checks both layouts pass (greedy: the same request gives the same text)."""
    plain = chat(client, MSG, max_tokens=8)
    parts = chat(client, PARTS, max_tokens=8, tools=[], tool_choice="auto",
                 response_format={"type": "text"}, extra_body={"parallel_tool_calls": True})
    assert parts.choices[0].message.content == plain.choices[0].message.content
    assert parts.usage.prompt_tokens == plain.usage.prompt_tokens
    assert parts.system_fingerprint.startswith("tpkit-") and \
        parts.system_fingerprint.endswith(f"-tp{tp}")
    whole = chat(client, MSG)  # no max_tokens: to the end of the answer or the context
    u, c = whole.usage, whole.choices[0]
    assert c.message.content.startswith(plain.choices[0].message.content)
    assert c.finish_reason == "stop" or u.prompt_tokens + u.completion_tokens == max_len, \
        (c.finish_reason, u)
    assert u.completion_tokens > 16 or c.finish_reason == "stop"
    short = client.completions.create(model="llama", prompt="Tensor", temperature=0)
    assert short.usage.completion_tokens <= 16  # a completion keeps OpenAI's default
    with pytest.raises(openai.BadRequestError, match="context_length_exceeded|exceeds") as e:
        chat(client, [{"role": "user", "content": "layer " * 300}], max_tokens=4)
    assert e.value.body["code"] == "context_length_exceeded" and e.value.status_code == 400
    check_logits_shaped(client, tok)
    for bad, named in [({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}, "image_url"),
            ({"tools": [{"type": "function", "function": {"name": "f"}}],
              "tool_choice": {"type": "function", "function": {"name": "g"}}}, "'g'"),
            ({"response_format": {"type": "xml"}}, "response_format")]:
        body = {"messages": MSG, "max_tokens": 2, **bad}
        with pytest.raises(openai.BadRequestError, match=named):
            client.chat.completions.create(model="llama", **body)


def check_logits_shaped(client, tok) -> None:
    """logit_bias +100 forces a token; penalties change a greedy answer that repeats;
    values that ask for nothing change nothing; a token outside the vocabulary is a 400."""
    def complete(**kw):
        r = client.completions.create(model="llama", prompt="Tensor parallelism",
                                      temperature=0, max_tokens=8, **kw)
        return r.choices[0].text

    plain = complete()
    assert complete(presence_penalty=0, frequency_penalty=0, logit_bias={},
                    extra_body={"repetition_penalty": 1.0, "min_tokens": 0}) == plain
    forced = complete(logit_bias={"100": 100}, extra_body={"ignore_eos": True})
    assert forced == tok.decode([100] * 8) != plain
    assert complete(extra_body={"repetition_penalty": 100.0}) != plain
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        complete(logit_bias={"99999999": 5})


def test_surface_at_tp1(openai_server, chat_llama):
    _, client, engine = openai_server
    check_surface(client, engine.max_len, 1, load_tokenizer(chat_llama))
    long = [{"role": "user", "content": "a prompt no other test sends, " * 4}]
    first, again = chat(client, long, max_tokens=2), chat(client, long, max_tokens=2)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert 16 <= cached < again.usage.prompt_tokens and cached % 16 == 0
    assert again.choices[0].message.content == first.choices[0].message.content


def test_api_key_at_tp1(chat_llama, serve_in_threads):
    from tpkit.serve import Engine
    from tpkit.weights.sources import load_model

    model, tok = load_model(chat_llama, ParallelMesh.single()), load_tokenizer(chat_llama)
    engine = Engine(model, tokenizer=tok, max_batch=2)
    with serve_in_threads(engine, "llama", tok, api_key="s3cret",
                          metrics_need_key=True) as (url, client, _):
        assert chat(client, MSG, max_tokens=2).choices[0].message.content is not None
        with pytest.raises(openai.AuthenticationError) as e:
            openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0
                          ).chat.completions.create(model="llama", messages=MSG)
        assert e.value.body["code"] == "invalid_api_key"
        assert status(url, "/health") == 200  # open: load balancers probe it
        assert status(url, "/metrics") == 401 and status(url, "/metrics", "s3cret") == 200
        assert status(url, "/v1/models") == 401 and status(url, "/v1/models", "s3cret") == 200


def test_empty_api_key_is_one_line():
    env = {**os.environ, "PYTHONPATH": SRC, "TPKIT_API_KEY": " "}
    r = subprocess.run([sys.executable, "-m", "tpkit", "serve", "--checkpoint", "nowhere"],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "TPKIT_API_KEY) must not be empty" in r.stderr and len(r.stderr.splitlines()) == 1


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_surface_at_tp2_with_the_key_from_the_environment(chat_llama, serve_in_threads):
    env = {**os.environ, "PYTHONPATH": SRC, "TPKIT_API_KEY": "k2"}
    proc = subprocess.Popen([sys.executable, "-m", "tpkit", "serve", "--checkpoint",
                             str(chat_llama), "--tp", "2", "--port", "0", "--max-batch", "2",
                             "--served-model-name", "llama"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.startswith("tpkit serve: http://127.0.0.1:"), (line, proc.stderr.read())
        url, max_len = line.split()[2], int(line.split("max_len=")[1])
        client = openai.OpenAI(base_url=url, api_key="k2", max_retries=0, timeout=60)
        check_surface(client, max_len, 2, load_tokenizer(chat_llama))
        from test_serve_structured import SCHEMAS, check_schemas, greedy

        answers = check_schemas(client, SCHEMAS)  # structured outputs at tp=2, every schema
        from tpkit.serve import Engine
        from tpkit.weights.sources import load_model

        one = Engine(load_model(chat_llama, ParallelMesh.single()), max_batch=2,
                     tokenizer=load_tokenizer(chat_llama))  # as `tpkit serve` at tp=1
        with serve_in_threads(one, "llama", one.tokenizer) as (_, tp1, _):
            assert answers == [greedy(tp1, s) for s in SCHEMAS]  # each shard masked: tp=1's
        from test_serve_tools import check_forced

        check_forced(client)  # forced tool calls at tp=2
        from test_serve_responses import check_responses

        check_responses(client)  # the Responses API at tp=2
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="k1", max_retries=0).models.list()
        assert json.loads(urllib.request.urlopen(url.removesuffix("/v1") + "/health",
                                                 timeout=30).read())["status"] == "ok"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def test_logits_shaped_as_openai_and_vllm_say():
    """`serve.logits.process` against the formulas written out token by token:
    repetition (l > 0: l / r, else l * r, over prompt and answer), then
    l -= f * count + p * (count > 0) over the answer, then the bias, then min_tokens'
    -inf on end-of-sequence tokens."""
    import torch

    from tpkit.serve.logits import process
    from tpkit.serve.params import SamplingParams

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, generator=g)
    prompt, tokens, eos = [3, 4, 4], [7, 7, 9, 3], {2}
    params = SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4,
                            presence_penalty=0.25, logit_bias=((11, -100), (7, 2.5)),
                            min_tokens=5)
    want = logits.tolist()
    for t in set(prompt + tokens):
        want[t] = want[t] / 1.3 if want[t] > 0 else want[t] * 1.3
    for t in set(tokens):
        want[t] -= 0.4 * tokens.count(t) + 0.25
    want[11] -= 100
    want[7] += 2.5
    want[2] = float("-inf")
    got = process(logits, params, prompt, tokens, eos)
    assert torch.allclose(got, torch.tensor(want), rtol=1e-6, atol=0)
    assert process(logits, SamplingParams(), prompt, tokens, eos) is logits  # untouched
    ended = process(logits, SamplingParams(min_tokens=4), prompt, tokens, eos)
    assert ended[2] == logits[2]  # 4 tokens generated: the end may come
