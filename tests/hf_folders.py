"""A Hugging Face model folder as a user has one, built offline (no tests here):
a tiny random Llama made by transformers and saved with save_pretrained, with a real
BPE tokenizer trained by the `tokenizers` library on a few KB of text."""

from __future__ import annotations

from pathlib import Path

TEXT = "\n".join(
    f"Tensor parallelism splits the weight matrices of layer {i} across {d} devices; "
    f"the column-parallel fc1 and the row-parallel fc2 need one all-reduce, and the "
    f"pipeline sends activations from stage {i % 4} to stage {(i + 1) % 4}."
    for i, d in zip(range(60), [2, 4, 8] * 20))  # ~12 KB, repetitive enough to learn


def train_tokenizer(folder: Path, text: str = TEXT, vocab_size: int = 300):
    """A byte-level BPE tokenizer trained on `text`, saved into `folder`
    (tokenizer.json + tokenizer_config.json, with <s> and </s>); returns it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text.split("\n"), trainer)
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[
        ("<s>", tok.token_to_id("<s>"))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>")
    fast.save_pretrained(str(folder))
    return fast


def tiny_llama_folder(folder: Path, seed: int = 0, **config) -> Path:
    """A random Llama (GQA, 4 layers: pp=2 x tp=2 works) + its tokenizer, saved."""
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(folder)
    torch.manual_seed(seed)
    cfg = dict(num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=128, vocab_size=len(tok), max_position_embeddings=128,
               bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
               pad_token_id=tok.pad_token_id, rope_theta=10000.0, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**cfg, **config}))
    model.save_pretrained(str(folder))
    return folder


# Heads no tp divides, kept tiny: SmolLM2-135M's 9 heads / 3 kv heads (head_dim 8) and
# Qwen2.5-0.5B's 14 heads / 2 kv heads (head_dim 4), ffn widths tp does not divide
SMOL = dict(num_hidden_layers=2, hidden_size=72, num_attention_heads=9, num_key_value_heads=3,
            intermediate_size=99, tie_word_embeddings=True)
QWEN14 = dict(num_hidden_layers=2, hidden_size=56, num_attention_heads=14, num_key_value_heads=2,
              intermediate_size=74, tie_word_embeddings=False)


def uneven_folder(folder: Path, family: str = "llama", seed: int = 0) -> Path:
    """A random SmolLM2-shaped Llama (`SMOL`) or Qwen2.5-shaped Qwen2 (`QWEN14`) with a
    tokenizer, its weights drawn wide (std 0.2) so that greedy tokens are clear winners."""
    import torch
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(folder)
    torch.manual_seed(seed)
    shape = SMOL if family == "llama" else QWEN14
    make = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
            "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}[family]
    model = make[1](make[0](**shape, vocab_size=len(tok), max_position_embeddings=64,
                            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.pad_token_id))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if "norm" in name else 0.0
            p.copy_(base + 0.2 * torch.randn(p.shape, generator=g))
    model.save_pretrained(str(folder))
    return folder


def tiny_bert_folder(folder: Path, seed: int = 0, pooling: str = "mean", normalize: bool = True,
                     max_seq_length: int | None = 48) -> Path:
    """A random BertModel (2 layers, 64 wide, 64 positions) saved by transformers, with a
    WordPiece tokenizer trained on `TEXT` ([CLS] text [SEP]) and sentence-transformers'
    files as all-MiniLM-L6-v2 has them: modules.json (Transformer, Pooling, and Normalize
    if `normalize`), 1_Pooling/config.json (`pooling`), sentence_bert_config.json."""
    import json

    import torch
    import transformers
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    special = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator(TEXT.split("\n"), trainers.WordPieceTrainer(
        vocab_size=200, special_tokens=special))
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls), ("[SEP]", sep)])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]",
        sep_token="[SEP]", mask_token="[MASK]")
    fast.save_pretrained(str(folder))
    model = transformers.BertModel(transformers.BertConfig(
        vocab_size=len(fast), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=64, pad_token_id=0))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():  # drawn wide (biases, norms too): embeddings far apart
        for name, p in model.named_parameters():
            base = 1.0 if "LayerNorm.weight" in name else 0.0
            p.copy_(base + 0.2 * torch.randn(p.shape, generator=g))
    model.save_pretrained(str(folder))
    st = "sentence_transformers.models."
    modules = [dict(idx=0, name="0", path="", type=st + "Transformer"),
               dict(idx=1, name="1", path="1_Pooling", type=st + "Pooling")]
    if normalize:
        modules.append(dict(idx=2, name="2", path="2_Normalize", type=st + "Normalize"))
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir(exist_ok=True)
    flags = {f"pooling_mode_{m}": m.removesuffix("_tokens").removesuffix("_token") == pooling
             for m in ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens")}
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 64, **flags}))
    if max_seq_length is not None:
        (folder / "sentence_bert_config.json").write_text(json.dumps(
            {"max_seq_length": max_seq_length, "do_lower_case": False}))
    return folder


CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n"
                 "{% endfor %}{% if add_generation_prompt %}<s>assistant\n{% endif %}")


def with_chat_template(folder: Path, template: str = CHAT_TEMPLATE) -> Path:
    """Give the tokenizer saved in `folder` a chat template (as instruct models have)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder))
    tok.chat_template = template
    tok.save_pretrained(str(folder))
    return folder


if __name__ == "__main__":  # python tests/hf_folders.py DIR: the README's example folder
    import sys

    out = Path(sys.argv[1] if len(sys.argv) > 1 else "tiny-llama")
    tiny_llama_folder(out)
    (out.parent / "corpus.txt").write_text(TEXT)
    print(f"wrote {out} (model + tokenizer) and {out.parent / 'corpus.txt'}")


def lora_folders(base: Path, out: Path, targets: str = "q,k,v,o,gate,up,down", seed: int = 0,
                 rank: int = 4, std: float = 0.3) -> tuple[Path, Path]:
    """Random LoRA adapters (B nonzero: they change the text) over the Hugging Face folder
    `base`, written by `tpkit convert`'s own functions: (PEFT's adapter folder, as `--to
    peft` writes it; the merged model, as `--to hf --merge`)."""
    from dataclasses import replace

    import torch

    from tpkit.checkpoint.convert import to_hf, to_peft
    from tpkit.weights.peft import adapted
    from tpkit.weights.slices import DictSource
    from tpkit.weights.sources import open_source

    src = open_source(str(base))
    full = {n: src.read(n, 0, 0, src.logical_shape(n)[0]) for n in src.names}
    c = replace(src.config, lora_rank=rank, lora_alpha=2.0 * rank,
                lora_targets=tuple(targets.split(",")))
    g = torch.Generator().manual_seed(seed)
    for base_name, _, _, rows, _, a, b in adapted(c):
        full[a] = torch.randn(rank, src.logical_shape(base_name)[1], generator=g) * std
        full[b] = torch.randn(rows, rank, generator=g) * std
    peft = to_peft(DictSource(full, c), out / "peft")
    merged = to_hf(DictSource(full, c), out / "merged", merge=True)
    for f in base.glob("tokenizer*"):  # the base's tokenizer (a dict has none)
        (merged / f.name).write_bytes(f.read_bytes())
    return peft, merged
