"""The planner: hardware profiles, cost model, memory model, simulator. Pure Python, no torch.

    from tpkit.plan import Request, Cluster, plan, get_hardware
    best = plan(Request(get_preset("llama3-70b"), seq=8192, global_batch=512,
                        cluster=Cluster(get_hardware("h100"), nodes=8)))[0]

`tpkit plan` prints the same as a table; `tpkit calibrate` measures this machine into a
profile called `local`; `topology.cross_node_penalty` prices a tp group that spans nodes.

    layout.py        a plan's choices (tp, cp, pp, dp, sharding stage, ...) and their names
    activations.py   the bytes one layer keeps for backward, tensor by tensor
    memory.py        weights, gradients, optimizer state and activations per device
    cost.py          FLOPs and bytes to seconds;  data_parallel.py: dp traffic per stage
    simulate.py      one plan's step time;  planner.py: search and rank;  reasons.py
    command_line.py  the chosen plan as `tpkit train` and Megatron-LM command lines
"""

from tpkit.plan.hardware import Hardware, HardwareError, get_hardware, load_profiles
from tpkit.plan.memory import params_per_rank
from tpkit.plan.planner import PlanError, Request, plan
from tpkit.plan.simulate import Cluster, Estimate, Layout, evaluate
from tpkit.plan.topology import cross_node_penalty

__all__ = [
    "Cluster",
    "Estimate",
    "Hardware",
    "HardwareError",
    "Layout",
    "PlanError",
    "Request",
    "cross_node_penalty",
    "evaluate",
    "get_hardware",
    "load_profiles",
    "params_per_rank",
    "plan",
]
