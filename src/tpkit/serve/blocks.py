"""Which KV blocks hold what (rank 0's books; the tensors are `decode.paged_kv`'s on every
rank), and the prefix cache: a full block is known by the chain hash of its tokens and
of every token before it (and of its LoRA adapter, `root`), so a second request starting with the same tokens (a system
prompt, few-shot examples) reuses the blocks instead of computing them again.

    pool = BlockPool(block_size=16, max_blocks=512)
    hits = pool.lookup(keys)                # the cached blocks of its prefix (now in use)
    fresh = pool.allocate(3)                # None when the pool is full
    pool.register(block, key)               # once its 16 tokens are computed
    pool.release(blocks)                    # a finished request: cached ones stay findable

A block is free (no user, no hash), cached (a known prefix: kept after its last user
ends, evicted least recently used first) or in use (a count of users). The pool grows
(`size`, which every rank's tensors follow) by 16 blocks or half its size up to `max_blocks`: memory follows
the tokens in flight (and what the cache keeps), never max_batch x max_len up front.
Block 0 is never handed out (the padding rows' scratch).
"""

from __future__ import annotations

from collections import OrderedDict

ROOT = 0  # the hash before a sequence's first block


def root(adapter: int) -> int:
    """The chain's first parent for the rows of served LoRA adapter `adapter` (0: the base,
    ROOT): one prompt's blocks under two adapters hold other keys, never shared."""
    return ROOT if not adapter else hash(("lora", adapter))


def block_keys(tokens: list[int], block_size: int, parent: int = ROOT,
               upto: int | None = None) -> list[int]:
    """The chain keys of the full blocks of `tokens` (the first `upto` blocks at most)."""
    keys = []
    full = len(tokens) // block_size if upto is None else min(upto, len(tokens) // block_size)
    for b in range(full):
        parent = hash((parent, tuple(tokens[b * block_size:(b + 1) * block_size])))
        keys.append(parent)
    return keys


class BlockPool:
    """Blocks 1..size-1 and the prefix cache over them."""

    def __init__(self, block_size: int, max_blocks: int, caching: bool = True) -> None:
        if block_size < 1 or max_blocks < 2:
            raise ValueError(f"block_size={block_size} >= 1, max_blocks={max_blocks} >= 2")
        self.block_size, self.max_blocks, self.caching = block_size, max_blocks, caching
        self.size = 1  # blocks the tensors hold (block 0 included)
        self.users: dict[int, int] = {}  # block -> requests using it (in use only)
        self.free: list[int] = []  # no user, no key
        self.key_of: dict[int, int] = {}  # cached block -> its chain key
        self.by_key: dict[int, int] = {}  # chain key -> block
        self.idle: OrderedDict[int, None] = OrderedDict()  # cached, no user: LRU first
        self.hits = self.queries = 0  # prefix tokens found / looked up (metrics)

    @property
    def available(self) -> int:
        """Blocks `allocate` can still hand out (free, growable, or evictable)."""
        return len(self.free) + (self.max_blocks - self.size) + len(self.idle)

    @property
    def in_use(self) -> int:
        """Blocks some request holds."""
        return len(self.users)

    def lookup(self, keys: list[int]) -> list[int]:
        """The longest run of cached blocks for `keys` (a prefix's chain keys), each now
        used once more by the caller."""
        found = []
        if self.caching:
            for key in keys:
                block = self.by_key.get(key)
                if block is None:
                    break
                found.append(block)
        for block in found:
            self._use(block)
        return found

    def cached(self, keys: list[int]) -> int:
        """How many of `keys` (a prefix's chain keys) `lookup` would find; nothing taken."""
        n = 0
        while self.caching and n < len(keys) and keys[n] in self.by_key:
            n += 1
        return n

    def allocate(self, n: int) -> list[int] | None:
        """n blocks for one request (None, and nothing taken, if the pool cannot)."""
        if n > self.available:
            return None
        out = []
        for _ in range(n):
            if self.free:
                block = self.free.pop()
            elif self.size < self.max_blocks:
                block = self._grow()
            else:  # the least recently used cached block, forgotten
                block, _ = self.idle.popitem(last=False)
                del self.by_key[self.key_of.pop(block)]
            self.users[block] = 1
            out.append(block)
        return out

    def _grow(self) -> int:
        new = min(self.max_blocks, self.size + max(16, self.size // 2))
        self.free.extend(range(new - 1, self.size, -1))  # handed out lowest first
        block, self.size = self.size, new
        return block

    def _use(self, block: int) -> None:
        if block in self.users:
            self.users[block] += 1
        else:
            self.idle.pop(block)
            self.users[block] = 1

    def register(self, block: int, key: int) -> None:
        """`block` now holds the full block whose chain key is `key` (findable by
        `lookup`); a key already known keeps its first block."""
        if not self.caching or key in self.by_key or block in self.key_of:
            return
        self.by_key[key], self.key_of[block] = block, key

    def release(self, blocks: list[int]) -> None:
        """A request is done with `blocks`: cached ones stay findable until evicted."""
        for block in blocks:
            self.users[block] -= 1
            if self.users[block]:
                continue
            del self.users[block]
            if block in self.key_of:
                self.idle[block] = None  # most recently used last
            else:
                self.free.append(block)
