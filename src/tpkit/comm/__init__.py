"""Communication: process groups, the ledger, the collectives and their autograd conjugates.

Every collective tpkit performs goes through `collectives.py`, which records it in
the group's `Ledger`; `ops.py` wraps them as the conjugate autograd operators of the
Megatron paper; `theory.py` states what each layer must send.
"""

from tpkit.comm.collectives import (
    all_gather,
    all_reduce,
    broadcast,
    compile_ready,
    isend,
    recv,
    reduce_scatter,
    send,
)
from tpkit.comm.group import CommGroup
from tpkit.comm.ledger import Ledger, Record
from tpkit.comm.ops import (
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_sp,
    scatter_to_tp,
    sequence,
)
from tpkit.comm.parts import all_gather_parts, reduce_scatter_parts

__all__ = [
    "CommGroup",
    "Ledger",
    "Record",
    "all_gather",
    "all_gather_parts",
    "all_reduce",
    "broadcast",
    "compile_ready",
    "copy_to_tp",
    "gather_from_sp",
    "gather_from_tp",
    "isend",
    "recv",
    "reduce_from_tp",
    "reduce_scatter",
    "reduce_scatter_parts",
    "reduce_scatter_to_sp",
    "scatter_to_sp",
    "scatter_to_tp",
    "send",
    "sequence",
]
