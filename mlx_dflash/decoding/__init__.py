"""Decoding: the speculative loop for one request and for a batch, acceptance, prompt lookup, the prefix
cache and what a generation reports."""
