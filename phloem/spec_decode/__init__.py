"""phloem.spec_decode: speculative decoding's self-contained parts: exact verification of drafts
(modified rejection sampling), the draft proposers (n-gram, suffix) and the cost rule that sets
the number of drafts per request and step. The engine does not call them yet (docs/DESIGN.md,
"Speculative decoding (planned integration)")."""
