"""Tensor parallelism's primitives, below the models: one model split over several ranks
(processes) of one host.

`parallel_state` holds a rank's view of its group and the collectives; `sharding` says which
slice of each weight a rank holds. The processes themselves are started and driven by the
runner's tensor-parallel executor (`platform/runner/tp/`).
"""
