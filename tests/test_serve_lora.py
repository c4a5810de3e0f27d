"""`tpkit serve --lora NAME=DIR`: PEFT adapter folders served per request over one base
(`serve.adapters`), through the `openai` client, at tp=1 in the batch-invariant mode
(tp=2: `test_serve_process`):

- an adapter's greedy text is the merged model's (`convert --to hf --merge`'s weights,
  served alone), its log-probabilities within 1e-5 relative (float32: x W^T + s (x A^T)
  B^T against x (W + s B A)^T, the rounding only);
- base requests in the same forwards as adapter requests get the tokens and
  log-probabilities bit for bit of the base served without --lora;
- one forward holds base and both adapters' rows; /v1/models lists the adapters with
  their parent, an unknown model is a 404; the prefix cache keys the adapter (a prompt
  the base computed is computed again under an adapter);
- a folder PEFT's `save_pretrained` wrote serves PeftModel's greedy tokens;
- a missing folder, two adapters with one name, a rank, a target or a shape the base
  cannot take: one line at start-up, exit 2.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
from safetensors.torch import load_file, save_file

from hf_folders import TEXT, lora_folders
from tpkit.cli import main as tpkit_main
from tpkit.mesh import ParallelMesh
from tpkit.serve import Engine
from tpkit.serve.adapters import Adapters, read_all
from tpkit.serve.params import SamplingParams
from tpkit.weights.sources import load_model
from tpkit.weights.tokenizer import load_tokenizer

PROMPTS = ["Tensor parallelism splits", "the pipeline sends", "The column-parallel fc1"]
LONG = "Once more: " + TEXT[30:230]  # full blocks (the prefix cache), no prompt's prefix
MAX = 8


@pytest.fixture(scope="module")
def adapters(chat_llama, tmp_path_factory):
    """(PEFT folder, merged folder) of adapters on every target, and of v, o, down only."""
    root = tmp_path_factory.mktemp("lora")
    return (lora_folders(chat_llama, root / "one"),
            lora_folders(chat_llama, root / "two", targets="v,o,down", seed=1))


def _engine(folder, tok, lora=()):
    model = load_model(str(folder), ParallelMesh.single(), decode=True)  # as tpkit serve
    served = Adapters(model, read_all(list(lora), model.config)) if lora else None
    return Engine(model, tokenizer=tok, max_batch=8, decode_chunk=8, adapters=served)


def _alone(folder, tok) -> list[tuple[str, list[float]]]:
    """Each prompt's greedy text and log-probabilities, served by `folder` alone."""
    reqs = _engine(folder, tok).generate([tok.encode(p) for p in [*PROMPTS, LONG]],
                                         SamplingParams(max_tokens=MAX, logprobs=0))
    return [(tok.decode(r.tokens), r.logprobs) for r in reqs]


def _ask(client, model: str, prompt: str):
    r = client.completions.create(model=model, prompt=prompt, max_tokens=MAX, temperature=0,
                                  logprobs=0)
    assert r.model == model  # the adapter's name echoed, as vLLM does
    return r.choices[0].text, r.choices[0].logprobs.token_logprobs, r.usage


