"""Tensor parallelism: the sharding plan (plan.py), the collectives between ranks (comm.py) and
the numpy simulation of the sharded forward (sim.py). The multi-GPU worker (one process per GPU,
NCCL) is not built yet: it needs the 2-GPU machine (issue 19)."""
