"""Speculative decoding: tokens proposed for a running request and verified by the target in one step.

steps.py is what the scheduler calls each step (propose within the free pages, verify); speculator.py
keeps each request's state (and says why verification is exact); policy.py decides how many
drafts pay; ngram.py (prompt lookup) and draft.py (a small model) propose. Imported by module, so that
the request and scheduler layers can take the small pieces without the draft model's imports.
"""