@pytest.mark.timeout(120)
def test_adapters_per_request_in_one_step_with_the_base(chat_llama, adapters,
                                                        serve_in_threads):
    tok = load_tokenizer(chat_llama)
    (one, one_merged), (two, two_merged) = adapters
    want = {"llama": _alone(chat_llama, tok), "one": _alone(one_merged, tok),
            "two": _alone(two_merged, tok)}
    engine = _engine(chat_llama, tok, [f"one={one}", f"two={two}"])
    seen, run = [], engine.runner._run

    def spy(forwards, *a, **kw):  # the adapters of each forward's rows
        seen.extend({p.adapter for p in f} for f in forwards)
        return run(forwards, *a, **kw)

    engine.runner._run = spy
    asks = [(m, i) for i in range(len(PROMPTS)) for m in want]
    with serve_in_threads(engine, "llama", tok) as (_, client, _):
        with ThreadPoolExecutor(len(asks)) as pool:
            got = list(pool.map(lambda a: _ask(client, a[0], PROMPTS[a[1]]), asks))
        listed = client.models.list().data
        with pytest.raises(openai.NotFoundError, match="'three' is not served"):
            _ask(client, "three", PROMPTS[0])
        cached = [_ask(client, m, LONG)[2].prompt_tokens_details.cached_tokens
                  for m in ("llama", "one", "one")]  # the base's blocks, then the adapter's
        long_one = _ask(client, "one", LONG)[0]
    assert {0, 1, 2} in seen  # base and both adapters' rows in one forward
    for (model, i), (text, logprobs, _) in zip(asks, got):
        ref_text, ref = want[model][i]
        assert text == ref_text, (model, i)
        if model == "llama":  # bit for bit
            assert logprobs == ref, (model, i)
        else:
            assert max(abs(a - b) / max(1.0, abs(b)) for a, b in zip(logprobs, ref)) < 1e-4
    assert [t for t, _ in want["one"]] != [t for t, _ in want["llama"]]  # they adapt
    assert [(m.id, getattr(m, "parent", None)) for m in listed] == \
        [("llama", None), ("one", "llama"), ("two", "llama")]
    assert cached[1] == 0 < cached[2]  # the base's blocks are not the adapter's
    assert long_one == want["one"][-1][0]


def _refused(capsys, *lora: str) -> str:
    code = tpkit_main(["serve", "--checkpoint", str(_refused.base), "--port", "0",
                       *(a for x in lora for a in ("--lora", x))])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, (code, err)
    return err


def test_bad_adapters_are_one_line_at_start(chat_llama, adapters, capsys, tmp_path):
    _refused.base = chat_llama
    one = adapters[0][0]
    assert "is not a folder" in _refused(capsys, f"a={tmp_path / 'nowhere'}")
    assert "two adapters with one name" in _refused(capsys, f"a={one}", f"a={one}")
    assert "the base model's own name" in _refused(capsys, f"{chat_llama.name}={one}")

    def variant(name: str, config=None, tensors=None):
        out = tmp_path / name
        shutil.copytree(one, out)
        if config:
            cfg = json.loads((out / "adapter_config.json").read_text())
            (out / "adapter_config.json").write_text(json.dumps({**cfg, **config}))
        if tensors:
            t = load_file(str(out / "adapter_model.safetensors"))
            save_file(tensors(t), str(out / "adapter_model.safetensors"))
        return f"x={out}"

    assert "r=0" in _refused(capsys, variant("rank", {"r": 0}))
    assert "use_dora=True" in _refused(capsys, variant("dora", {"use_dora": True}))
    head = variant("head", tensors=lambda t: {**t, "base_model.model.lm_head.lora_A.weight":
                                              torch.zeros(4, 64)})
    assert "lm_head.lora_A.weight: not a LoRA factor" in _refused(capsys, head)
    narrow = variant("shape", tensors=lambda t: {k: v[:, :32].contiguous() if "lora_A" in k else v
                                                 for k, v in t.items()})
    assert "an adapter of another model" in _refused(capsys, narrow)


def test_a_folder_peft_saved_serves_its_greedy_tokens(chat_llama, tmp_path):
    import peft
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(str(chat_llama))
    model = peft.get_peft_model(hf, peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])).eval()
    g = torch.Generator().manual_seed(0)
    for name, p in model.named_parameters():
        if "lora_B" in name:  # PEFT starts B at zero: the adapter would change nothing
            p.data.copy_(torch.randn(p.shape, generator=g) * 0.3)
    model.save_pretrained(str(tmp_path / "saved"))
    tok = load_tokenizer(chat_llama)
    ids = tok.encode(PROMPTS[0])
    with torch.no_grad():
        want = model.generate(torch.tensor([ids]), max_new_tokens=MAX, do_sample=False)
    engine = _engine(chat_llama, tok, [f"p={tmp_path / 'saved'}"])
    got = engine.generate([ids], SamplingParams(max_tokens=MAX, adapter=1))[0].tokens
    base = _engine(chat_llama, tok).generate([ids], SamplingParams(max_tokens=MAX))[0].tokens
    assert got == want[0, len(ids):].tolist() != base
