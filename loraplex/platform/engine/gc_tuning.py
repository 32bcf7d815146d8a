"""The garbage collector's settings for a serving process.

Each step makes thousands of short-lived objects (outputs, token lists, logprob entries), and
Python's default collector (a young-generation pass every 700 allocations, older passes that
rescan what is still alive) took a large share of the host's step time on a full batch: on the
output processor alone at 256 rows with top-5 logprobs, 36-43 ms per step with the defaults
against 25-30 ms with the thresholds below (on a busy 2-core machine; the GPU host is faster,
the share alike). The engine raises the thresholds; it does not freeze or disable collection,
since a process may build and drop several engines (tests, notebooks) and cycles must still go.

A serving process (the engine core, an API server) lives for one purpose, and once started it
freezes what start-up left (`freeze_startup_heap`): the modules, the model, the app are moved
out of the collector's sight, so an old-generation pass scans only what serving allocated. In
an API process at 256 streams that holds 200k objects of imports (torch, pydantic, FastAPI),
such a pass stopped every stream for 0.3-3 s (on a busy 2-core machine) before the freeze.
"""

from __future__ import annotations

import gc

import loraplex.envs as envs

# Allocations between young-generation passes, then passes of each generation per pass of the
# next one.
SERVING_THRESHOLDS = (50_000, 20, 100)


def tune_for_serving() -> bool:
    """Raise the collector's thresholds to SERVING_THRESHOLDS (never lower one).
    LORAPLEX_GC_TUNING=0 leaves the process's settings alone. -> whether it acted"""
    if not envs.gc_tuning():
        return False
    current = gc.get_threshold()
    gc.set_threshold(*(max(c, s) for c, s in zip(current, SERVING_THRESHOLDS, strict=True)))
    return True


def freeze_startup_heap() -> bool:
    """Collect once, then freeze every object alive (`gc.freeze`), and raise the thresholds
    (`tune_for_serving`): for a serving process, after its start-up. LORAPLEX_GC_TUNING=0
    leaves the process alone. -> whether it acted"""
    if not tune_for_serving():
        return False
    gc.collect()
    gc.freeze()
    return True
