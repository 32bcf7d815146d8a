"""What the benchmark scripts share: clocks, statistics, the benchmark engine, prompts and
sampling mixes, model folders, servers and clients. Every module of `benchmarks/` itself is a
script (`python -m benchmarks.<name> --help`); none imports another."""
