"""Training data: the embedded corpus, byte-level tokens, and a dp-aware loader.

The default corpus ships with Python itself: `pydoc_data.topics` (the text of the
language reference's help topics, ~465 KB), so `tpkit train` needs no download.
Tokens are bytes (vocab 256, the size of gpt2-tiny and llama-tiny). `--data PATH`
takes a text file, a directory of .txt files, a .bin of uint16 token ids, or a folder
written by `tpkit prepare-data` (any tokenizer; shards read memory-mapped, see
`tpkit.train.tokens`).

The loader cuts the token stream into windows of seq+1 tokens (inputs and the
same shifted by one as labels), shuffles them per epoch with a fixed seed, and at
each step takes the next `global_batch` of them:

    global batch of step t:  [ dp0: b | dp1: b | ... ]    b = global_batch / dp
    every tp rank and pp stage of replica d reads the same slice (no broadcast)

Its state is one number, the position in that stream, saved with checkpoints.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tpkit.spec.errors import UserError
from tpkit.train.tokens import INDEX, TokenStream, open_shards


def embedded_text() -> str:
    """The text of Python's help topics, in a fixed order."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[k] for k in sorted(topics))


def encode_bytes(text: str) -> np.ndarray:
    """The byte tokenizer's ids of `text` (`model.tokenizer.ByteTokenizer`), as uint16."""
    from tpkit.model.tokenizer import ByteTokenizer

    return ByteTokenizer.array(text)


def load_tokens(path: str | Path | None, vocab_size: int = 256
                ) -> np.ndarray | TokenStream:
    """Token ids of the corpus at `path` (None: the embedded one); clear errors."""
    if path is None:
        tokens = encode_bytes(embedded_text())
    else:
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"data file {p} does not exist")
        if p.is_dir() and (p / INDEX).is_file():
            return _checked_shards(p, vocab_size)
        if p.is_dir():
            files = sorted(p.glob("*.txt"))
            if not files:
                raise UserError(f"data directory {p} holds no .txt file")
            tokens = encode_bytes("\n\n".join(f.read_text(errors="replace") for f in files))
        elif p.suffix == ".bin":
            if p.stat().st_size % 2:
                raise UserError(f"data file {p} has an odd size ({p.stat().st_size} bytes); "
                                 f"a .bin holds uint16 token ids")
            tokens = np.fromfile(p, dtype=np.uint16)
        else:
            tokens = encode_bytes(p.read_text(errors="replace"))
        if tokens.size == 0:
            raise UserError(f"data file {p} is empty (0 tokens)")
    top = int(tokens.max())
    if top >= vocab_size:
        raise UserError(f"token id {top} in the data is out of the model's vocab_size="
                         f"{vocab_size}")
    return tokens


def _checked_shards(folder: Path, vocab_size: int) -> TokenStream:
    """A prepare-data folder, memory-mapped; its index's largest id checked (no scan)."""
    tokens, index = open_shards(folder)
    if len(tokens) == 0:
        raise ValueError(f"data folder {folder} is empty (0 tokens)")
    if index["max_id"] >= vocab_size:
        raise ValueError(f"token id {index['max_id']} in the data {folder} (tokenizer "
                         f"vocab_size={index['vocab_size']}) is out of the model's "
                         f"vocab_size={vocab_size}")
    return tokens


def tokenizer_folder(data: str | Path | None) -> Path | None:
    """The tokenizer folder a `prepare-data` folder was made with (None: bytes/unknown)."""
    import json

    from tpkit.model.tokenizer import has_tokenizer

    index = Path(data) / INDEX if data is not None else None
    if index is None or not index.is_file():
        return None
    folder = json.loads(index.read_text()).get("tokenizer")
    return Path(folder) if folder and has_tokenizer(folder) else None


