"""`tpkit serve` with the real `openai` client, on a tiny Llama folder with a BPE
tokenizer and a chat template.

At tp=1 the server runs in this process (the HTTP front and the serving loop in
threads): a completion, a streamed chat completion whose chunks concatenate to the
non-streamed text, stop strings, max_tokens, usage counts, log-probabilities equal to
transformers' (completion and chat, streamed too), 400 / 404 in OpenAI's
error shape, /metrics and /health, 16 concurrent requests each equal to its solo output
and to `tpkit generate`'s, and a client that hangs up freeing its slot.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.request import urlopen

import openai
import pytest

from helpers import generate_args
from tpkit.commands import generate as generate_cmd
from tpkit.mesh import ParallelMesh
from tpkit.serve.openai_api import ApiError, chat_ids, token_text
from tpkit.weights.sources import open_source
from tpkit.weights.tokenizer import ByteTokenizer, load_tokenizer

MAX_BATCH = 4  # conftest.SERVE_SLOTS: the server's engine
TEXTS = ["Tensor", "Tensor parallelism splits the weight", "the pipeline sends activations",
         "layer 7", "Tensor parallelism splits the weight matrices of layer 12 across 4 "
         "devices; the column-parallel fc1", "devices", "the row-parallel fc2 need one",
         "stage 3 to stage", "all-reduce", "of layer 33 across 8 devices; the",
         "column", "splits the weight matrices", "pipeline", "fc1 and the row-parallel",
         "Tensor parallelism splits the weight matrices of layer", "need one all-reduce, and"]


@pytest.fixture(scope="module")
def folder(chat_llama):
    return chat_llama


@pytest.fixture(scope="module")
def server(openai_server):
    """(base URL, OpenAI client, engine) of conftest's in-process server."""
    return openai_server


def complete(client, prompt, **kw):
    r = client.completions.create(model="llama", prompt=prompt, temperature=0, **kw)
    return r.choices[0].text, r.choices[0].finish_reason, r.usage


