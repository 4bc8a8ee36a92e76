"""Speculative decoding: drafts (:mod:`.ngram_drafter`) and their verification inside continuous batching
(:mod:`.verification`)."""
