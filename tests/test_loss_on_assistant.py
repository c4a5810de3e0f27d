"""`tpkit train --loss-on assistant`: chat data prepared with --chat-field carries a mask
of the assistant's tokens, and the step's loss is the masked mean of the per-token
losses over the global batch, at any layout (checked by hand with transformers)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tpkit.cli import main as tpkit_main

SEQ, BATCH = 32, 8


def _chat(i: int) -> list[dict]:
    return [{"role": "user", "content": f"what splits layer {i}?"},
            {"role": "assistant", "content": f"tensor parallelism splits layer {i} across "
                                             f"{i % 4 + 2} devices"},
            {"role": "user", "content": "and then?"},
            {"role": "assistant", "content": "the pipeline sends activations"}]


@pytest.fixture(scope="module")
def chats(tmp_path_factory, chat_llama):
    root = tmp_path_factory.mktemp("chats")
    (root / "chats.jsonl").write_text("".join(json.dumps({"messages": _chat(i)}) + "\n"
                                              for i in range(40)))
    assert tpkit_main(["prepare-data", str(root / "chats.jsonl"), "--chat-field", "messages",
                       "--tokenizer", str(chat_llama), "--out", str(root / "data"),
                       "--no-progress"]) == 0
    return chat_llama, root / "data"


def test_the_mask_is_the_assistants_turns_with_their_end_marker(chats):
    from transformers import AutoTokenizer

    folder, data = chats
    ids = np.fromfile(data / "shard_00000.bin", np.uint16)
    mask = np.fromfile(data / "mask_00000.bin", np.uint8)
    first = int(np.flatnonzero(ids == 2)[4]) + 1  # 4 turns' </s>, then the chat's end
    tok = AutoTokenizer.from_pretrained(str(folder))
    said = tok.decode(ids[:first][mask[:first] == 1].tolist())
    assert said == ("tensor parallelism splits layer 0 across 2 devices</s>\n"
                    "the pipeline sends activations</s>\n")


def _reference(folder, data) -> tuple[float, float]:
    """(masked mean, plain mean, mean of the masked means of 2 sequences at a time) of the
    per-token losses of the first global batch, with transformers' logits and the mask."""
    from transformers import AutoModelForCausalLM

    from tpkit.train.data import TokenLoader

    ids = np.fromfile(data / "shard_00000.bin", np.uint16).astype(np.int64)
    mask = np.fromfile(data / "mask_00000.bin", np.uint8).astype(bool)
    windows = TokenLoader(ids, SEQ, BATCH, seed=0).window_ids(0)  # the run's first batch
    rows = torch.tensor(np.stack([ids[w * SEQ:w * SEQ + SEQ + 1] for w in windows]))
    keep = torch.tensor(np.stack([mask[w * SEQ + 1:w * SEQ + SEQ + 1] for w in windows]))
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    with torch.no_grad():
        logits = model(rows[:, :-1]).logits
    per_token = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten(),
                                reduction="none").view(keep.shape)
    pairs = [(per_token[i:i + 2][keep[i:i + 2]].mean()).item() for i in range(0, BATCH, 2)]
    return ((per_token[keep].sum() / keep.sum()).item(), per_token.mean().item(),
            sum(pairs) / len(pairs))


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--tp", "1", "--dp", "2", "--cp", "2"],
                                    ["--tp", "2", "--pp", "2"]])
def test_the_loss_is_the_hand_masked_mean_at_any_layout(chats, tmp_path, layout, capsys):
    folder, data = chats
    masked, plain, per_micro_batch = _reference(folder, data)
    assert abs(masked - plain) > 1e-3 * plain  # the mask changes the loss
    # and the mean of each micro-batch's masked mean (2 sequences each) is not the answer
    assert abs(masked - per_micro_batch) > 1e-5 * masked
    capsys.readouterr()  # the CLI's entry in this process: its ranks forked, no interpreter
    assert tpkit_main(
        ["train", "--from-hf", str(folder), "--data", str(data),
         "--loss-on", "assistant", *layout, "--micro-batches", "2", "--global-batch",
         str(BATCH), "--seq", str(SEQ), "--steps", "1", "--val-fraction", "0", "--out",
         str(tmp_path / "run"), "--trackers", "none", "--no-plot", "--no-progress",
         "--no-checkpoint"]) == 0, capsys.readouterr().err[-2000:]
    row = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert row["loss"] == pytest.approx(masked, rel=2e-6)  # fp32 sums in another order


def test_text_data_is_refused_in_one_line(chats, capsys, tmp_path):
    folder, _ = chats
    (tmp_path / "t.txt").write_text("plain text " * 200)
    assert tpkit_main(["prepare-data", str(tmp_path / "t.txt"), "--tokenizer", str(folder),
                       "--out", str(tmp_path / "text"), "--no-progress"]) == 0
    capsys.readouterr()
    assert tpkit_main(["train", "--from-hf", str(folder), "--data", str(tmp_path / "text"),
                       "--loss-on", "assistant", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "loss_on='assistant' needs chat data" in err and "prepared from text" in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.slow
def test_the_mask_is_the_same_in_shards_and_from_worker_processes(chats, tmp_path):
    from tpkit.train.data import assistant_mask

    folder, data = chats
    assert tpkit_main(["prepare-data", str(data.parent / "chats.jsonl"), "--chat-field",
                       "messages", "--tokenizer", str(folder), "--out", str(tmp_path / "d"),
                       "--shard-tokens", "1000", "--workers", "2", "--no-progress"]) == 0
    parts = assistant_mask(tmp_path / "d").parts
    assert len(parts) > 1
    assert np.array_equal(np.concatenate(parts), np.fromfile(data / "mask_00000.bin", np.uint8))
