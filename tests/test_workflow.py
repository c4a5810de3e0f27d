"""The user's workflow end to end: README.md's fine-tuning block, run whole as pasted (its
shell variable and its multi-line `python -c` included) in one fresh folder, once for the
module, through the CLI's entry (`tpkit.cli.main`, what the installed `tpkit` runs):

    Hugging Face folder (tiny random Llama + a BPE tokenizer trained here)
      -> tpkit prepare-data corpus.txt --tokenizer HF --out data
      -> tpkit train --from-hf HF --data data --tp 2 --pp 2, then resumed to more steps
      -> tpkit convert RUN OUT --to hf           (weights + the tokenizer files)
      -> tpkit generate, and transformers loads OUT and generates

Checked: `tpkit generate` prints text after the prompt, not blanks, and transformers'
greedy text is the start of it; the fine-tuned loss goes down across the resume; the
exported model's logits equal tpkit's from the checkpoint (at tp=1 and tp=2) within 1e-4;
tpkit's greedy generate equals transformers' greedy generate, token ids and text, for a
batch of prompts of different lengths (left padding) and for one prompt through the CLI.
"""

from __future__ import annotations

import contextlib
import io
import json
import re
import runpy
import shlex
import sys
from pathlib import Path

import pytest
import torch
import transformers

from helpers import generate_args
from hf_folders import TEXT, tiny_llama_folder
from tpkit.checkpoint import latest, load_model
from tpkit.cli import main
from tpkit.comm import all_gather
from tpkit.commands import generate as generate_cmd
from tpkit.decode.generate import generate, pad_left
from tpkit.mesh import ParallelMesh
from tpkit.spec.errors import UserError
from tpkit.weights.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Tensor parallelism splits", "the pipeline sends activations from stage 2 to",
           "one all-reduce"]
NEW = 12


def logits_worker(mesh, ckpt, ids):
    model = load_model(ckpt, mesh).eval()
    with torch.no_grad():
        return all_gather(model(ids), mesh.tp_group, dim=-1)[..., :model.config.vocab_size]


def generate_worker(mesh, ckpt, prompts, eos=None):
    model = load_model(ckpt, mesh)
    tok = load_tokenizer(ckpt)
    ids, mask = pad_left([tok.encode(p) for p in prompts], tok.pad_id)
    out = generate(model, ids, NEW, attention_mask=mask, eos_id=eos or tok.eos_ids,
                   pad_id=tok.pad_id)
    return out[:, ids.shape[1]:]


def commands(block: str):
    """The argv of each command of a bash block: continued lines joined, a quote left open
    continued on the next lines, `NAME=value` assignments applied to later `$NAME`s."""
    names: dict[str, str] = {}
    text = ""
    for line in block.replace("\\\n", " ").splitlines():
        text += line + "\n"
        try:
            argv = shlex.split(re.sub(r"\$(\w+)", lambda m: names[m.group(1)], text),
                               comments=True)
        except ValueError:  # a quotation still open
            continue
        text = ""
        if len(argv) == 1 and re.fullmatch(r"\w+=\S*", argv[0]):
            names.update([argv[0].split("=", 1)])
        elif argv:
            yield argv


def run_line(argv: list[str]) -> None:
    """One line of the block: a tpkit command, a `python -c` or a script of tests/."""
    if argv[0] == ".venv/bin/tpkit":
        assert main(argv[1:]) == 0, argv
    elif argv[:2] == [".venv/bin/python", "-c"]:
        exec(compile(argv[2], "README.md", "exec"), {"__name__": "__readme__"})
    else:
        assert argv[0] == ".venv/bin/python" and argv[1].startswith("tests/"), argv
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(sys, "argv", [str(ROOT / argv[1]), *argv[2:]])
            runpy.run_path(str(ROOT / argv[1]), run_name="__main__")


@pytest.fixture(scope="module")
def workflow(tmp_path_factory):
    """The block run in a fresh folder: the folder, and each line's argv and stdout."""
    root = tmp_path_factory.mktemp("workflow")
    text = (ROOT / "README.md").read_text()
    section = text[text.index("\n### Fine-tune a Hugging Face model\n"):]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    said = []
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(root)
        for argv in commands(block):
            with contextlib.redirect_stdout(io.StringIO()) as out:
                run_line(argv)
            said.append((argv, out.getvalue()))
    return dict(root=root, said=said, hf=root / "tiny-llama", export=root / "export",
                ckpt=str(latest(root / "run")))


