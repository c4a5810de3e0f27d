"""What a tensor-parallel group that spans nodes costs, in milliseconds (quiz answers 3 and 8).

`tpkit train` asks `cross_node_penalty` when its tp groups would cross a node boundary
and prints the answer after `ParallelMesh`'s warning: the same cost model as `tpkit plan`,
for one layer and for one micro-batch through the whole model.
"""

from __future__ import annotations

from dataclasses import replace

from tpkit.plan import cost
from tpkit.plan.hardware import Hardware, get_hardware
from tpkit.plan.memory import Precision
from tpkit.plan.simulate import Layout, tp_collectives
from tpkit.spec.config import ModelConfig, get_preset
from tpkit.spec.grid import group_fits_node

DEFAULT_MODEL = "llama3-8b"


def cross_node_penalty(config: ModelConfig | None, tp: int, ranks_per_node: int, *,
                       hardware: str | Hardware = "h100", micro_batch: int = 1,
                       seq: int | None = None) -> str | None:
    """A sentence with the predicted extra time when tp groups span nodes, else None.

    Compares the tensor-parallel collectives of one layer (4 all-reduces of b*s*h, forward
    and backward) on the inter-node link with the same on the intra-node link. `config`
    None means a llama3-8b shape; `seq` defaults to min(4096, max_seq_len).
    """
    if group_fits_node(tp, ranks_per_node):
        return None
    hw = get_hardware(hardware) if isinstance(hardware, str) else hardware
    cfg = config or get_preset(DEFAULT_MODEL)
    seq = seq or min(4096, cfg.max_seq_len)
    prec = Precision.for_dtype(hw.accelerator.dtype)
    lay = Layout(tp=tp, pp=1, dp=1, micro_batch=micro_batch)
    across = sum(tp_collectives(cfg, seq, lay, _per_node(hw, ranks_per_node), prec).values())
    inside = sum(tp_collectives(cfg, seq, lay, _per_node(hw, tp), prec).values())
    extra = max(across - inside, 0.0)  # a profile whose two links are alike costs nothing
    link = cost.link_for(tp, _per_node(hw, ranks_per_node)).name
    nodes = -(-tp // ranks_per_node) if tp >= ranks_per_node else 2
    mib = micro_batch * seq * cfg.hidden * prec.activation / 2**20
    return (f"tp={tp} spans {nodes} nodes of {ranks_per_node} ranks: each layer's 4 all-reduces "
            f"of {mib:.0f} MiB take {across * 1e3:.2f} ms over {link} instead of "
            f"{inside * 1e3:.2f} ms on {hw.intra.name}: +{extra * 1e3:.2f} ms per layer, "
            f"+{extra * cfg.num_layers * 1e3:.0f} ms per micro-batch through the "
            f"{cfg.num_layers} layers of {cfg.name} (micro-batch {micro_batch}, sequence "
            f"{seq}, {hw.name} profile)")


def _per_node(hw: Hardware, n: int) -> Hardware:
    return replace(hw, devices_per_node=n)
