"""Speculative decoding: proposers (n-gram prompt lookup, a draft model) and the exact
acceptance of their proposals against the target model."""
