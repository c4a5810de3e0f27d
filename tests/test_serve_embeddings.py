"""POST /v1/embeddings with the real `openai` client, on a tiny random BertModel saved by
transformers with a WordPiece tokenizer and sentence-transformers' files (mean pooling,
Normalize, max_seq_length 48 of 64 positions; `hf_folders.tiny_bert_folder`).

The reference is transformers' own: BertModel's last_hidden_state of the tokenizer's
padded batch, mean-pooled over the attention mask and L2-normalised, as
sentence-transformers computes it. Tolerances: 1e-6 (float32 round-off of unit vectors)
for tpkit against transformers, a batch against each input alone, and tp=2 against
both; base64 decodes to exactly the float answer.

At tp=1 one server runs in this process for every check; at tp=2 `tpkit serve --tp 2`
runs as a user starts it (a subprocess: the follower runs the forward through the
runner's plan broadcast).
"""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from urllib.request import Request, urlopen

import numpy as np
import openai
import pytest
import torch
import transformers

from hf_folders import tiny_bert_folder
from tpkit.mesh import ParallelMesh
from tpkit.serve.embedder import Embedder
from tpkit.spec.errors import UserError
from tpkit.weights.pooling import Pooling, read_pooling
from tpkit.weights.sources import load_model
from tpkit.weights.tokenizer import load_tokenizer

TOL = 1e-6
TEXTS = ["Tensor parallelism splits the weight", "layer 7", "all-reduce",
         "the pipeline sends activations from stage 3 to stage 0; the column-parallel fc1",
         "devices"]  # 3 to 22 tokens


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tiny_bert_folder(tmp_path_factory.mktemp("embed") / "minilm")


