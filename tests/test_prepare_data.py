"""`tpkit prepare-data` and the token shards the trainer reads memory-mapped.

Checked: the shards hold exactly the tokenizer's ids of each file (+ EOS after each),
across shard boundaries; uint16 when the vocabulary fits, uint32 otherwise, and a
vocabulary too large for a forced dtype is an error naming both numbers; the loader
reads the same batches from the memory map as from the ids in memory; a model whose
vocabulary is smaller than the data's ids, or a damaged shard, is refused by name;
`train --from-hf --data x.jsonl` reads the ids prepare-data writes with that tokenizer.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_folders import TEXT, tiny_llama_folder, train_tokenizer
from tpkit.checkpoint.tokenizer import load_tokenizer
from tpkit.cli import main
from tpkit.commands.prepare_data import prepare
from tpkit.train.config import TrainConfig
from tpkit.train.data import TokenLoader, load_tokens, split_tokens, tokenizer_folder
from tpkit.train.tokens import ShardWriter, TokenStream, dtype_for, open_shards


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    train_tokenizer(root / "tok")
    (root / "a.txt").write_text(TEXT)
    (root / "b.txt").write_text("column-parallel, row-parallel é\n" * 40)
    return root


def test_shards_hold_the_tokenizers_ids(corpus, tmp_path):
    tok = load_tokenizer(corpus / "tok")
    files = [str(corpus / "a.txt"), str(corpus / "b.txt")]
    index = prepare(files, str(corpus / "tok"), str(tmp_path), shard_tokens=700,
                    progress=False)
    want = [t for f in files for t in tok.encode(open(f).read(), special=False) + tok.eos_ids[:1]]
    stream, read = open_shards(tmp_path)
    assert read == index and index["dtype"] == "uint16" and index["vocab_size"] == 300
    assert len(index["shards"]) == -(-len(want) // 700) > 2
    assert list(stream) == want and stream.max() == max(want) == index["max_id"]
    assert list(stream[650:760]) == want[650:760]  # across a shard boundary
    assert isinstance(stream.parts[0], np.memmap)


def test_trainer_reads_the_memory_map_like_memory(corpus, tmp_path):
    prepare([str(corpus / "a.txt")], str(corpus / "tok"), str(tmp_path), shard_tokens=500,
            progress=False)
    mapped = load_tokens(tmp_path, vocab_size=300)
    assert isinstance(mapped, TokenStream)
    in_memory = np.array(list(mapped), dtype=np.int64)
    for val in (0.0, 0.1):
        (a, _), (b, _) = split_tokens(mapped, val, block=256), split_tokens(in_memory, val, 256)
        la, lb = (TokenLoader(x, seq=16, global_batch=4, seed=3) for x in (a, b))
        for _ in range(5):
            for x, y in zip(la.next_batch(), lb.next_batch()):
                assert torch.equal(x, y)
    with pytest.raises(ValueError, match=r"token id 29\d .*vocab_size=300\) is out of the "
                                         r"model's vocab_size=256"):
        load_tokens(tmp_path, vocab_size=256)
    (tmp_path / "shard_00001.bin").write_bytes(b"\0" * 10)
    with pytest.raises(ValueError, match="shard_00001.bin: 10 bytes, the index says 500 "
                                         "uint16 tokens = 1000 bytes"):
        load_tokens(tmp_path, vocab_size=300)


def test_dtype_follows_the_vocabulary(tmp_path):
    assert dtype_for(65536) == "uint16" and dtype_for(65537) == "uint32"
    assert dtype_for(128256) == "uint32"
    with pytest.raises(ValueError, match=r"vocab_size=128256 does not fit uint16 "
                                         r"\(ids up to 65535\); use uint32"):
        dtype_for(128256, "uint16")
    w = ShardWriter(tmp_path, vocab_size=128256)
    w.write([5, 70000, 128255])
    with pytest.raises(ValueError, match="token id 128256 is outside the tokenizer's "
                                         "vocab_size=128256"):
        w.write([128256])
    assert w.close()["dtype"] == "uint32"
    assert list(open_shards(tmp_path)[0]) == [5, 70000, 128255]


def test_cli(corpus, tmp_path, capsys):
    out = tmp_path / "data"
    assert main(["prepare-data", str(corpus / "b.txt"), "--tokenizer", "bytes", "--out",
                 str(out), "--no-progress"]) == 0
    n = len(("column-parallel, row-parallel é\n" * 40).encode())
    assert f"{n:,} tokens (uint16, vocab_size=256) in 1 shard" in capsys.readouterr().out
    assert main(["prepare-data", str(corpus / "b.txt"), "--tokenizer", str(tmp_path),
                 "--out", str(out)]) == 2
    assert "no tokenizer files" in capsys.readouterr().err


def test_the_data_names_its_tokenizer_and_from_hf_needs_shards(corpus, tmp_path):
    prepare([str(corpus / "b.txt")], str(corpus / "tok"), str(tmp_path / "d"), progress=False)
    prepare([str(corpus / "b.txt")], "bytes", str(tmp_path / "bytes"), progress=False)
    assert tokenizer_folder(tmp_path / "d") == corpus / "tok"  # copied into checkpoints
    assert tokenizer_folder(tmp_path / "bytes") is None and tokenizer_folder(None) is None
    hf = tiny_llama_folder(tmp_path / "hf")
    cfg = TrainConfig(from_hf=str(hf), data=str(corpus / "b.txt"), seq=16)
    assert any("would be read as bytes: run `tpkit prepare-data" in p for p in cfg.problems())
    assert cfg.with_(data=str(tmp_path / "d")).problems() == []
    assert cfg.model_config().vocab_size == 300 and cfg.model_name == str(hf)


def test_from_hf_trains_on_a_jsonl_tokenized_as_prepare_data_does(corpus, tmp_path, capsys):
    """`--from-hf HF --data x.jsonl`: the model's tokenizer, one EOS after each document,
    the ids prepare-data writes (the count in the 'too short' line is theirs)."""
    import json

    hf = tiny_llama_folder(tmp_path / "hf")
    docs = ["column-parallel fc1", "row-parallel fc2 é"]
    src = tmp_path / "x.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    prepare([str(src)], str(hf), str(tmp_path / "d"), progress=False)
    want = list(open_shards(tmp_path / "d")[0])
    tok = load_tokenizer(hf)
    assert want == [t for d in docs for t in tok.encode(d, special=False) + tok.eos_ids[:1]]
    assert load_tokens(src, 300, str(hf)).tolist() == want  # what every rank reads
    assert main(["train", "--from-hf", str(hf), "--data", str(src), "--seq", "32",
                 "--global-batch", "4", "--val-fraction", "0", "--steps", "1",
                 "--no-progress", "--out", str(tmp_path / "run")]) == 2
    assert f"training data has {len(want)} tokens = 0 windows of seq=32" in \
        capsys.readouterr().err
