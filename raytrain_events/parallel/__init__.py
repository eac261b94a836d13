"""Data parallelism for the `Trainer`: DDP (default), FSDP2 sharding or HSDP (`FSDPConfig`,
``replicate=k``) and tensor parallelism (``tensor_parallel=t``, ``tensor_parallel.py``); deferred init of meta-device models (``deferred_init.py``); float8 (``float8.py``)."""

from raytrain_events.parallel.config import FSDPConfig, ParallelismSpec, parse_parallelism
from raytrain_events.parallel.tensor_parallel import apply_tensor_parallel
from raytrain_events.parallel.wrap import Parallel, apply_fsdp, check_algorithms_for_sharding, is_sharded_module

__all__ = [
    "FSDPConfig",
    "Parallel",
    "ParallelismSpec",
    "apply_fsdp",
    "apply_tensor_parallel",
    "check_algorithms_for_sharding",
    "is_sharded_module",
    "parse_parallelism",
]
