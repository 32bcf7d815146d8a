"""Tensor parallelism: one model split over several ranks (processes) of one host.

`parallel_state` holds a rank's view of its group and the collectives; `sharding` says which
slice of each weight a rank holds; `workers` starts and drives the ranks beyond rank 0;
`worker` is the loop those ranks run.
"""
