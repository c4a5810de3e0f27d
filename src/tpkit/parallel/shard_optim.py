"""What ZeRO-1 (`zero.ZeroAdamW`) and ZeRO-2/FSDP (`sharded_adamw.ShardedAdamW`) share:
a torch AdamW, `inner`, over this rank's shards, whose groups and state are theirs."""

from __future__ import annotations

import torch


class OverShards:
    """The optimizer surface that delegates to `self.inner` (set by the subclass)."""

    inner: torch.optim.AdamW

    @property
    def param_groups(self) -> list[dict]:
        """The inner optimizer's groups (set `lr` here)."""
        return self.inner.param_groups

    def state_dict(self) -> dict:
        """This rank's shard of the optimizer state."""
        return self.inner.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore a shard saved by `state_dict` (same dp layout)."""
        self.inner.load_state_dict(state)
