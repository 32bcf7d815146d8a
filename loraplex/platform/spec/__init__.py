"""Speculative decoding's proposers: n-gram prompt lookup and a draft model, which bet the
next tokens of running requests. The runner calls them and verifies their proposals exactly
(`platform/runner/verifier.py`, `rejection_sampler.py`); a draft model samples through the
runner's `DraftSampler`, so nothing here imports the runner."""
