"""Tensor parallelism: the rank group a model is sharded over, and how its weights are split.

parallel_state.py  the TP group (rank, size, torch.distributed groups) and its collectives
sharding.py        which rows/columns of a checkpoint tensor a rank holds (read lazily)
step_channel.py    the driver rank's per-step broadcast of the step's flat arrays to the others
"""
