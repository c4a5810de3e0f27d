"""`tpkit prepare-data` reads the data people have: .jsonl (a text field, or messages
rendered with the tokenizer's chat template), .parquet and a `datasets` save_to_disk
folder, each written here by its own library. The same documents in any format give
the same shards: each document's ids, then the end-of-sequence token; index.json holds
the summary (documents, tokens, vocabulary, dtype); several worker processes give the
same shards; a missing field or a file without usable text is one clear error."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hf_folders import train_tokenizer
from tpkit.checkpoint.tokenizer import load_tokenizer
from tpkit.cli import main
from tpkit.commands.prepare_data import prepare
from tpkit.spec.errors import UserError
from tpkit.train.tokens import open_shards

DOCS = ["Tensor parallelism splits the weight matrices.", "",  # an empty row: no document
        "The column-parallel fc1 and the row-parallel fc2 need one all-reduce.",
        "The pipeline sends activations from stage 0 to stage 1. é", "Row " * 300]
CHAT = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The same documents as .jsonl, .parquet and a datasets folder; chats as .jsonl."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset

    root = tmp_path_factory.mktemp("formats")
    tok = train_tokenizer(root / "tok")
    tok.chat_template = CHAT
    tok.save_pretrained(str(root / "tok"))
    rows = [{"text": d, "id": i} for i, d in enumerate(DOCS)]
    (root / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    pq.write_table(pa.table({"id": list(range(len(DOCS))), "text": DOCS}), root / "docs.parquet",
                   row_group_size=2)
    Dataset.from_dict({"text": DOCS}).save_to_disk(str(root / "saved"))
    chats = [[{"role": "user", "content": "What splits?"}, {"role": "assistant", "content": d}]
             for d in DOCS[2:4]]
    (root / "chats.jsonl").write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    return root, chats


def _ids(folder):
    stream, index = open_shards(folder)
    return np.asarray(stream[:len(stream)]).tolist(), index


def test_every_format_gives_each_documents_ids_then_eos(inputs, tmp_path):
    root, _ = inputs
    tok = load_tokenizer(root / "tok")
    want = [t for d in DOCS if d for t in tok.encode(d, special=False) + tok.eos_ids[:1]]
    for name in ("docs.jsonl", "docs.parquet", "saved"):
        index = prepare([str(root / name)], str(root / "tok"), str(tmp_path / name),
                        shard_tokens=97, progress=False)
        ids, read = _ids(tmp_path / name)
        assert ids == want, name
        assert (read["documents"], read["tokens"], read["vocab_size"], read["dtype"]) == \
            (4, len(want), tok.vocab_size, "uint16") and read == index


def test_chat_field_renders_the_chat_template(inputs, tmp_path):
    root, chats = inputs
    tok = load_tokenizer(root / "tok")
    prepare([str(root / "chats.jsonl")], str(root / "tok"), str(tmp_path), progress=False,
            chat_field="messages")
    text = [tok.hf.apply_chat_template(c, tokenize=False) for c in chats]
    assert text[0].startswith("<user> What splits?\n<assistant> The column-parallel")
    assert _ids(tmp_path)[0] == [t for s in text for t in tok.encode(s, special=False) + [2]]
    with pytest.raises(UserError, match="the tokenizer bytes has no chat template"):
        prepare([str(root / "chats.jsonl")], "bytes", str(tmp_path / "b"), chat_field="messages")


@pytest.mark.parametrize("name, kw, message", [
    ("docs.jsonl", dict(text_field="body"), "docs.jsonl line 1: no field 'body' (fields: "
                                            "['id', 'text']); choose one with --text-field"),
    ("docs.parquet", dict(text_field="body"), "no column 'body' (columns: ['id', 'text'])"),
    ("saved", dict(text_field="body"), "no column 'body' (columns: ['text'])"),
    ("docs.jsonl", dict(text_field="id"), "line 1: 'id' is a int, not text"),
    ("empty.jsonl", {}, "no usable text in"),
    ("bad.jsonl", {}, "bad.jsonl line 2: not JSON"),
])
def test_bad_input_is_one_clear_error(inputs, tmp_path, name, kw, message):
    root, _ = inputs
    (root / "empty.jsonl").write_text('{"text": ""}\n{"text": "  "}\n')
    (root / "bad.jsonl").write_text('{"text": "fine"}\n{"text": \n')
    with pytest.raises(UserError) as e:
        prepare([str(root / name)], "bytes", str(tmp_path / "out"), progress=False, **kw)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert not (tmp_path / "out" / "index.json").exists()


def test_cli_summary_and_progress_with_tokens_per_second(inputs, tmp_path, capsys):
    root, _ = inputs
    assert main(["prepare-data", str(root / "docs.parquet"), "--tokenizer", "bytes",
                 "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    n = sum(len(d.encode()) for d in DOCS)  # bytes: no end-of-sequence token
    assert f"4 documents, {n:,} tokens (uint16, vocab_size=256) in 1 shard" in out
    assert "tok/s" in out


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_workers_give_the_same_shards(inputs, tmp_path, monkeypatch):
    import tpkit.train.tokenizing as pd

    root, _ = inputs
    monkeypatch.setattr(pd, "BATCH_BYTES", 64)  # many batches, spread over the workers
    files = [str(root / "docs.jsonl"), str(root / "saved")]
    one = prepare(files, "bytes", str(tmp_path / "one"), progress=False)
    two = prepare(files, "bytes", str(tmp_path / "two"), progress=False, workers=2)
    assert _ids(tmp_path / "one")[0] == _ids(tmp_path / "two")[0] and one["documents"] == 8
    assert two["tokens"] == one["tokens"]
