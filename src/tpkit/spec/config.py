"""`ModelConfig` and presets, from tiny test models to the published sizes. Pure Python.

Validation is per feature, in small functions, each error naming the numbers
(`config.check(tp=4, pp=2, sp=True, seq=1024)`); it runs on every rank before any
collective, so a bad layout never hangs and never fails deep inside a forward.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field, fields, replace
from functools import lru_cache

from tpkit.spec import shapes
from tpkit.spec.errors import UserError
from tpkit.spec.words import number_ranges, suggest

NORMS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu", "gelu_exact", "swiglu", "geglu", "relu")  # gelu: tanh; exact: erf (BERT)
GATED = {"swiglu": "silu", "geglu": "gelu"}  # act(gate) * up, with act = this element-wise
POSITIONS = ("learned", "rope")
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")  # the linear layers LoRA adapts
QUANTIZE = ("int8",)  # weight-only quantization a loaded model takes (`tpkit.decode.forms`)


@dataclass(frozen=True)
class ModelConfig:
    """Shape and flavour of a transformer (GPT-2, Llama, BERT and the Hugging Face
    families of `tpkit.weights.families`: each flag below is one block feature).

    One name per concept, and the field holds the value in use: `kv_heads`, `ffn`,
    `head_dim`, `rope_dim` and `attn_bias` may be left out (None), and are then derived
    at construction from the fields they follow (`ModelConfig(hidden=60).ffn == 240`).
    `with_(...)` derives them again from the changed fields (`gpt2-tiny.with_(hidden=60)`
    has ffn 240), unless a value is given; `dataclasses.replace` keeps every value as it
    is. `derived` names those that were derived."""

    name: str = "custom"
    vocab_size: int = 256
    hidden: int = 64
    num_layers: int = 2
    num_heads: int = 4
    kv_heads: int | None = None  # key/value heads; None: = num_heads (no GQA); 1: MQA
    ffn: int | None = None  # width of the MLP's inner layer; None: 4 * hidden
    max_seq_len: int = 128
    norm: str = "layernorm"  # layernorm | rmsnorm
    activation: str = "gelu"  # gelu (tanh, GPT-2) | gelu_exact (erf) | swiglu | geglu | relu
    position: str = "learned"  # learned | rope
    rope_theta: float = 10000.0
    rope_llama3: tuple[float, float, float, int] | None = None  # Llama 3.1's frequency
    # scaling: (factor, low_freq_factor, high_freq_factor, original max positions)
    causal: bool = True  # False: bidirectional encoder (BERT)
    pre_norm: bool = True  # False: post-norm layers (BERT) and no final norm
    embed_norm: bool = False  # a norm right after the embeddings (BERT)
    type_vocab_size: int = 0  # 2 for BERT's token types
    tie_embeddings: bool = True
    bias: bool = True
    dropout: float = 0.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    family: str = ""  # the Hugging Face model_type it exports to ("": none)
    head_dim: int | None = None  # width of a head; None: hidden / num_heads (Qwen3, Gemma
    # decouple it)
    attn_bias: bool | None = None  # bias on q, k, v; None: = bias (Qwen2: on q, k, v only)
    qk_norm: bool = False  # RMSNorm over each head's q and k before rotary (Qwen3)
    norm_offset: float = 0.0  # norms scale by (offset + weight): Gemma's (1 + w)
    embed_scale: float = 1.0  # embeddings times this (Gemma: sqrt(hidden))
    parallel_residual: bool = False  # x + attn(norm1(x)) + mlp(norm2(x)) (GPT-NeoX)
    rope_dim: int | None = None  # dims of each head that rotary rotates; None: head_dim
    # (GPT-NeoX rotates the first ones only)
    sliding_window: int | None = None  # a query sees the last `window` keys (Mistral)
    num_experts: int = 0  # > 0: a mixture-of-experts MLP, top-k routed (Mixtral)
    experts_per_token: int = 2
    pooler: bool = False  # BERT's tanh(W h[:, 0] + b) on the last stage
    lora_rank: int = 0  # > 0: low-rank adapters on `lora_targets`, the rest frozen
    lora_alpha: float = 0.0  # the adapters' output times lora_alpha / lora_rank
    lora_targets: tuple[str, ...] = ()  # of LORA_TARGETS
    derived: frozenset[str] = field(default=frozenset(), init=False, repr=False,
                                    compare=False)  # the fields above that were left out

    def __post_init__(self) -> None:
        said = size_problem(self)  # before anything is derived, sized or allocated from them
        if said:
            raise UserError(f"{self.name}: {said}")
        derived = []
        for name, rule in _DERIVE.items():  # in order: rope_dim follows head_dim
            if getattr(self, name) is None:
                object.__setattr__(self, name, rule(self))
                derived.append(name)
        object.__setattr__(self, "derived", frozenset(derived))

    @property
    def gated(self) -> bool:
        """A gated MLP (fc1 = [gate; up]): SwiGLU or GeGLU."""
        return self.activation in GATED

    @property
    def byte_level(self) -> bool:
        """Whether tpkit's byte tokenizer (UTF-8 bytes as ids 0..255) can feed it: 256 ids
        at least, and no model of a Hugging Face family that is not a tpkit preset (those
        come with a tokenizer of their own)."""
        return self.vocab_size >= 256 and not (self.family and self.name not in PRESETS)

    def padded_vocab(self, tp: int) -> int:
        """Vocabulary rounded up so that each of tp ranks holds a multiple of 8 rows (GEMMs
        on odd widths such as GPT-2's 50257 fall back to slow kernels on GPUs). The padded
        rows never win a softmax (`tpkit.spec.shapes.padded_vocab`)."""
        return shapes.padded_vocab(self.vocab_size, tp)

    def with_(self, **changes) -> ModelConfig:
        """A copy with some fields changed; the derived ones are derived again."""
        return replace(self, **{**dict.fromkeys(self.derived), **changes})

    def to_dict(self) -> dict:
        """Plain dict of every field, derived values included (for manifests and JSON);
        the lora fields only for a model with adapters (manifests read as before)."""
        return {f.name: getattr(self, f.name) for f in fields(self)
                if f.init and (self.lora_rank or not f.name.startswith("lora_"))}

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        """Inverse of `to_dict`; unknown keys are an error naming them. Reads the names
        that earlier manifests used (`num_kv_heads`, `ffn_hidden`, ...)."""
        d = {_OLD_NAMES.get(k, k): v for k, v in d.items()}
        unknown = set(d) - {f.name for f in fields(cls) if f.init}
        if unknown:
            raise UserError(f"unknown ModelConfig fields: {sorted(unknown)}")
        for name in ("rope_llama3", "lora_targets"):  # JSON gives a list
            if d.get(name) is not None:
                d = dict(d, **{name: tuple(d[name])})
        return cls(**d)

    # -- parameter counts (unpadded vocabulary) ------------------------------------------
    def layer_params(self, tp: int = 1, rank: int | None = None) -> int:
        """Parameters of one transformer layer held by rank `rank` of tp (None: by the
        largest rank, which sets the memory; all of them at tp=1).

        Column-parallel qkv and fc1 (and gate) keep the rank's heads and columns (as
        evenly dealt as `tpkit.spec.shapes.even_range` deals them) and their bias;
        row-parallel out and fc2 keep as many rows and the whole bias; experts are split
        like the MLP and the router replicated; norms are replicated."""
        if rank is None:
            return _largest_layer_params(self, tp)
        h, hd = self.hidden, self.head_dim
        nh = shapes.even_range(self.num_heads, tp, rank)[1]
        kv = shapes.kv_range(self.num_heads, self.kv_heads, tp, rank)[1]
        f = shapes.even_range(self.ffn, tp, rank)[1]
        b = 1 if self.bias else 0
        qkv = h * (nh + 2 * kv) * hd + int(self.attn_bias) * (nh + 2 * kv) * hd
        out = nh * hd * h + b * h
        mlp = (3 * h * f) if self.gated else (2 * h * f + b * (f + h))
        if self.num_experts:
            mlp = self.num_experts * mlp + self.num_experts * h  # + the router
        norms = 2 * self.norm_params() + (2 * hd if self.qk_norm else 0)
        return qkv + out + mlp + norms

    def tp_shares(self, tp: int) -> dict[str, float]:
        """Fraction of a layer's work the largest of tp ranks does (1/tp each when tp
        divides the heads and the ffn): 'attention' by query heads (9 heads at tp=2: 5/9,
        11% above an even split), 'gemm' by the matmul weights it holds. The largest
        rank sets the step time, as it sets the memory (`layer_params`)."""
        return dict(_tp_shares(self, tp))

    def norm_params(self) -> int:
        """Parameters of one norm: weight and bias for LayerNorm, weight only for RMSNorm."""
        return 2 * self.hidden if self.norm == "layernorm" else self.hidden

    def embedding_params(self) -> int:
        """Token (+ learned position, + token type) embeddings."""
        n = self.vocab_size * self.hidden
        if self.position == "learned":
            n += self.max_seq_len * self.hidden
        return n + self.type_vocab_size * self.hidden

    def num_params(self) -> int:
        """Total parameters (tied output embedding counted once)."""
        head = 0 if self.tie_embeddings else self.vocab_size * self.hidden
        norms = self.norm_params() * (int(self.pre_norm) + int(self.embed_norm))
        pooler = (self.hidden + 1) * self.hidden if self.pooler else 0
        return (self.embedding_params() + self.num_layers * self.layer_params() + norms + head
                + pooler)

    # -- validation ----------------------------------------------------------------------
    def check(self, tp: int = 1, pp: int = 1, sp: bool = False, seq: int | None = None) -> None:
        """Raise UserError naming the numbers if this model cannot run at (tp, pp, sp)."""
        said = self.problem_line(tp=tp, pp=pp, sp=sp, seq=seq)
        if said:
            raise UserError(said)

    def problem_line(self, tp: int = 1, pp: int = 1, sp: bool = False,
                     seq: int | None = None) -> str | None:
        """`problems` as one line, the model named once; when tp is one of the causes,
        the tp sizes this model can run at. None when it can run."""
        problems = self.problems(tp=tp, pp=pp, sp=sp, seq=seq)
        if not problems:
            return None
        line = f"{self.name}: " + "; ".join(problems)
        if problems != self.problems(tp=1, pp=pp, sp=sp, seq=seq):
            sizes = self.tp_sizes(sp=sp, seq=seq)
            line += f" (the tp sizes that work: {number_ranges(sizes)})" if sizes else ""
        return line

    def tp_sizes(self, sp: bool = False, seq: int | None = None) -> list[int]:
        """The tensor-parallel sizes `problems` admits (at pp=1), up to num_heads (a larger
        tp would leave a rank without a query head)."""
        return [t for t in range(1, self.num_heads + 1)
                if not self.problems(tp=t, sp=sp, seq=seq)]

    def problems(self, tp: int = 1, pp: int = 1, sp: bool = False,
                 seq: int | None = None) -> list[str]:
        """Every reason this model cannot run at (tp, pp, sp, seq); empty when it can."""
        out: list[str] = []
        for check in (_check_shape, _check_heads, _check_ffn, _check_pipeline,
                      _check_sequence, _check_choices, _check_experts, _check_lora):
            out += check(self, tp=tp, pp=pp, sp=sp, seq=seq)
        return out


def _check_shape(c: ModelConfig, **_) -> list[str]:
    bad = [f"{k}={getattr(c, k)} must be positive" for k in
           ("vocab_size", "hidden", "num_layers", "num_heads", "max_seq_len")
           if getattr(c, k) < 1]
    if not bad and "head_dim" in c.derived and c.hidden % c.num_heads:
        bad.append(f"hidden={c.hidden} is not divisible by num_heads={c.num_heads} "
                   f"(and no head_dim is given)")
    if not bad and c.position == "rope" and (c.rope_dim % 2 or c.rope_dim > c.head_dim):
        bad.append(f"rotary dims={c.rope_dim} must be even and <= head_dim={c.head_dim}")
    return bad


def _check_heads(c: ModelConfig, tp: int, **_) -> list[str]:
    return shapes.heads_problems(c.num_heads, c.kv_heads, tp)


def _check_ffn(c: ModelConfig, tp: int, **_) -> list[str]:
    return [f"tp={tp} is more than ffn={c.ffn}"] if c.ffn < tp else []


def _check_pipeline(c: ModelConfig, pp: int, **_) -> list[str]:
    if pp > c.num_layers:
        return [f"pp={pp} stages is more than num_layers={c.num_layers}"]
    return []


def _check_sequence(c: ModelConfig, seq: int | None, **_) -> list[str]:
    # any length splits over tp under SP, unevenly where tp does not divide it
    # (`spec.shapes.even_sizes`): only the model's own limit is checked
    if seq is not None and seq > c.max_seq_len:
        return [f"sequence length {seq} exceeds max_seq_len={c.max_seq_len}"]
    return []


def _check_choices(c: ModelConfig, **_) -> list[str]:
    out = []
    for field_name, allowed in (("norm", NORMS), ("activation", ACTIVATIONS),
                                ("position", POSITIONS)):
        if getattr(c, field_name) not in allowed:
            out.append(f"{field_name}={getattr(c, field_name)!r} is not one of {allowed}")
    return out


def _check_experts(c: ModelConfig, **_) -> list[str]:
    if c.num_experts and not 1 <= c.experts_per_token <= c.num_experts:
        return [f"experts_per_token={c.experts_per_token} is not in 1..num_experts="
                f"{c.num_experts}"]
    return []


def _check_lora(c: ModelConfig, **_) -> list[str]:
    if not (c.lora_rank or c.lora_targets):
        return []
    out = [f"lora_targets {t!r} is not one of {LORA_TARGETS}" for t in c.lora_targets
           if t not in LORA_TARGETS]
    if c.lora_rank < 1 or not c.lora_targets:
        out.append(f"lora_rank={c.lora_rank} with lora_targets={list(c.lora_targets)}: "
                   f"LoRA needs a rank >= 1 and at least one target")
    if c.lora_alpha <= 0:
        out.append(f"lora_alpha={c.lora_alpha} must be positive")
    if "gate" in c.lora_targets and not c.gated:
        out.append(f"lora_targets 'gate': activation={c.activation!r} has no gate "
                   f"(its MLP's first layer is 'up')")
    mlp = sorted(set(c.lora_targets) & {"gate", "up", "down"})
    if c.num_experts and mlp:
        out.append(f"lora_targets {mlp} on a mixture-of-experts MLP are not supported "
                   f"(adapt q, k, v, o)")
    return out


# The most each size may be: far above any published model (GPT-3: hidden 12288; Llama 3
# 405B: 126 layers, ffn 53248, 128 heads; Gemma 3: vocab 262144; Qwen2.5-1M: 1010000
# positions), far below what would exhaust a machine's memory before anything is said.
SIZE_BOUNDS = {"vocab_size": 1 << 24, "hidden": 1 << 17, "num_layers": 1 << 12,
               "num_heads": 1 << 14, "kv_heads": 1 << 14, "ffn": 1 << 20,
               "head_dim": 1 << 14, "rope_dim": 1 << 14, "max_seq_len": 1 << 24,
               "type_vocab_size": 1 << 16, "num_experts": 1 << 12,
               "experts_per_token": 1 << 12}


def size_problem(c: ModelConfig) -> str | None:
    """The first size of `c` that is not an integer or lies above its `SIZE_BOUNDS`
    (`ModelConfig` refuses it at construction: every reader of a config, a preset, a
    manifest, a config.json, sees the same bounds before sizing anything from them)."""
    for name, most in SIZE_BOUNDS.items():
        value = getattr(c, name)
        if value is None and name in _DERIVE:  # left out: derived from the others
            continue
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            return f"{name}={value!r} must be an integer"
        if value > most:
            return f"{name}={value:,} is above {most:,}, the most tpkit takes"
    return None


# How a left-out field follows the others (a zero stands in for a shape that
# `_check_shape` refuses anyway: no error while constructing it).
_DERIVE = {
    "kv_heads": lambda c: c.num_heads,
    "ffn": lambda c: 4 * c.hidden,
    "head_dim": lambda c: c.hidden // c.num_heads if c.num_heads > 0 else 0,
    "rope_dim": lambda c: c.head_dim,
    "attn_bias": lambda c: c.bias,
}
_OLD_NAMES = {"num_kv_heads": "kv_heads", "ffn_hidden": "ffn", "head_size": "head_dim",
              "rotary_dim": "rope_dim", "qkv_bias": "attn_bias"}


def _gpt2(name: str, h: int, layers: int, heads: int, **kw) -> ModelConfig:
    return ModelConfig(name=name, vocab_size=kw.pop("vocab_size", 50257), hidden=h,
                       num_layers=layers, num_heads=heads, max_seq_len=kw.pop("max_seq_len", 1024),
                       family="gpt2", **kw)


def _llama(name: str, h: int, layers: int, heads: int, kv: int, ffn: int, **kw) -> ModelConfig:
    return ModelConfig(name=name, vocab_size=kw.pop("vocab_size", 32000), hidden=h,
                       num_layers=layers, num_heads=heads, kv_heads=kv, ffn=ffn,
                       max_seq_len=kw.pop("max_seq_len", 4096), norm="rmsnorm",
                       activation="swiglu", position="rope", tie_embeddings=False, bias=False,
                       family="llama", **kw)


# Sizes from the published model cards / papers: GPT-2 (Radford et al. 2019), GPT-3
# (Brown et al. 2020, table 2.1), Llama 2 (Touvron et al. 2023), Llama 3 (Dubey et al. 2024).
PRESETS: dict[str, ModelConfig] = {
    "gpt2-tiny": _gpt2("gpt2-tiny", 64, 4, 4, vocab_size=256, max_seq_len=128),
    "llama-tiny": _llama("llama-tiny", 64, 4, 8, 2, 160, vocab_size=256, max_seq_len=128),
    "bert-tiny": ModelConfig(name="bert-tiny", vocab_size=512, hidden=64, num_layers=2,
                             num_heads=4, max_seq_len=128, causal=False, type_vocab_size=2,
                             pre_norm=False, embed_norm=True, activation="gelu_exact",
                             norm_eps=1e-12, family="bert"),
    "gpt2-124m": _gpt2("gpt2-124m", 768, 12, 12),
    "gpt2-355m": _gpt2("gpt2-355m", 1024, 24, 16),
    "gpt2-774m": _gpt2("gpt2-774m", 1280, 36, 20),
    "gpt2-1.5b": _gpt2("gpt2-1.5b", 1600, 48, 25),
    "gpt3-175b": _gpt2("gpt3-175b", 12288, 96, 96, max_seq_len=2048),
    "llama3.2-1b": replace(_llama("llama3.2-1b", 2048, 16, 32, 8, 8192, vocab_size=128256,
                                  max_seq_len=8192, rope_theta=500000.0), tie_embeddings=True),
    "llama2-7b": _llama("llama2-7b", 4096, 32, 32, 32, 11008, norm_eps=1e-5),
    "llama2-13b": _llama("llama2-13b", 5120, 40, 40, 40, 13824),
    "llama2-70b": _llama("llama2-70b", 8192, 80, 64, 8, 28672),
    "llama3-8b": _llama("llama3-8b", 4096, 32, 32, 8, 14336, vocab_size=128256,
                        max_seq_len=8192, rope_theta=500000.0),
    "llama3-70b": _llama("llama3-70b", 8192, 80, 64, 8, 28672, vocab_size=128256,
                         max_seq_len=8192, rope_theta=500000.0),
    "llama3-405b": _llama("llama3-405b", 16384, 126, 128, 8, 53248, vocab_size=128256,
                          max_seq_len=8192, rope_theta=500000.0),
}


def get_preset(name: str) -> ModelConfig:
    """A preset by name; an unknown name is an error listing the known ones."""
    try:
        return PRESETS[name]
    except KeyError:
        raise UserError(f"unknown preset {name!r}{suggest(name, PRESETS, n=2)} (known: "
                        f"{', '.join(PRESETS)})") from None


@lru_cache(maxsize=4096)  # the planner prices 10^4 layouts, each stage of each
def _largest_layer_params(config: ModelConfig, tp: int) -> int:
    return max(config.layer_params(tp, r) for r in range(tp))


@lru_cache(maxsize=4096)
def _tp_shares(config: ModelConfig, tp: int) -> tuple[tuple[str, float], ...]:
    def weights(p: int, r: int) -> int:  # matmul weights of rank r of p, / hidden
        nh = shapes.even_range(config.num_heads, p, r)[1]
        kv = shapes.kv_range(config.num_heads, config.kv_heads, p, r)[1]
        f = shapes.even_range(config.ffn, p, r)[1]
        return (2 * nh + 2 * kv) * config.head_dim + (3 if config.gated else 2) * f

    return (("attention", shapes.heads_per_rank(config.num_heads, tp) / config.num_heads),
            ("gemm", max(weights(tp, r) for r in range(tp)) / weights(1, 0)))
