"""`phloem.tokenizer.FastTokenizer` against transformers' `PreTrainedTokenizerFast` on the same
files: encode, decode (special tokens kept and skipped, partial characters), the vocabulary,
the special token ids and chat templates (the embedded model's, and one using every feature
transformers' renderer provides); and a converted checkpoint loads without importing
transformers."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import textwrap

import pytest

from phloem.tokenizer import FastTokenizer

transformers = pytest.importorskip("transformers")

TEXTS = [
    "",
    "Hello world",
    "  leading and  double  spaces ",
    "naïve café — 東京 🚀 emoji\tand tabs\n\nnew lines",
    "<|im_start|>user\nHi<|im_end|>",
    "inline <|endoftext|> special, don't stop: it's fine!",
    "x" * 300,
]

CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": 'Another <b>one</b> & "quoted" ü?'},
    ],
]

# every feature of transformers' renderer: trim/lstrip blocks, loop controls, a tojson that keeps
# non-ASCII and HTML characters, raise_exception, special tokens as variables, extra kwargs
FEATURE_TEMPLATE = textwrap.dedent("""\
    {{ bos_token }}
    {% for message in messages %}
        {% if message['role'] not in ['system', 'user', 'assistant'] %}
            {{ raise_exception('bad role ' + message['role']) }}
        {% endif %}
        {% if message['content'] == 'STOP' %}{% break %}{% endif %}
        {% if message['content'] == 'SKIP' %}{% continue %}{% endif %}
        <{{ message['role'] }}>{{ message['content'] | tojson }}{{ eos_token }}
        {% if not loop.last %}|{% endif %}
    {% endfor %}
    {% if add_generation_prompt %}<assistant>{% endif %}{{ extra | default('') }}
    """)


@pytest.fixture(scope="module")
def tokenizer_dir(embedded_tokenizer_dir, tmp_path_factory):
    """The embedded model's tokenizer files (as the converted-checkpoint cache writes them)."""
    path = tmp_path_factory.mktemp("fast_tokenizer")
    shutil.copytree(embedded_tokenizer_dir, path, dirs_exist_ok=True)
    return path


def _pair(path):
    return FastTokenizer(str(path)), transformers.PreTrainedTokenizerFast.from_pretrained(path)


def test_encode_decode_vocab_and_special_ids_match_transformers(tokenizer_dir) -> None:
    ours, ref = _pair(tokenizer_dir)
    assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id) == (
        ref.eos_token_id,
        ref.bos_token_id,
        ref.pad_token_id,
    )
    assert ours.eos_token_id is not None
    assert ours.get_vocab() == ref.get_vocab() and len(ours) == len(ref)
    pieces = ["<|im_start|>", "Hello", "Ġworld", "no-such-piece"]
    assert ours.convert_tokens_to_ids(pieces) == ref.convert_tokens_to_ids(pieces)[:3] + [None]
    assert ours.convert_tokens_to_ids("<|im_end|>") == ref.convert_tokens_to_ids("<|im_end|>")
    assert ours.convert_ids_to_tokens([0, 1, 500]) == ref.convert_ids_to_tokens([0, 1, 500])
    assert ours.convert_ids_to_tokens(7) == ref.convert_ids_to_tokens(7)
    for text in TEXTS:
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == ref.encode(
                text, add_special_tokens=special
            ), text
    rng = random.Random(0)
    specials = [ours.eos_token_id, ours.bos_token_id, 0]
    for _ in range(200):
        ids = [rng.randrange(len(ref)) for _ in range(rng.randrange(1, 12))]
        ids.insert(rng.randrange(len(ids) + 1), rng.choice(specials))
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(
                ids, skip_special_tokens=skip
            ), ids
    # a character split over tokens decodes to U+FFFD alike (the detokenizer holds it back)
    ids = ref.encode("🚀")
    assert (
        len(ids) > 1
        and ours.decode(ids[:1]) == ref.decode(ids[:1])
        and "\ufffd" in ours.decode(ids[:1])
    )


def test_chat_template_matches_transformers(tokenizer_dir) -> None:
    ours, ref = _pair(tokenizer_dir)
    assert ours.chat_template and ours.chat_template == ref.chat_template
    for messages in CONVERSATIONS:
        for gen in (True, False):
            got = ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert got == ref.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=gen
            )
            assert ours.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen) == (
                ref.encode(got, add_special_tokens=False)
            )


