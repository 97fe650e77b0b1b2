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


# -- DecodeStream (the fast path) against the two-decode window rule ------------------------------

TEXT = "Naïve café — 東京タワー 🙂🚀 done. Ünïcödé ✓ €5, 中文字符 und ß. 👩‍💻 end "


def sentencepiece_style(directory) -> str:
    """A Llama-2-style tokenizer.json: BPE with byte fallback (characters outside its small
    alphabet become <0xNN> tokens), "▁" for spaces, a decoder that strips the first space."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
         decoders.Strip(" ", 1, 0)]
    )  # fmt: skip
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=420, special_tokens=specials, limit_alphabet=40)
    corpus = ["the quick brown fox jumps over the lazy dog", "café naïve done end"] * 50
    tok.train_from_iterator(corpus, trainer)
    path = directory / "tokenizer.json"
    tok.save(str(path))
    (directory / "tokenizer_config.json").write_text('{"eos_token": "</s>"}')
    return str(directory)


def _tokenizers(embedded_tokenizer_dir, tmp_path_factory):
    import transformers

    from phloem.model_configs import synthetic_tokenizer
    from phloem.tokenizer import FastTokenizer

    sp_dir = sentencepiece_style(tmp_path_factory.mktemp("sp"))
    return {
        "embedded-fast": FastTokenizer(str(embedded_tokenizer_dir)),
        "embedded-transformers": transformers.AutoTokenizer.from_pretrained(embedded_tokenizer_dir),
        "sentencepiece-fast": FastTokenizer(sp_dir),
        "sentencepiece-transformers": transformers.PreTrainedTokenizerFast(
            tokenizer_file=f"{sp_dir}/tokenizer.json", eos_token="</s>"
        ),
        "synthetic-words": synthetic_tokenizer(500, eos_token_id=2),
    }


@pytest.fixture(scope="module")
def all_tokenizers(embedded_tokenizer_dir, tmp_path_factory):
    return _tokenizers(embedded_tokenizer_dir, tmp_path_factory)


def test_stream_backend_only_where_decode_is_the_backends(all_tokenizers, tokenizer) -> None:
    from phloem.engine.detokenizer import stream_backend

    for name, tok in all_tokenizers.items():
        assert stream_backend(tok) is not None, name
    assert stream_backend(CountingTokenizer(tokenizer)) is None  # no known tokenizer class
    cleaned = type(tokenizer).from_pretrained(
        tokenizer.name_or_path, clean_up_tokenization_spaces=True
    )
    assert stream_backend(cleaned) is None


@pytest.mark.parametrize(
    "name",
    ["embedded-fast", "embedded-transformers", "sentencepiece-fast",
     "sentencepiece-transformers", "synthetic-words"],
)  # fmt: skip
def test_decode_stream_equals_the_window_rule(all_tokenizers, name) -> None:
    """Token for token (returned stop string and text after every token, then the flush) the
    DecodeStream path equals the two-decode path (a wrapper tokenizer forces it), on emoji, CJK
    and accented text split into byte tokens, random ids and prompts that end mid-character."""
    tok = all_tokenizers[name]
    rng = random.Random(hash(name) % 1000)
    text_ids = tok.encode(TEXT * 3, add_special_tokens=False)
    vocab = len(tok)
    num_fast = 0
    for case in range(150):
        start = rng.randrange(len(text_ids) - 1)
        if case % 3 == 0:  # a prompt cut anywhere in the text: may end inside a character
            prompt = text_ids[max(0, start - rng.randint(1, 8)) : start]
        else:
            prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 8))]
        outputs = text_ids[start : start + rng.randint(1, 40)]
        if rng.random() < 0.25:
            outputs = outputs + [rng.randrange(vocab) for _ in range(rng.randint(1, 12))]
        stop = [rng.choice(["京", "é", " done", "🙂", "zz", "t1"])] if rng.random() < 0.5 else []
        skip = rng.random() < 0.8
        fast = IncrementalDetokenizer(tok, prompt or [0], skip, stop)
        reference = IncrementalDetokenizer(CountingTokenizer(tok), prompt or [0], skip, stop)
        assert not reference.uses_decode_stream
        num_fast += fast.uses_decode_stream
        hit = None
        for token_id in outputs:
            hit = fast.add_token(token_id)
            assert (hit, fast.text) == (reference.add_token(token_id), reference.text), case
            if hit is not None:
                break
        if hit is None:
            assert (fast.flush(), fast.text) == (reference.flush(), reference.text), case
    assert num_fast > 100  # most contexts end on a character boundary


@pytest.mark.parametrize("stop", [(), ("ing",)])
@pytest.mark.parametrize("incremental", [False, True])
def test_add_tokens_matches_add_token_one_at_a_time(tokenizer, stop, incremental) -> None:
    """`add_tokens` (a verify step's run) against `add_token` per token: the same stop hit, at
    the same token, and the same text after the flush."""
    ids = tokenizer.encode("The running dog is singing, and the cat is eating a fish.")
    one = IncrementalDetokenizer(tokenizer, [1, 2], stop=stop, incremental=incremental)
    run = IncrementalDetokenizer(tokenizer, [1, 2], stop=stop, incremental=incremental)
    want, i = None, 0
    for i, token_id in enumerate(ids):  # noqa: B007 - i is the hit's index
        if (want := one.add_token(token_id)) is not None:
            break
    got = None
    for start, end in ((0, 3), (3, 7), (7, len(ids))):
        if (hit := run.add_tokens(ids[start:end])) is not None:
            got = (start + hit[0], hit[1])
            break
    assert got == (None if want is None else (i, want))
    assert (want is not None) == bool(stop)
    one.flush()
    run.flush()
    assert run.text == one.text
