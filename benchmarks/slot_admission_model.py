"""How many decode steps `benchmarks.multi_lora`'s 256-adapter workload needs when only 64
adapters can hold a GPU slot at once, under two orders of giving freed slots to waiting adapters.

A model, not a measurement: decode only (one token per running request a step, no prefill, no
KV limit), every step admitting what fits. A request runs once its adapter holds a slot; a slot
is held while any request on its adapter runs and is free when the last one ends. The requests
are multi_lora's own (its seeds: lengths, Zipf adapter draws), all queued at step 0.

- `arrival`: a freed slot goes to the adapter of the oldest waiting request (the scheduler now)
- `longest_first`: to the waiting adapter whose longest queued request is longest
- `unlimited`: as many slots as adapters (the base's bound)

    python -m benchmarks.slot_admission_model
    # writes benchmarks/results/model_slot_admission.json: steps per order and
    # step_ratio_<order> = unlimited steps / its steps (the ratio to base at equal step cost)
"""

from __future__ import annotations

import argparse
import random
from collections import Counter

from benchmarks.multi_lora import request_lengths, settings, zipf_choices
from benchmarks.record import write_result


def requests(num_adapters: int) -> tuple[list[int], list[int]]:
    """(output length, adapter) of each of multi_lora's requests, drawn with its seeds."""
    cuda = settings(cpu=False)
    # NOTE: multi_lora.workload's seed, so these are its requests' lengths
    lens = request_lengths(
        random.Random(2), cuda["num_requests"], cuda["input_len"], cuda["output_len"]
    )
    outputs = [o for _, o in lens]
    return outputs, zipf_choices(num_adapters, len(outputs))


def steps(outputs: list[int], adapters: list[int], slots: int, order: str) -> int:
    """Decode steps until every request has its tokens (see the module doc)."""
    waiting = list(range(len(outputs)))
    if order == "longest_first":
        longest = Counter()
        for r in waiting:
            longest[adapters[r]] = max(longest[adapters[r]], outputs[r])
        # NOTE: all requests queue at step 0, so this static order is the dynamic choice
        waiting.sort(key=lambda r: (-longest[adapters[r]], adapters[r], r))
    left: dict[int, int] = {}  # running request -> tokens still to come
    holders: Counter[int] = Counter()  # adapter -> its running requests (a held slot)
    count = 0
    while waiting or left:
        still = []
        for r in waiting:
            a = adapters[r]
            if a in holders or len(holders) < slots:
                holders[a] += 1
                left[r] = outputs[r]
            else:
                still.append(r)
        waiting = still
        count += 1
        for r in list(left):
            left[r] -= 1
            if left[r] == 0:
                del left[r]
                holders[adapters[r]] -= 1
                if holders[adapters[r]] == 0:
                    del holders[adapters[r]]
    return count


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--adapters", type=int, default=256)
    p.add_argument("--slots", type=int, default=64)
    p.add_argument("--out", default="model_slot_admission.json")
    args = p.parse_args(argv)
    outputs, adapters = requests(args.adapters)
    unlimited = steps(outputs, adapters, len(set(adapters)), "arrival")
    metrics: dict[str, float] = {"distinct_adapters": len(set(adapters))}
    for order in ("arrival", "longest_first"):
        n = steps(outputs, adapters, args.slots, order)
        metrics[f"steps_{order}"] = n
        metrics[f"step_ratio_{order}"] = unlimited / n
    print(
        f"{len(outputs)} requests on {len(set(adapters))} adapters, {args.slots} slots: {metrics}"
    )
    write_result(args.out, "slot_admission_model", metrics, {"steps_unlimited": unlimited},
                 device="model (no device)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
