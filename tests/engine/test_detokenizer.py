"""IncrementalDetokenizer on the embedded model's tokenizer: held-back characters, stop strings
found in the flush, and a flush that decodes nothing when nothing is held back."""

from __future__ import annotations

import random

import pytest

from phloem.engine.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer(embedded_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(embedded_tokenizer_dir)


class CountingTokenizer:
    """Forwards `decode` and counts its calls."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.num_decodes = 0

    def decode(self, token_ids, **kwargs):
        self.num_decodes += 1
        return self.tokenizer.decode(token_ids, **kwargs)


def feed(detok: IncrementalDetokenizer, token_ids: list[int]) -> str | None:
    """add_token each id until a stop string hits; flush at the end if none did."""
    for token_id in token_ids:
        stop = detok.add_token(token_id)
        if stop is not None:
            return stop
    return detok.flush()


def test_flush_with_nothing_held_back_decodes_nothing(tokenizer) -> None:
    counting = CountingTokenizer(tokenizer)
    prompt = tokenizer.encode("Count: one,", add_special_tokens=False)
    detok = IncrementalDetokenizer(counting, prompt, stop=["never"])
    for token_id in tokenizer.encode(" two, three", add_special_tokens=False):
        assert detok.add_token(token_id) is None
    num_decodes, text = counting.num_decodes, detok.text
    assert text == " two, three"
    assert detok.flush() is None
    assert counting.num_decodes == num_decodes and detok.text == text


def test_flush_emits_a_held_back_character_and_finds_a_stop_string_in_it(tokenizer) -> None:
    prompt = tokenizer.encode("Tokyo is", add_special_tokens=False)
    outputs = tokenizer.encode(" 東京", add_special_tokens=False)
    # the last character's bytes span two tokens: its text is held back until the second
    detok = IncrementalDetokenizer(tokenizer, prompt, incremental=True)
    for token_id in outputs[:-1]:
        detok.add_token(token_id)
    assert detok.text == " 東"
    detok.add_token(outputs[-1])
    assert detok.text == " 東京" and detok.flush() is None and detok.text == " 東京"
    # a sequence that ends inside a character: the flush emits the replacement character
    detok = IncrementalDetokenizer(tokenizer, prompt, stop=["京"])
    assert feed(detok, outputs[:-1]) is None and detok.text == " 東\ufffd"
    # the stop string completes only with the held-back bytes: found by the flush, text cut
    detok = IncrementalDetokenizer(tokenizer, prompt, stop=["京"])
    for token_id in outputs:
        stop = detok.add_token(token_id)
    assert stop == "京" and detok.text == " 東"


@pytest.mark.parametrize("seed", range(4))
def test_flush_matches_a_final_advance(tokenizer, seed) -> None:
    """The flush returns and leaves exactly what `_advance(final=True)` (the flush before it
    skipped decoding) does, on text, byte tokens that split characters, and random ids."""
    rng = random.Random(seed)
    text_ids = tokenizer.encode("Naïve café — 東京 🙂 done. " * 4, add_special_tokens=False)
    for _ in range(40):
        prompt = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 8))]
        start = rng.randrange(len(text_ids))
        outputs = text_ids[start : start + rng.randint(1, 12)]
        if rng.random() < 0.3:
            outputs = [rng.randrange(len(tokenizer)) for _ in range(rng.randint(1, 12))]
        stop = [rng.choice(["京", "é", " done", "zz"])] if rng.random() < 0.7 else []
        detok = IncrementalDetokenizer(tokenizer, prompt, stop=stop)
        reference = IncrementalDetokenizer(tokenizer, prompt, stop=stop)
        hit = ref_hit = None
        for token_id in outputs:
            hit, ref_hit = detok.add_token(token_id), reference.add_token(token_id)
            assert hit == ref_hit
            if hit is not None:
                break
        if hit is None:
            hit, ref_hit = detok.flush(), reference._advance(final=True)
        assert (hit, detok.text) == (ref_hit, reference.text)