def test_completion_chat_stream_stop_usage(server, folder):
    url, client, _ = server
    assert [m.id for m in client.models.list()] == ["llama"]
    tok = load_tokenizer(folder)
    text, finish, usage = complete(client, "Tensor parallelism", max_tokens=12)
    assert finish == "length" and usage.completion_tokens == 12
    assert usage.prompt_tokens == len(tok.encode("Tensor parallelism"))
    assert usage.total_tokens == usage.prompt_tokens + 12 and text
    # a stop string taken from the middle of that (random) text: it ends just before it
    stop = next(c for c in text[len(text) // 2:] if c != "\ufffd")
    cut, finish, _ = complete(client, "Tensor parallelism", max_tokens=12, stop=["zzz", stop])
    assert (cut, finish) == (text[:text.index(stop)], "stop")
    msgs = [{"role": "user", "content": "Tensor parallelism"}]
    whole = client.chat.completions.create(model="llama", messages=msgs, max_tokens=10,
                                           temperature=0)
    chunks = list(client.chat.completions.create(
        model="llama", messages=msgs, max_tokens=10, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content and streamed
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 10
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    metrics = urlopen(url + "/metrics").read().decode()
    for name in ("tpkit_requests_total", "tpkit_time_to_first_token_seconds_bucket",
                 "tpkit_inter_token_latency_seconds_count", "tpkit_queue_length"):
        assert name in metrics
    assert json.loads(urlopen(url + "/health").read()) == {"status": "ok"}


def _transformers_steps(folder, prompt: str, n: int, k: int) -> list[tuple[str, float, list]]:
    """transformers' greedy steps: (token text, its log-probability, the k likeliest)."""
    import torch
    import transformers

    tok = load_tokenizer(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    ids, out = tok.encode(prompt), []
    text = lambda i: token_text(tok.token_bytes(int(i)))  # noqa: E731
    with torch.no_grad():
        for _ in range(n):
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].float(), -1)
            values, top = logp.topk(k)
            out.append((text(top[0]), float(values[0]),
                        [(text(i), float(v)) for i, v in zip(top, values)]))
            ids.append(int(top[0]))
    return out


def test_logprobs_equal_transformers_in_both_apis_and_streamed(server, folder):
    """A completion's `logprobs: 3` and a chat's `logprobs` + `top_logprobs: 3`: every
    chosen token's log-probability and its 3 likeliest, as transformers computes them
    (to 1e-4), streamed too (the chunks' log-probabilities are the whole answer's)."""
    _, client, _ = server
    prompt, n = "Tensor parallelism", 8
    ref = _transformers_steps(folder, prompt, n, 3)
    r = client.completions.create(model="llama", prompt=prompt, max_tokens=n, temperature=0,
                                  logprobs=3, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert lp.tokens == [t for t, _, _ in ref]
    assert max(abs(a - b) for a, (_, b, _) in zip(lp.token_logprobs, ref)) < 1e-4
    for got, (_, _, top) in zip(lp.top_logprobs, ref):
        assert list(got) == [t for t, _ in top]  # the likeliest first
        assert max(abs(got[t] - v) for t, v in top) < 1e-4
    assert lp.text_offset == [sum(map(len, lp.tokens[:i])) for i in range(n)]
    chunks = list(client.completions.create(model="llama", prompt=prompt, max_tokens=n,
                                            temperature=0, logprobs=3, stream=True,
                                            extra_body={"ignore_eos": True}))
    streamed = [x for c in chunks if c.choices[0].logprobs
                for x in c.choices[0].logprobs.token_logprobs]
    assert streamed == lp.token_logprobs
    msgs = [{"role": "user", "content": "Tensor parallelism"}]
    chat = client.chat.completions.create(model="llama", messages=msgs, max_tokens=4,
                                          temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 4
    for c in content:
        assert c.token == c.top_logprobs[0].token and c.logprob == c.top_logprobs[0].logprob
        assert len(c.top_logprobs) == 3
    joined = b"".join(bytes(c.bytes) for c in content).decode("utf-8", errors="replace")
    assert joined == chat.choices[0].message.content  # the tokens' bytes make the text
    plain = client.chat.completions.create(model="llama", messages=msgs, max_tokens=2,
                                           temperature=0)
    assert plain.choices[0].logprobs is None
    for bad, param in ((dict(logprobs=21), "logprobs"),):
        with pytest.raises(openai.BadRequestError, match=param):
            client.completions.create(model="llama", prompt="x", max_tokens=1, **bad)
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs=true"):
        client.chat.completions.create(model="llama", messages=msgs, max_tokens=1,
                                       top_logprobs=2)


def _transformers_scores(folder, ids: list[int]) -> list[tuple[float, float]]:
    """For each of ids[1:]: (its log-probability after the ones before, the likeliest's)."""
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)
    return [(float(logp[t, i]), float(logp[t].max())) for t, i in enumerate(ids[1:])]


def test_echo_scores_the_prompt_as_lm_eval_asks(server, folder):
    """lm-evaluation-harness's loglikelihood request (`local-completions`): the prompt as
    token ids, echo, logprobs=1, max_tokens=1. Each prompt token's log-probability (the
    first: null) and the likeliest one's, as transformers computes them (to 1e-4); the
    text is the prompt's, then the completion's."""
    _, client, _ = server
    tok = load_tokenizer(folder)
    ids = tok.encode("Tensor parallelism splits the weight matrices")
    r = client.completions.create(model="llama", prompt=[ids], max_tokens=1, temperature=0,
                                  logprobs=1, echo=True, seed=1234)
    lp, ref = r.choices[0].logprobs, _transformers_scores(folder, ids)
    assert len(lp.token_logprobs) == len(ids) + 1 and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None
    assert max(abs(a - b) for a, (b, _) in zip(lp.token_logprobs[1:len(ids)], ref)) < 1e-4
    assert max(abs(max(t.values()) - m) for t, (_, m) in zip(lp.top_logprobs[1:], ref)) < 1e-4
    assert r.choices[0].text.startswith(tok.decode(ids)) and r.usage.completion_tokens == 1
    alone = client.completions.create(model="llama", prompt=[ids], max_tokens=1,
                                      temperature=0, logprobs=1)  # no echo: the same token
    assert alone.choices[0].logprobs.token_logprobs == lp.token_logprobs[-1:]
    streamed = list(client.completions.create(model="llama", prompt=[ids], max_tokens=1,
                                              temperature=0, logprobs=1, echo=True,
                                              stream=True))  # echo streamed: prompt first
    assert "".join(c.choices[0].text for c in streamed) == r.choices[0].text
    assert [x for c in streamed if c.choices[0].logprobs
            for x in c.choices[0].logprobs.token_logprobs] == lp.token_logprobs


def test_errors_in_openai_shape(server):
    _, client, _ = server
    with pytest.raises(openai.BadRequestError, match="top_p=7 must be a number in"):
        complete(client, "Tensor", max_tokens=4, top_p=7)
    with pytest.raises(openai.BadRequestError, match=r"n=17 must be an integer in \[1, 16\]"):
        complete(client, "Tensor", max_tokens=4, n=17)
    with pytest.raises(openai.NotFoundError, match="model 'gpt-4' is not served here"):
        client.completions.create(model="gpt-4", prompt="Tensor", max_tokens=4)
    with pytest.raises(openai.APIStatusError, match="exceeds the context of 128") as e:
        complete(client, "layer " * 200, max_tokens=4)
    assert e.value.status_code == 400 and e.value.body["code"] == "context_length_exceeded"
    assert "tokens) + max_tokens (4)" in e.value.body["message"]  # both lengths, as OpenAI's
    with pytest.raises(ApiError, match="no chat template"):  # a byte-level preset has none
        chat_ids({"messages": [{"role": "user", "content": "x"}]}, ByteTokenizer(),
                 threading.Lock())


def test_16_concurrent_requests_each_equal_to_alone_and_to_generate(server, folder):
    """Greedy text of 16 prompts of different lengths, sent together (more than the 4
    slots: some wait) = each sent alone = `tpkit generate`'s."""
    _, client, _ = server
    alone = [complete(client, t, max_tokens=16)[0] for t in TEXTS]
    with ThreadPoolExecutor(len(TEXTS)) as pool:
        together = list(pool.map(lambda t: complete(client, t, max_tokens=16)[0], TEXTS))
    assert together == alone and len(set(alone)) > 8
    args = generate_args("--checkpoint", str(folder), *(a for t in TEXTS for a in ("--prompt", t)),
                         "--max-new-tokens", "16", "--max-batch", str(MAX_BATCH),
                         "--batch-invariant", "--decode-chunk", "8")
    result = generate_cmd._lead(ParallelMesh.single(), args, open_source(folder))
    tok = load_tokenizer(folder)
    assert [tok.decode(new) for new in result["new"]] == alone


def test_generate_chat_and_stop_equal_the_server(server, folder):
    """`tpkit generate --chat --stop` prints what /v1/chat/completions answers."""
    _, client, _ = server
    msgs = [{"role": "user", "content": "the pipeline"}]
    whole = client.chat.completions.create(model="llama", messages=msgs, max_tokens=12,
                                           temperature=0).choices[0].message.content
    stop = next(c for c in whole[len(whole) // 2:] if c != "\ufffd")
    cut = client.chat.completions.create(model="llama", messages=msgs, max_tokens=12,
                                         temperature=0, stop=[stop]).choices[0]
    assert (cut.message.content, cut.finish_reason) == (whole[:whole.index(stop)], "stop")
    args = generate_args("--checkpoint", str(folder), "--prompt", "the pipeline",
                         "--max-new-tokens", "12", "--stop", stop, "--chat", "--max-batch",
                         str(MAX_BATCH), "--batch-invariant", "--decode-chunk", "8")
    result = generate_cmd._lead(ParallelMesh.single(), args, open_source(folder))
    assert result["texts"] == [cut.message.content]


def test_a_client_that_hangs_up_frees_its_slot(server, monkeypatch):
    url, _, engine = server
    step = engine.step  # paced: the answer cannot end before its hang-up is seen, however
    monkeypatch.setattr(engine, "step", lambda: (time.sleep(0.3), step())[1])  # loaded
    before = engine.metrics.requests["cancelled"]
    host, port = url.split("//")[1].split(":")
    body = json.dumps({"model": "llama", "prompt": "Tensor", "max_tokens": 100,
                       "stream": True, "ignore_eos": True, "temperature": 0}).encode()
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                 b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
    got = b""
    while b"data: " not in got:
        got += sock.recv(4096)
    assert got.startswith(b"HTTP/1.1 200")  # uvicorn (the standard library said 1.0)
    sock.close()  # gone mid-stream
    deadline = time.monotonic() + 30
    while engine.metrics.requests["cancelled"] == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert engine.metrics.requests["cancelled"] == before + 1
    assert not engine.busy  # its slot is free


def test_metrics_read_by_prometheus_client_and_docs_list_the_endpoints(server):
    """/metrics parses with prometheus_client's own parser (the counts of the requests
    just answered in it); /openapi.json and /docs (FastAPI's) list every endpoint, the
    completion's body schema being the pydantic model's."""
    from prometheus_client.parser import text_string_to_metric_families

    url, client, _ = server
    before = {f.name: f for f in text_string_to_metric_families(
        urlopen(url + "/metrics").read().decode())}
    client.completions.create(model="llama", prompt="Tensor", max_tokens=3, temperature=0,
                              extra_body={"ignore_eos": True})
    after = {f.name: f for f in text_string_to_metric_families(
        urlopen(url + "/metrics").read().decode())}
    value = lambda fams, name: sum(s.value for s in fams[name].samples  # noqa: E731
                                   if s.name == name + "_total")
    assert value(after, "tpkit_generation_tokens") == value(before, "tpkit_generation_tokens") + 3
    assert after["tpkit_time_to_first_token_seconds"].type == "histogram"
    for name in ("tpkit_requests", "tpkit_prompt_tokens_computed", "tpkit_prefix_cache_hit_tokens",
                 "tpkit_kv_blocks_used", "tpkit_kv_cache_bytes", "tpkit_queue_length"):
        assert name in after, name
    spec = json.loads(urlopen(url + "/openapi.json").read())
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
            "/metrics"} <= spec["paths"].keys()
    body = spec["paths"]["/v1/completions"]["post"]["requestBody"]["content"]
    assert "prompt" in body["application/json"]["schema"]["properties"]
    docs = urlopen(url + "/docs").read().decode()
    assert "swagger" in docs.lower() and "/openapi.json" in docs


def test_n_choices_and_a_batch_of_prompts_streamed_or_not(server):
    """n=3 sampled choices of each of 2 prompts (a seed: choice i draws with seed ^ i,
    so choice 0 is the request alone and the others differ); greedy n=2 gives twice the
    greedy text; the streamed answer's choices (interleaved, by index) equal the whole
    one's; usage counts each prompt once and every choice's tokens."""
    _, client, _ = server
    kw = dict(model="llama", max_tokens=6, temperature=1.0, seed=7,
              extra_body={"ignore_eos": True})
    prompts = ["Tensor parallelism", "Pipeline"]
    whole = client.completions.create(prompt=prompts, n=3, **kw)
    texts = [c.text for c in sorted(whole.choices, key=lambda c: c.index)]
    assert [c.index for c in whole.choices] == list(range(6)) and len(set(texts)) > 2
    for p, first in zip(prompts, (texts[0], texts[3])):
        assert client.completions.create(prompt=p, **kw).choices[0].text == first
    alone = [client.completions.create(prompt=p, **kw).usage.prompt_tokens for p in prompts]
    assert whole.usage.prompt_tokens == sum(alone) and whole.usage.completion_tokens == 36
    got = ["" for _ in texts]
    for c in client.completions.create(prompt=prompts, n=3, stream=True, **kw):
        got[c.choices[0].index] += c.choices[0].text
    assert got == texts
    greedy = client.completions.create(model="llama", prompt="Tensor", max_tokens=5,
                                       temperature=0, n=2)
    assert greedy.choices[0].text == greedy.choices[1].text == complete(
        client, "Tensor", max_tokens=5)[0]
    chat = client.chat.completions.create(model="llama", max_tokens=4, temperature=0, n=2,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert len(chat.choices) == 2 and chat.choices[0].message.content == \
        chat.choices[1].message.content
