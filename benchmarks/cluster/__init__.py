"""The multi-tenant routing simulator of `benchmarks.cluster_sim`: replica costs fitted to the
H200 records, the workload, replicas and routers."""
