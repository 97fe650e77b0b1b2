"""The pieces composed as the engine will compose them (a toy target instead of a model): a
greedy speculative loop with each proposer and the cost rule emits exactly the target's greedy
tokens, in fewer steps on a repetitive target."""

from __future__ import annotations

import pytest
import torch

from phloem.spec_decode.acceptance import AcceptanceTracker
from phloem.spec_decode.cost_rule import (
    LLAMA_8B_H100,
    CostRuleConfig,
    DraftCandidate,
    choose_num_drafts,
)
from phloem.spec_decode.ngram_proposer import NgramProposer
from phloem.spec_decode.proposer import DraftRequest
from phloem.spec_decode.rejection_sampler import rejection_sample
from phloem.spec_decode.suffix_proposer import SuffixProposer

VOCAB = 32


def _target_logits(history: list[int]) -> torch.Tensor:
    """A deterministic toy target over the last two tokens: mostly a cycle of 7 tokens (so
    drafts from history are often right), sometimes a jump."""
    a, b = history[-2], history[-1]
    gen = torch.Generator().manual_seed(a * VOCAB + b)
    logits = torch.randn(VOCAB, generator=gen)
    if (a + b) % 5:
        logits[(b + 1) % 7] += 10.0
    return logits


def _greedy(prompt: list[int], num_tokens: int) -> list[int]:
    history = list(prompt)
    for _ in range(num_tokens):
        history.append(int(_target_logits(history).argmax()))
    return history[len(prompt) :]


def _speculative(prompt: list[int], num_tokens: int, proposer) -> tuple[list[int], int]:
    """Greedy speculative decoding of one request; returns (outputs, verify steps)."""
    history, steps, tracker = list(prompt), 0, AcceptanceTracker()
    while len(history) - len(prompt) < num_tokens:
        request = DraftRequest("r", history, len(prompt), 8)
        draft = proposer.propose([request])[0]
        rate = tracker.rate("r")
        k = choose_num_drafts(
            [DraftCandidate(rate, len(draft))], 1, 1, len(history), LLAMA_8B_H100,
            CostRuleConfig(max_draft_tokens=8),
        )[0]  # fmt: skip
        draft = draft[:k]
        # the target scores the k + 1 positions in one pass
        logits = torch.stack([_target_logits(history + draft[:j]) for j in range(k + 1)])
        drafts = torch.tensor([draft + [-1] * (8 - k)])
        padded = torch.cat([logits, logits[-1:].expand(8 - k, VOCAB)])[None]
        out = rejection_sample(padded, drafts, [k], is_greedy=[True])
        accepted = int(out.num_accepted[0])
        if k:
            tracker.observe("r", k, accepted)
        else:
            tracker.skipped("r")
        history += out.token_ids[0, : accepted + 1].tolist()
        steps += 1
    return history[len(prompt) : len(prompt) + num_tokens], steps


@pytest.mark.parametrize("make", [NgramProposer, SuffixProposer])
def test_greedy_speculation_emits_the_targets_greedy_tokens(make) -> None:
    prompt = [3, 4, 5, 6, 0, 1, 2, 3, 4, 5]
    want = _greedy(prompt, 60)
    got, steps = _speculative(prompt, 60, make())
    assert got == want
    assert steps < 45  # drafts were accepted: fewer verify steps than tokens
