"""mpiring: ring attention (context parallelism) on CPUs with real MPI and NumPy."""

from .backward import distributed_attention_backward, predicted_backward_bytes, ring_attention_backward
from .costmodel import predicted_bytes_sent, ring_attention_context_parallel
from .kernels import (attention_block, attention_block_backward, merge, reference_attention,
                      reference_attention_backward)
from .layouts import LAYOUTS, shard, shard_indices, unshard
from .masks import visible_keys
from .ring import Record, distributed_attention, ring_attention
from .schedule import MODES, Schedule, Task, make_plan
from .simulate import ring_attention_simulate, simulate

__all__ = [
    "ring_attention", "distributed_attention", "Record",
    "ring_attention_backward", "distributed_attention_backward", "predicted_backward_bytes",
    "attention_block_backward", "reference_attention_backward",
    "ring_attention_simulate", "simulate",
    "ring_attention_context_parallel", "predicted_bytes_sent",
    "attention_block", "merge", "reference_attention", "visible_keys",
    "LAYOUTS", "shard", "shard_indices", "unshard",
    "MODES", "Schedule", "Task", "make_plan",
]
__version__ = "0.1.0"