def test_template_features_render_as_transformers_does(tokenizer_dir, tmp_path) -> None:
    shutil.copytree(tokenizer_dir, tmp_path, dirs_exist_ok=True)
    (tmp_path / "chat_template.jinja").write_text(FEATURE_TEMPLATE)
    ours, ref = _pair(tmp_path)
    conversations = [
        *CONVERSATIONS,
        [{"role": "user", "content": "SKIP"}, {"role": "user", "content": "kept"}],
        [{"role": "user", "content": "a"}, {"role": "user", "content": "STOP"}, {"role": "user", "content": "b"}],
    ]  # fmt: skip
    for messages in conversations:
        kwargs = {"tokenize": False, "add_generation_prompt": True, "extra": "<x é>"}
        assert ours.apply_chat_template(messages, **kwargs) == ref.apply_chat_template(
            messages, **kwargs
        )
    bad = [{"role": "tool", "content": "x"}]
    with pytest.raises(Exception, match="bad role tool"):
        ref.apply_chat_template(bad, tokenize=False)
    with pytest.raises(Exception, match="bad role tool"):
        ours.apply_chat_template(bad, tokenize=False)


def test_clean_up_tokenization_spaces_as_transformers_applies_it(tokenizer_dir, tmp_path) -> None:
    """transformers ignores the word-piece clean-up for BPE models (decodes alike); for other
    models FastTokenizer refuses the directory and the loader falls back to transformers."""
    from phloem.model_configs import synthetic_tokenizer
    from phloem.models import checkpoint_cache, loader
    from phloem.tokenizer import UnsupportedTokenizer

    shutil.copytree(tokenizer_dir, tmp_path / "bpe")
    config_path = tmp_path / "bpe" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["clean_up_tokenization_spaces"] = True
    config_path.write_text(json.dumps(config))
    ours, ref = _pair(tmp_path / "bpe")
    ids = ref.encode("Yes . No , isn 't it ? I 'm here !", add_special_tokens=False)
    assert ours.decode(ids) == ref.decode(ids)

    synthetic_tokenizer(16, eos_token_id=1).save_pretrained(tmp_path / "words")
    config_path = tmp_path / "words" / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["clean_up_tokenization_spaces"] = True
    config_path.write_text(json.dumps(config))
    with pytest.raises(UnsupportedTokenizer, match="clean_up_tokenization_spaces"):
        FastTokenizer(str(tmp_path / "words"))
    source = loader.ModelSource("hf_dir", str(tmp_path / "words"))
    (tmp_path / "words" / "config.json").write_text("{}")
    with open(tmp_path / "words" / checkpoint_cache.MANIFEST, "w") as f:  # as if phloem wrote it
        f.write("{}")
    assert loader.is_converted_checkpoint(source)
    assert isinstance(loader.load_tokenizer(source), transformers.PreTrainedTokenizerBase)


def test_missing_or_bad_files_name_the_path(tokenizer_dir, tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        FastTokenizer(str(tmp_path))
    shutil.copy(tokenizer_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text("[1]")
    with pytest.raises(ValueError, match="tokenizer_config.json must hold a JSON object"):
        FastTokenizer(str(tmp_path))


@pytest.mark.slow
def test_converted_checkpoint_starts_without_transformers(embedded_llm) -> None:
    """`LLM()` on the (already converted) embedded model and a chat request never import
    transformers: its import is most of a second start."""
    from phloem.models.checkpoint_cache import default_cache_dir

    code = (
        "import sys\n"
        "from phloem import LLM, SamplingParams\n"
        "llm = LLM(max_num_batched_tokens=64, dtype='float32')\n"
        "out = llm.chat([[{'role': 'user', 'content': 'Hi'}]], SamplingParams(max_tokens=2),"
        " use_tqdm=False)\n"
        "assert out[0].outputs[0].token_ids, out\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'transformers')\n"
        "assert not loaded, loaded[:5]\n"
    )
    env_cache = {"PHLOEM_CACHE_DIR": default_cache_dir()}
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env_cache},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"add_bos_token": True}, "add_bos_token"),
        ({"add_prefix_space": True}, "add_prefix_space"),
        ({"tokenizer_class": "LlamaTokenizerFast"}, "LlamaTokenizerFast"),
    ],
)
def test_config_keys_it_does_not_reproduce_leave_the_directory_to_transformers(
    tokenizer_dir, tmp_path, change, named
) -> None:
    """A tokenizer_config.json key that may change how transformers builds the tokenizer (or a
    model-specific class) is refused, and the loader falls back to transformers."""
    from phloem.models import checkpoint_cache, loader
    from phloem.tokenizer import UnsupportedTokenizer

    shutil.copytree(tokenizer_dir, tmp_path, dirs_exist_ok=True)
    config_path = tmp_path / "tokenizer_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), **change}))
    with pytest.raises(UnsupportedTokenizer, match=named):
        FastTokenizer(str(tmp_path))
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / checkpoint_cache.MANIFEST).write_text("{}")  # as if phloem wrote it
    source = loader.ModelSource("hf_dir", str(tmp_path))
    assert isinstance(loader.load_tokenizer(source), transformers.PreTrainedTokenizerBase)