def reference(folder: Path, texts: list[str], mode: str = "mean", normalize: bool = True
              ) -> torch.Tensor:
    """transformers' BertModel over the tokenizer's padded batch, pooled over the mask."""
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    model = transformers.BertModel.from_pretrained(str(folder)).eval()
    enc = tok(texts, padding=True, return_tensors="pt")
    with torch.no_grad():
        h = model(**enc).last_hidden_state
    m = enc["attention_mask"].unsqueeze(-1).float()
    v = h[:, 0] if mode == "cls" else (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
    return torch.nn.functional.normalize(v, dim=1) if normalize else v


def vectors(response) -> torch.Tensor:
    assert [d.index for d in response.data] == list(range(len(response.data)))
    return torch.tensor([d.embedding for d in response.data])


def diff(a, b) -> float:
    return (torch.as_tensor(a).double() - torch.as_tensor(b).double()).abs().max().item()


@pytest.fixture(scope="module")
def server(folder, serve_in_threads):
    """(base URL, OpenAI client, embedder): tp=1, 4 x 48 padded tokens a forward."""
    model = load_model(folder, ParallelMesh.single())
    embedder = Embedder(model, read_pooling(folder), max_batch=4)
    with serve_in_threads(embedder, "minilm", load_tokenizer(folder)) as served:
        yield served


def test_embeddings_equal_transformers_pooled(server, folder):
    """A string, a batch of strings of different lengths, token ids and lists of them:
    each vector equal to transformers' within 1e-6, a batch's to each input alone; the
    openai client's default (base64) decodes to exactly the float answer."""
    url, client, _ = server
    assert [m.id for m in client.models.list()] == ["minilm"]
    ref = reference(folder, TEXTS)
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    ids = [tok(t)["input_ids"] for t in TEXTS]
    one = client.embeddings.create(model="minilm", input=TEXTS[0], encoding_format="float")
    assert diff(vectors(one)[0], ref[0]) <= TOL and len(one.data[0].embedding) == 64
    assert one.usage.prompt_tokens == one.usage.total_tokens == len(ids[0])
    batch = client.embeddings.create(model="minilm", input=TEXTS, encoding_format="float",
                                     user="someone", dimensions=64)
    got = vectors(batch)
    assert diff(got, ref) <= TOL and batch.usage.prompt_tokens == sum(map(len, ids))
    assert batch.object == "list" and batch.model == "minilm"
    assert abs(got.norm(dim=1) - 1).max() <= TOL  # normalised, as modules.json says
    alone = torch.stack([vectors(client.embeddings.create(
        model="minilm", input=t, encoding_format="float"))[0] for t in TEXTS])
    assert diff(got, alone) <= TOL and not torch.allclose(got[0], got[1], atol=0.1)
    by_ids = client.embeddings.create(model="minilm", input=ids, encoding_format="float")
    assert torch.equal(vectors(by_ids), got)
    assert torch.equal(vectors(client.embeddings.create(
        model="minilm", input=ids[3], encoding_format="float"))[0], alone[3])
    default = client.embeddings.create(model="minilm", input=TEXTS)  # asks for base64
    assert np.array_equal(np.array([d.embedding for d in default.data], dtype=np.float32),
                          got.numpy().astype(np.float32))
    raw = json.loads(urlopen(Request(url + "/v1/embeddings", json.dumps(
        {"input": TEXTS[:2], "encoding_format": "base64"}).encode(),
        {"Content-Type": "application/json"})).read())
    floats = vectors(client.embeddings.create(model="minilm", input=TEXTS[:2],
                                              encoding_format="float"))  # the same batch
    for d, v in zip(raw["data"], floats, strict=True):
        assert isinstance(d["embedding"], str)
        assert np.array_equal(np.frombuffer(base64.b64decode(d["embedding"]), "<f4"),
                              v.numpy().astype(np.float32))


def test_embeddings_errors_in_openai_shape(server, openai_server):
    """dimensions other than the width, an input over the longest the folder takes, a
    bad encoding_format, an empty or foreign-token input: 400 naming it; completions
    and chat on an encoder, embeddings on a decoder: 400 saying what the model serves."""
    url, client, embedder = server
    emb = lambda **kw: client.embeddings.create(model="minilm", **kw)  # noqa: E731
    with pytest.raises(openai.BadRequestError, match="dimensions=32: this model's embeddings "
                       "have 64 dimensions") as e:
        emb(input="layer", dimensions=32)
    assert e.value.body["param"] == "dimensions"
    with pytest.raises(openai.BadRequestError, match=r"input\[1\] has 60 tokens; this model "
                       r"embeds at most 48 tokens an input \(max positions 64, "
                       r"sentence_bert_config.json max_seq_length 48\)") as e:
        emb(input=[[5, 6], [7] * 60])
    assert e.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError, match="encoding_format='int8' must be \"float\" "
                       "or \"base64\""):
        emb(input="layer", encoding_format="int8")
    with pytest.raises(openai.BadRequestError, match=r"token ids \[9999\] are outside"):
        emb(input=[1, 9999])
    with pytest.raises(openai.BadRequestError, match="input: a batch of 2049 inputs; at most "
                       "2048 per request"):
        emb(input=["layer"] * 2049)
    for bad in ("", [], [[]]):
        with pytest.raises(openai.BadRequestError, match="input"):
            emb(input=bad)
    with pytest.raises(openai.NotFoundError, match="model 'gpt-4' is not served here"):
        client.embeddings.create(model="gpt-4", input="layer")
    with pytest.raises(openai.BadRequestError, match="is an encoder: it only serves "
                       "/v1/embeddings"):
        client.completions.create(model="minilm", prompt="layer", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="only serves /v1/embeddings"):
        client.chat.completions.create(model="minilm", messages=[{"role": "user",
                                                                  "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="'llama' is not an encoder"):
        openai_server[1].embeddings.create(model="llama", input="Tensor")
    spec = json.loads(urlopen(url + "/openapi.json").read())
    assert "input" in spec["paths"]["/v1/embeddings"]["post"]["requestBody"]["content"][
        "application/json"]["schema"]["properties"]


def test_metrics_count_embeddings(server):
    from prometheus_client.parser import text_string_to_metric_families

    url, client, _ = server

    def counts() -> dict:
        fams = text_string_to_metric_families(urlopen(url + "/metrics").read().decode())
        return {(s.name, tuple(s.labels.items())): s.value for f in fams for s in f.samples}

    before = counts()
    r = client.embeddings.create(model="minilm", input=TEXTS[:3])
    after = counts()
    grew = {k: after[k] - before.get(k, 0) for k in after}
    assert grew[("tpkit_embedding_inputs_total", ())] == 3
    assert grew[("tpkit_requests_total", (("finish", "embedded"),))] == 1
    assert grew[("tpkit_prompt_tokens_total", ())] == r.usage.prompt_tokens


def test_pooling_read_from_the_folder(folder, tmp_path, capsys):
    """cls pooling and no Normalize (read from the files) against transformers; a folder
    without modules.json pools by the mean, not normalised; max pooling and a Dense
    module are refused naming the file (`tpkit serve`: at start); a request cut into
    forwards of at most 12 padded tokens (4 of them), and 5 requests sharing one
    forward, still give transformers' vectors."""
    tok = load_tokenizer(folder)
    ids = [tok.encode(t) for t in TEXTS]
    cls = tiny_bert_folder(tmp_path / "cls", pooling="cls", normalize=False)
    assert read_pooling(cls) == Pooling("cls", False, 48)
    got = Embedder(load_model(cls), read_pooling(cls)).embed(
        [load_tokenizer(cls).encode(t) for t in TEXTS])
    assert diff(got, reference(cls, TEXTS, "cls", normalize=False)) <= 1e-5  # not unit
    (cls / "modules.json").unlink()
    assert read_pooling(cls) == Pooling("mean", False, None)
    small = Embedder(load_model(folder), read_pooling(folder), tokens_per_forward=12)
    assert diff(small.embed(ids), reference(folder, TEXTS)) <= TOL and small.runner.steps == 4
    shared = Embedder(load_model(folder), read_pooling(folder))  # 8 x 48 tokens a forward
    jobs = [shared.submit([x]) for x in ids]  # 5 requests waiting: one forward
    assert shared.step() and all(j.done.is_set() for j in jobs) and shared.runner.steps == 1
    assert diff(torch.stack([j.vectors[0] for j in jobs]), reference(folder, TEXTS)) <= TOL
    bad = tiny_bert_folder(tmp_path / "max", pooling="max")
    with pytest.raises(UserError, match=r"1_Pooling/config.json: pooling max; tpkit pools "
                       r"with one of mean, cls"):
        read_pooling(bad)
    from tpkit.cli import main

    capsys.readouterr()  # `tpkit serve` refuses it at start, in one line, before loading
    assert main(["serve", "--checkpoint", str(bad), "--port", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tpkit serve: error: ") and \
        "pooling max; tpkit pools with one of mean, cls" in err[0], err
    modules = json.loads((folder / "modules.json").read_text())
    (bad / "modules.json").write_text(json.dumps([*modules, dict(
        idx=3, name="3", path="2_Dense", type="sentence_transformers.models.Dense")]))
    with pytest.raises(UserError, match=r"lists sentence_transformers.models.Dense \(2_Dense\)"):
        read_pooling(bad)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_tp2_server_embeds_as_transformers(folder):
    """`tpkit serve --tp 2` on the folder: a batch of strings and token ids equal to
    transformers' (1e-6) and to each input alone; completions refused; SIGTERM ends it."""
    src = str(Path(__file__).resolve().parents[1] / "src")
    proc = subprocess.Popen(
        [sys.executable, "-m", "tpkit", "serve", "--checkpoint", str(folder), "--tp", "2",
         "--port", "0", "--served-model-name", "minilm"], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": src})
    try:
        first = proc.stdout.readline()
        assert first.startswith("tpkit serve: http://127.0.0.1:") and "tp=2" in first, (
            first, proc.stderr.read() if proc.poll() is not None else "")
        assert proc.stdout.readline().startswith(
            "tpkit serve: an encoder: POST /v1/embeddings only, mean pooling, L2-normalised, "
            "at most 48 tokens an input")
        client = openai.OpenAI(base_url=first.split()[2], api_key="none", max_retries=0,
                               timeout=60)
        ref = reference(folder, TEXTS)
        got = vectors(client.embeddings.create(model="minilm", input=TEXTS,
                                               encoding_format="float"))
        assert diff(got, ref) <= TOL
        ids = [load_tokenizer(folder).encode(t) for t in TEXTS]
        assert diff(vectors(client.embeddings.create(model="minilm", input=ids[1])),
                    got[1:2]) <= TOL
        with pytest.raises(openai.BadRequestError, match="only serves /v1/embeddings"):
            client.completions.create(model="minilm", prompt="layer", max_tokens=2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
