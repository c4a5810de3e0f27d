"""Data files are read by what they are, through the real CLI (`tpkit.cli.main`):

- `tpkit train --data` of a .jsonl, .parquet or `datasets` folder reads exactly the
  tokens `prepare-data --tokenizer bytes` writes for it (the same code), never the
  file's bytes (the Parquet encoding, the JSON syntax);
- text that is not UTF-8 (a .txt, a line of a .jsonl, a .txt in a data directory,
  a bad byte past the first MiB) is refused in one line with the byte offset of the
  first bad byte, by train and prepare-data alike, nothing written;
- an empty or junk .parquet, a junk `datasets` folder: one line naming the file and
  the cause (no pyarrow traceback).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tpkit.train.data import load_tokens
from tpkit.train.text_sources import BLOCK_BYTES
from tpkit.train.tokens import open_shards

DOCS = ["Tensor parallelism splits the weights. é", "", "The row-parallel fc2 all-reduces."]
TRAIN = ["train", "--steps", "1", "--seq", "32", "--global-batch", "4", "--no-progress",
         "--val-fraction", "0"]


def _cli(capsys, *argv: str) -> tuple[int, str]:
    from tpkit.cli import main

    capsys.readouterr()
    status = main(list(argv))
    return status, capsys.readouterr().err


def _one_line(status: int, err: str, command: str, needle: str) -> None:
    lines = err.strip().splitlines()
    assert status == 2 and len(lines) == 1, (status, err)
    assert lines[0].startswith(f"tpkit {command}: error: ") and needle in lines[0], lines


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq
    from datasets import Dataset

    root = tmp_path_factory.mktemp("reading")
    (root / "docs.jsonl").write_text("".join(json.dumps({"text": d, "id": i}) + "\n"
                                             for i, d in enumerate(DOCS)))
    pq.write_table(pa.table({"id": list(range(len(DOCS))), "text": DOCS}), root / "docs.parquet")
    Dataset.from_dict({"text": DOCS}).save_to_disk(str(root / "saved"))
    return root


def test_train_reads_jsonl_parquet_and_datasets_as_prepare_data_writes_them(files, capsys):
    text = "".join(DOCS).encode()
    for name in ("docs.jsonl", "docs.parquet", "saved"):
        out = files / f"prepared-{name}"
        status, err = _cli(capsys, "prepare-data", str(files / name), "--tokenizer", "bytes",
                           "--out", str(out), "--no-progress")
        assert status == 0, err
        prepared = np.asarray(open_shards(out)[0][:]).tolist()
        read = load_tokens(files / name, 256, "bytes")  # what every rank of train reads
        assert read.tolist() == prepared == list(text), name
        size = sum(f.stat().st_size for f in [files / name, *(files / name).rglob("*")]
                   if f.is_file())
        assert (size - 1) // 32 >= 4, name  # read as bytes, it would have trained
        status, err = _cli(capsys, *TRAIN, "--data", str(files / name), "--out",
                           str(files / f"run-{name}"))  # too short: the count tells
        _one_line(status, err, "train", f"training data has {len(text)} tokens = "
                                        f"{(len(text) - 1) // 32} windows of seq=32, fewer "
                                        f"than global_batch=4")


def test_train_names_the_prepare_data_to_run(files, capsys):
    (files / "body.jsonl").write_text(json.dumps({"body": "x" * 200}) + "\n")
    status, err = _cli(capsys, *TRAIN, "--data", str(files / "body.jsonl"), "--out",
                       str(files / "run-body"))
    _one_line(status, err, "train", "body.jsonl line 1: no field 'text' (fields: ['body']); "
                                    "train reads the field 'text'; for another, run `tpkit "
                                    f"prepare-data {files / 'body.jsonl'} --tokenizer bytes "
                                    "--out DIR --text-field NAME`, then train on --data DIR")
    status, err = _cli(capsys, *TRAIN, "--data", str(files / "docs.parquet"), "--out",
                       str(files / "run-124m"), "--preset", "gpt2-124m")  # vocab 50257
    _one_line(status, err, "train", f"data {files / 'docs.parquet'} (.parquet) needs the "
                                    "model's tokenizer, which tpkit does not know here: run "
                                    f"`tpkit prepare-data {files / 'docs.parquet'} --tokenizer "
                                    "TOKENIZER --out DIR` with the model's tokenizer")


@pytest.mark.parametrize("name, data, offset", [
    ("latin1.txt", "naïve café\n".encode("latin-1") * 3, 2),
    ("late.txt", b"a" * (BLOCK_BYTES + 500) + b"\nok\n\x80tail\n", BLOCK_BYTES + 504),
    ("bad.jsonl", b'{"text": "fine"}\n{"text": "caf\xe9"}\n', 30),
])
def test_text_that_is_not_utf8_is_refused_at_its_first_bad_byte(tmp_path, capsys, name,
                                                                 data, offset):
    src = tmp_path / name
    src.write_bytes(data)
    bad = f"{src}: not UTF-8 text: byte 0x{data[offset]:02x} at byte offset {offset} ("
    for argv in (["prepare-data", str(src), "--tokenizer", "bytes", "--out",
                  str(tmp_path / "data"), "--no-progress"],
                 [*TRAIN, "--data", str(src), "--out", str(tmp_path / "run")]):
        _one_line(*_cli(capsys, *argv), argv[0], bad)
    assert not (tmp_path / "data").exists()
    if name.endswith(".txt"):  # in a directory of .txt files too
        (tmp_path / "dir").mkdir()
        src.rename(tmp_path / "dir" / name)
        (tmp_path / "dir" / "fine.txt").write_text("fine text\n" * 20)
        _one_line(*_cli(capsys, *TRAIN, "--data", str(tmp_path / "dir"), "--out",
                        str(tmp_path / "run2")), "train", f"{name}: not UTF-8 text: byte ")


def test_junk_parquet_and_datasets_are_one_line(tmp_path, capsys):
    (tmp_path / "empty.parquet").write_bytes(b"")
    (tmp_path / "junk.parquet").write_bytes(b"PAR1 this is not parquet at all PAR1" * 4)
    (tmp_path / "saved").mkdir()
    (tmp_path / "saved" / "dataset_info.json").write_text("{not json")
    cases = [("empty.parquet", "not a readable Parquet file (Parquet file size is 0 bytes)"),
             ("junk.parquet", "not a readable Parquet file ("),
             ("saved", "not a readable `datasets` folder (")]
    for name, cause in cases:
        src = tmp_path / name
        for argv in (["prepare-data", str(src), "--tokenizer", "bytes", "--out",
                      str(tmp_path / "data"), "--no-progress"],
                     [*TRAIN, "--data", str(src), "--out", str(tmp_path / "run")]):
            _one_line(*_cli(capsys, *argv), argv[0], f"{src}: {cause}")
    assert not (tmp_path / "data").exists()
