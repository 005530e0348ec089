"""Speculative decoding: tokens proposed for a running request and verified by the target in one step.

speculator.py is what the scheduler calls (and why verification is exact); policy.py decides how many
drafts pay; ngram.py (prompt lookup) and draft.py (a small model) propose. Imported by module, so that
the request and scheduler layers can take the small pieces without the draft model's imports.
"""
