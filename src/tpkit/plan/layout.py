"""A layout: how one training run is split over devices, and the names of its choices.

    devices = tp x cp x pp x dp      (the rank grid of `tpkit.spec.grid`: tp innermost,
                                      then cp, pp, dp)

Data-parallel sharding (`zero`), as Rajbhandari et al. 2020 (ZeRO) number the stages
and as the two common implementations call them:

    0  none       plain data parallel: gradients all-reduced       (PyTorch DDP)
    1  ZeRO-1     optimizer state sharded; gradients reduce-scattered, updated weights
                  all-gathered  (Megatron-LM --use-distributed-optimizer)
    2  ZeRO-2     + gradients sharded   (PyTorch FSDP2 fully_shard(reshard_after_forward=
                  False); Megatron-FSDP data_parallel_sharding_strategy=optim_grads)
    3  FSDP       + weights sharded and all-gathered layer by layer, forward and backward
                  (FSDP2 fully_shard(); Megatron-FSDP optim_grads_params; ZeRO-3)

FSDP frees what it gathered as `fsdp_reshard` says (`tpkit.spec.theory.fully_sharded`):
after-forward (FSDP2's default, reshard_after_forward=True) after every micro-batch's
forward and backward; after-step (reshard_after_forward=False, and no resharding or
gradient sync before the last backward, as torch.distributed.pipelining runs FSDP2) only
at the end of the step, so the stage's weights and unsharded gradients stay resident
while its micro-batches run.

Pipeline stages get the same number of layers (the first ones one more when they do
not divide), or with `lighter_ends` one layer fewer on the first and the last stage,
which also hold the embedding and the output layer (Llama 3 paper, section 3.3.2;
Megatron-LM --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers).

Context parallelism (cp) splits the sequence: each rank keeps s/cp tokens and passes
its keys and values around a ring of cp ranks (ring attention, Liu et al. 2023;
Megatron-LM --context-parallel-size). Weights are replicated over cp, so gradients
are reduced and the optimizer sharded over dp x cp.
"""

from __future__ import annotations

from dataclasses import dataclass

from tpkit.spec.grid import weight_replicas, world_of
from tpkit.spec.theory import FSDP_RESHARD

ZERO_NAMES = {0: "none", 1: "ZeRO-1", 2: "ZeRO-2", 3: "FSDP"}
ZERO_SHORT = {0: "", 1: "z1", 2: "z2", 3: "fsdp"}


@dataclass(frozen=True)
class Layout:
    """How a run is split: the degrees, micro-batch, and the memory savers."""

    tp: int
    pp: int
    dp: int
    micro_batch: int
    sp: bool = False
    recompute: str = "selective"  # none | selective | full
    zero: int = 0  # data-parallel sharding stage, see ZERO_NAMES
    interleave: int = 1  # virtual pipeline chunks per device (v)
    cp: int = 1  # context-parallel ranks (ring attention)
    lighter_ends: bool = False  # one layer fewer on the first and last stage (Llama 3)
    fsdp_reshard: str = "after-forward"  # FSDP only: when gathered weights are freed

    def __post_init__(self) -> None:
        if self.fsdp_reshard not in FSDP_RESHARD:
            raise ValueError(f"fsdp_reshard={self.fsdp_reshard!r} is not one of {FSDP_RESHARD}")

    @property
    def devices(self) -> int:
        """tp x cp x pp x dp."""
        return world_of(self.tp, self.pp, self.dp, self.cp)

    @property
    def replicas(self) -> int:
        """Ranks that hold the same weights and reduce gradients together: dp x cp."""
        return weight_replicas(self.dp, self.cp)

    @property
    def zero1(self) -> bool:
        """Whether the optimizer state is sharded (ZeRO-1 or more)."""
        return self.zero >= 1

    @property
    def keeps_gathered_weights(self) -> bool:
        """FSDP that gathers each weight once per step and keeps it (after-step)."""
        return self.zero >= 3 and self.fsdp_reshard == "after-step"
