"""Speculative decoding in the worker: proposers that draft tokens, and the verification of drafts by the
target model (issue 24)."""
