"""Starting the ranks of a tensor-parallel model.

The engine core process is rank 0, the driver: it runs the Rust scheduler, its own shard of the
model, and the sampler. Ranks 1..N-1 run only their shard (worker_main.py), as processes on this
machine (mp_executor.py, `distributed_executor_backend="mp"`) or as Ray actors placed by a
placement group, on this machine or across a Ray cluster (ray_executor.py, "ray").

    tp, executor = start_tensor_parallel(config)   # before the model is loaded
    ...                                            # every rank loads its shard, in step
    executor.shutdown()
"""

from ferrox.executor.launch import Executor, start_tensor_parallel

__all__ = ["Executor", "start_tensor_parallel"]
