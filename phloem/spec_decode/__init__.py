"""phloem.spec_decode: speculative decoding: exact verification of drafts (modified rejection
sampling, and the verify step's sampling on the device), the draft proposers (n-gram, suffix,
a draft model), the cost rule that sets the number of drafts per request and step, and the
engine's drafter (docs/DESIGN.md, "Speculative decoding")."""