def split_tokens(tokens, val_fraction: float, block: int = 8192
                 ) -> tuple[TokenStream, TokenStream]:
    """(train, held-out): every k-th block of `block` tokens is held out, k = 1/fraction.

    Interleaved, so the held-out text is drawn from the whole corpus (the end of
    the embedded one is mostly tables, far easier to predict). A corpus shorter
    than 2 blocks holds out its tail instead.
    """
    if val_fraction <= 0:
        return tokens if isinstance(tokens, TokenStream) else TokenStream([tokens]), \
            TokenStream([])
    if len(tokens) < 2 * block:
        n_val = int(len(tokens) * val_fraction)
        return (TokenStream([tokens[:len(tokens) - n_val]]),
                TokenStream([tokens[len(tokens) - n_val:]]))
    period = max(2, round(1 / val_fraction))
    blocks = [tokens[i:i + block] for i in range(0, len(tokens), block)]  # views
    val = [b for i, b in enumerate(blocks) if i % period == period - 1]
    train = [b for i, b in enumerate(blocks) if i % period != period - 1]
    return TokenStream(train), TokenStream(val)


class TokenLoader:
    """Batches of (ids, labels) [b, s] for one dp replica; resumable by position."""

    def __init__(self, tokens: np.ndarray | TokenStream, seq: int, global_batch: int, dp_rank: int = 0,
                 dp_size: int = 1, seed: int = 0, shuffle: bool = True,
                 name: str = "training") -> None:
        if global_batch % dp_size:
            raise UserError(f"global_batch={global_batch} is not divisible by dp={dp_size}")
        self.tokens = tokens  # read a window at a time (memory-mapped shards stay on disk)
        self.seq, self.global_batch, self.seed, self.shuffle = seq, global_batch, seed, shuffle
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.windows = (len(tokens) - 1) // seq
        if self.windows < global_batch:
            raise UserError(f"{name} data has {len(tokens)} tokens = {self.windows} windows of "
                             f"seq={seq}, fewer than global_batch={global_batch}")
        self.position = 0  # sequences consumed, all replicas together
        self._perm: tuple[int, torch.Tensor] | None = None

    def _order(self, epoch: int) -> torch.Tensor:
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            perm = torch.randperm(self.windows, generator=g) if self.shuffle else \
                torch.arange(self.windows)
            self._perm = (epoch, perm)
        return self._perm[1]

    def window_ids(self, position: int) -> list[int]:
        """Window indices of this replica's slice of the global batch at `position`."""
        b = self.global_batch // self.dp_size
        out = []
        for i in range(position + self.dp_rank * b, position + (self.dp_rank + 1) * b):
            out.append(int(self._order(i // self.windows)[i % self.windows]))
        return out

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids, labels), each [global_batch/dp, seq] long; advances the position."""
        rows = [torch.from_numpy(np.asarray(self.tokens[w * self.seq:w * self.seq + self.seq + 1],
                                            dtype=np.int64))
                for w in self.window_ids(self.position)]
        self.position += self.global_batch
        batch = torch.stack(rows)  # [b, s+1]
        return batch[:, :-1].contiguous(), batch[:, 1:].contiguous()

    def state_dict(self) -> dict:
        """Position in the stream (and what it depends on)."""
        return dict(position=self.position, seed=self.seed, seq=self.seq,
                    global_batch=self.global_batch, windows=self.windows)

    def load_state_dict(self, state: dict) -> None:
        """Resume at a saved position (same data, seq and seed)."""
        for k in ("seed", "seq", "windows"):
            if state.get(k, getattr(self, k)) != getattr(self, k):
                raise UserError(f"loader state has {k}={state[k]}, this loader {getattr(self, k)}")
        self.position = int(state["position"])


def micro_batches(ids: torch.Tensor, labels: torch.Tensor, m: int) -> list:
    """Split a replica's batch [b, s] into m micro-batches [b/m, s]."""
    from tpkit.parallel.schedules import MicroBatch

    return [MicroBatch(i, y) for i, y in zip(ids.chunk(m), labels.chunk(m))]