def _printed(workflow, command: str) -> list[str]:
    return [out for argv, out in workflow["said"] if argv[1] == command]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_fine_tuning_block_runs_and_generates_text(workflow):
    prompt = "Tensor parallelism splits"
    ours = next(s for s in _printed(workflow, "generate")[0].splitlines()
                if s.startswith(prompt))
    assert ours.removeprefix(prompt).strip(), f"generate printed blanks: {ours!r}"
    theirs = _printed(workflow, "-c")[0].strip()
    assert theirs.startswith(prompt) and ours.startswith(theirs), (ours, theirs)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_finetune_resume_lowers_the_loss(workflow):
    trains = [argv for argv, _ in workflow["said"] if argv[1] == "train"]
    assert len(trains) == 2 and "--resume" in trains[1]
    steps = [int(t[t.index("--steps") + 1]) for t in trains]
    resumed = re.search(r"loss [\d.]+ \(step (\d+)\)", _printed(workflow, "train")[1])
    assert resumed and int(resumed[1]) == steps[0] + 1  # resumed after the first run
    rows = [json.loads(r) for r in (workflow["root"] / "run" / "metrics.jsonl").open()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, steps[1] + 1))
    print("fine-tune losses", " ".join(f"{x:.4f}" for x in losses[::10]))
    assert losses[-1] < losses[0] - 0.3, losses


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_export_logits_equal_tpkit(workflow, run_tp):
    back = transformers.AutoModelForCausalLM.from_pretrained(workflow["export"]).eval()
    ids = torch.tensor([load_tokenizer(workflow["hf"]).encode(TEXT[:400])[:48]] * 2)
    with torch.no_grad():
        ref = back(ids).logits
    for tp in (1, 2):
        for got in run_tp(logits_worker, tp, workflow["ckpt"], ids):
            diff = (got - ref).abs().max().item()
            print(f"tp={tp}: max |exported - tpkit| logits = {diff:.2e}")
            assert diff <= 1e-4, (tp, diff)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_greedy_generate_equals_transformers(workflow, run_tp, capsys):
    export = workflow["export"]
    hf_tok = transformers.AutoTokenizer.from_pretrained(export, padding_side="left")
    back = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    batch = hf_tok(PROMPTS, return_tensors="pt", padding=True)
    assert len({int(m.sum()) for m in batch.attention_mask}) == 3  # three lengths
    with torch.no_grad():
        ref = back.generate(**batch, max_new_tokens=NEW, do_sample=False)
    ref = ref[:, batch.input_ids.shape[1]:]
    texts = hf_tok.batch_decode(ref, skip_special_tokens=True)
    for src in (workflow["ckpt"], str(export)):  # the checkpoint and the exported folder
        for got in run_tp(generate_worker, 2, src, PROMPTS):
            assert torch.equal(got, ref), (src, got, ref)
    tok = load_tokenizer(workflow["ckpt"])
    assert [tok.decode(r) for r in ref.tolist()] == texts
    eos = int(ref[0, 3])  # an end-of-sequence id that occurs: rows stop, then pad
    with torch.no_grad():
        stop = back.generate(**batch, max_new_tokens=NEW, do_sample=False, eos_token_id=eos)
    stop = stop[:, batch.input_ids.shape[1]:]
    assert (stop[0, 4:] == tok.pad_id).all() and stop.shape[1] <= NEW
    assert torch.equal(run_tp(generate_worker, 2, str(export), PROMPTS, [eos])[0], stop)
    assert len(set(texts)) == 3 and all(t.strip() for t in texts), texts
    args = generate_args("--checkpoint", workflow["ckpt"], "--prompt", PROMPTS[1],
                         "--max-new-tokens", str(NEW), "--max-batch", "8", "--batch-invariant", "--decode-chunk", "8")
    assert generate_cmd.run(args) == 0  # streamed, with the model's own tokenizer
    out = capsys.readouterr()
    assert out.out == PROMPTS[1] + texts[1] + "\n" and "tokens/s" in out.err
    print(f"transformers and tpkit: {texts!r}\n{out.err.strip()}")


@pytest.mark.timeout(120)
def test_preset_export_carries_a_byte_tokenizer(tmp_path, capsys):
    """A tpkit preset (trained on bytes) exports a tokenizer.json that AutoTokenizer loads
    and that gives the very ids of tpkit's byte tokenizer; transformers then generates
    the text `tpkit generate` prints."""
    from checkpoint_helpers import fill, random_full
    from tpkit.checkpoint import store as ckpt
    from tpkit.model.transformer import Transformer
    from tpkit.spec import get_preset

    config, mesh = get_preset("gpt2-tiny"), ParallelMesh.single()
    model = Transformer(config, mesh)
    fill(model, random_full(config, seed=3, scale=0.5), mesh)
    ckpt.save(tmp_path / "ckpt", model, mesh=mesh)
    assert main(["convert", str(tmp_path / "ckpt"), str(tmp_path / "hf"), "--to", "hf"]) == 0
    capsys.readouterr()
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    text = "Tensor parallélisme ∑ 日本\n  x"
    assert hf_tok(text)["input_ids"] == list(text.encode()) == load_tokenizer(None).encode(text)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = torch.tensor([list(b"The ")])
    with torch.no_grad():
        ref = back.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16,
                            do_sample=False, pad_token_id=0)[0, 4:]
    args = generate_args("--checkpoint", str(tmp_path / "hf"), "--prompt", "The ",
                         "--max-new-tokens", "16", "--max-batch", "8", "--batch-invariant", "--decode-chunk", "8")
    assert generate_cmd.run(args) == 0
    out = capsys.readouterr().out
    assert out == "The " + hf_tok.decode(ref) + "\n", (out, hf_tok.decode(ref), ref)


def test_a_hf_folder_without_tokenizer_is_not_read_as_bytes(tmp_path, capsys):
    hf = tiny_llama_folder(tmp_path / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (hf / name).unlink()
    args = generate_args("--checkpoint", str(hf), "--prompt", "Tensor", "--max-new-tokens",
                         "2", "--max-batch", "8", "--batch-invariant", "--decode-chunk", "8")
    with pytest.raises(UserError) as e:
        generate_cmd.run(args)  # one line and exit 2 from tpkit.cli
    assert "no tokenizer files in" in str(e.value)
    assert "hf-llama (vocab_size=300) is not a byte-level model" in str(e.value)
