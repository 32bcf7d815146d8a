"""The tensor-parallel executor, beside the runner: rank 0's runner starts the other ranks
(`workers`), each a process that runs `worker`'s loop over its own runner, and sends them every
step it launches (`messages`); LoRA slot writes reach every rank (`lora_state`).

It knows no `ModelRunner`: rank 0 hands `TensorParallelWorkers` the factory that builds a
rank's runner.
"""
