"""phloem.core: pure-Python engine state (requests, KV blocks, scheduling, stop rules).

Nothing here imports torch: it deals in token ids, block ids and counts only. An import-guard
test keeps it that way.
"""
