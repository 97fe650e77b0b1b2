"""The converted-checkpoint cache: a tiny GGUF (the embedded model's tokenizer, random weights)
converted once and reused; the key follows the file's content; partial or corrupt directories are
rebuilt; racing converters leave one complete directory; truncated files fail naming the file;
and the embedded model greedy-decodes token for token the same from the GGUF and from the cache."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time

import pytest
import torch
import transformers
from test_gguf import _TOKENIZER_FIELDS, write_tiny_gguf

from phloem.models import checkpoint_cache
from phloem.models.checkpoint_cache import (
    MANIFEST,
    WEIGHTS,
    cache_key,
    converted_checkpoint,
    default_cache_dir,
    is_complete,
)
from phloem.models.gguf_loader import read_gguf
from phloem.models.loader import (
    ModelSource,
    iter_safetensors,
    load_hf_config,
    load_model,
    load_tokenizer,
    resolve_model,
)

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    """A 2-layer llama GGUF (mixed quantization types) carrying the embedded model's tokenizer."""
    if not importlib_has_embedded():
        pytest.skip("the embedded model's package is not installed")
    embedded = read_gguf(resolve_model(None).gguf_path)
    fields = {k: v for k, v in embedded.fields.items() if k in _TOKENIZER_FIELDS}
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        head_dim=16,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.no_grad():
        hf = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
        for p in hf.parameters():
            p.copy_(0.15 * torch.randn_like(p))
    path = str(tmp_path_factory.mktemp("tiny_gguf") / "tiny.gguf")
    write_tiny_gguf(hf, "llama", path, tokenizer_fields=fields)
    return path


def importlib_has_embedded() -> bool:
    import importlib.util

    from phloem.models.loader import EMBEDDED_PACKAGE

    return importlib.util.find_spec(EMBEDDED_PACKAGE) is not None


def test_default_cache_dir(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("PHLOEM_CACHE_DIR", str(tmp_path / "explicit"))
    assert default_cache_dir() == str(tmp_path / "explicit")
    monkeypatch.delenv("PHLOEM_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == str(tmp_path / "xdg" / "phloem")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == str(tmp_path / "home" / ".cache" / "phloem")


def test_tests_never_write_to_home() -> None:
    """tests/conftest.py points the cache at a session temp dir, so CI never writes to ~."""
    home_cache = os.path.join(os.path.expanduser("~"), ".cache", "phloem")
    assert not default_cache_dir().startswith(home_cache)


def test_key_follows_content_not_mtime(tiny_gguf, tmp_path) -> None:
    copy = tmp_path / "tiny.gguf"
    shutil.copyfile(tiny_gguf, copy)
    key = cache_key(str(copy), torch.float32)
    os.utime(copy, (1_000_000, 1_000_000))
    assert cache_key(str(copy), torch.float32) == key  # same bytes, other mtime: same key
    assert cache_key(str(copy), torch.bfloat16) != key
    data = bytearray(copy.read_bytes())
    data[-1] ^= 0xFF  # one byte of the last tensor
    copy.write_bytes(bytes(data))
    assert cache_key(str(copy), torch.float32) != key
    assert checkpoint_cache.CONVERTER_VERSION >= 1 and key.endswith(
        f"-float32-c{checkpoint_cache.CONVERTER_VERSION}"
    )


def _dir_weights(path: str) -> dict[str, torch.Tensor]:
    return {name: w.clone() for name, w in iter_safetensors(path)}  # not views of the file


def test_convert_once_then_reuse(tiny_gguf, tmp_path) -> None:
    root = str(tmp_path / "cache")
    path = converted_checkpoint(tiny_gguf, torch.float32, root)
    assert is_complete(path) and os.path.dirname(path) == os.path.join(root, "checkpoints")
    manifest = json.loads(open(os.path.join(path, MANIFEST)).read())
    assert manifest["source"] == os.path.abspath(tiny_gguf)
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", WEIGHTS} <= set(
        manifest["files"]
    )
    stamp = os.stat(os.path.join(path, WEIGHTS)).st_mtime_ns
    assert converted_checkpoint(tiny_gguf, torch.float32, root) == path
    assert os.stat(os.path.join(path, WEIGHTS)).st_mtime_ns == stamp  # reused, not rewritten
    assert os.listdir(os.path.join(root, "checkpoints")) == [os.path.basename(path)]

    # the directory is a standard HF checkpoint: transformers and phloem read it alike
    gguf_source = resolve_model(tiny_gguf)
    cached = ModelSource("hf_dir", path)
    ours, direct = load_hf_config(cached), load_hf_config(gguf_source)
    for field in ("num_hidden_layers", "hidden_size", "num_key_value_heads", "vocab_size",
                  "rms_norm_eps", "tie_word_embeddings", "rope_parameters", "architectures"):  # fmt: skip
        assert getattr(ours, field) == getattr(direct, field), field
    assert transformers.AutoConfig.from_pretrained(path).num_hidden_layers == 2
    a = load_model(cached, ours, torch.float32, "cpu").state_dict()
    b = load_model(gguf_source, direct, torch.float32, "cpu").state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    tok_cached, tok_gguf = load_tokenizer(cached), load_tokenizer(gguf_source)
    assert tok_cached.chat_template == tok_gguf.chat_template and tok_cached.chat_template
    assert (tok_cached.eos_token_id, tok_cached.bos_token_id) == (
        tok_gguf.eos_token_id,
        tok_gguf.bos_token_id,
    )
    for text in ["Hello world", " <|im_start|>user\nHi<|im_end|>", "naïve café 123  spaces"]:
        assert tok_cached.encode(text) == tok_gguf.encode(text)
        ids = tok_gguf.encode(text)
        assert tok_cached.decode(ids) == tok_gguf.decode(ids)
    messages = [{"role": "user", "content": "Hi"}]
    assert tok_cached.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    ) == tok_gguf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_bfloat16_cache_stores_bfloat16(tiny_gguf, tmp_path) -> None:
    path = converted_checkpoint(tiny_gguf, torch.bfloat16, str(tmp_path))
    weights = _dir_weights(path)
    assert {w.dtype for w in weights.values()} == {torch.bfloat16}
    assert converted_checkpoint(tiny_gguf, torch.float32, str(tmp_path)) != path


@pytest.mark.parametrize(
    "damage",
    ["no_manifest", "bad_manifest", "truncated_weights", "missing_tokenizer", "old_version"],
)
def test_partial_or_corrupt_cache_is_rebuilt(tiny_gguf, tmp_path, damage) -> None:
    root = str(tmp_path)
    path = converted_checkpoint(tiny_gguf, torch.float32, root)
    good = _dir_weights(path)
    weights = os.path.join(path, WEIGHTS)
    if damage == "no_manifest":  # a crash before the manifest was written
        os.remove(os.path.join(path, MANIFEST))
    elif damage == "bad_manifest":
        with open(os.path.join(path, MANIFEST), "w") as f:
            f.write('{"converter_version": ')
    elif damage == "truncated_weights":
        with open(weights, "r+b") as f:
            f.truncate(os.path.getsize(weights) // 2)
    elif damage == "missing_tokenizer":
        os.remove(os.path.join(path, "tokenizer.json"))
    else:
        manifest = json.loads(open(os.path.join(path, MANIFEST)).read())
        manifest["converter_version"] = 0
        with open(os.path.join(path, MANIFEST), "w") as f:
            json.dump(manifest, f)
    assert not is_complete(path)
    assert converted_checkpoint(tiny_gguf, torch.float32, root) == path
    assert is_complete(path)
    rebuilt = _dir_weights(path)
    assert rebuilt.keys() == good.keys() and all(torch.equal(rebuilt[k], good[k]) for k in good)
    assert sorted(os.listdir(os.path.join(root, "checkpoints"))) == [os.path.basename(path)]


def test_killed_conversion_leftovers_are_removed(tiny_gguf, tmp_path) -> None:
    """A temp dir older than ABANDONED_AFTER_S (a conversion killed mid-write) is deleted by the
    next conversion; a fresh one (a conversion still running elsewhere) is left alone."""
    root = tmp_path / "checkpoints"
    key = cache_key(tiny_gguf, torch.float32)
    old, fresh = root / f".{key}.tmp-old", root / f".{key}.tmp-fresh"
    for leftover in (old, fresh):
        leftover.mkdir(parents=True)
        (leftover / WEIGHTS).write_bytes(b"partial")
    past = time.time() - checkpoint_cache.ABANDONED_AFTER_S - 60
    os.utime(old, (past, past))
    path = converted_checkpoint(tiny_gguf, torch.float32, str(tmp_path))
    assert sorted(os.listdir(root)) == sorted([os.path.basename(path), fresh.name])


def test_concurrent_conversions_leave_one_complete_dir(tiny_gguf, tmp_path) -> None:
    results: list[str] = []
    errors: list[BaseException] = []

    def convert() -> None:
        try:
            results.append(converted_checkpoint(tiny_gguf, torch.float32, str(tmp_path)))
        except BaseException as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=convert) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1 and is_complete(results[0])
    assert os.listdir(os.path.join(tmp_path, "checkpoints")) == [os.path.basename(results[0])]


def test_truncated_gguf_names_the_file(tiny_gguf, tmp_path) -> None:
    data = open(tiny_gguf, "rb").read()
    for cut, what in [(len(data) - 100, "a tensor ends"), (2000, "header ends"), (10, "empty")]:
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(ValueError, match="truncated") as info:
            read_gguf(str(path))
        assert str(path) in str(info.value) and what in str(info.value)
        assert "\n" not in str(info.value)
        with pytest.raises(ValueError, match="truncated"):
            converted_checkpoint(str(path), torch.float32, str(tmp_path / "cache"))
    not_gguf = tmp_path / "x.gguf"
    not_gguf.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(ValueError, match="GGUF magic"):
        read_gguf(str(not_gguf))


def test_truncated_safetensors_names_the_file(tiny_gguf, tmp_path) -> None:
    src = converted_checkpoint(tiny_gguf, torch.float32, str(tmp_path / "cache"))
    plain = tmp_path / "plain"  # an ordinary HF directory, no manifest
    shutil.copytree(src, plain)
    os.remove(plain / MANIFEST)
    weights = plain / WEIGHTS
    source = resolve_model(str(plain))
    config = load_hf_config(source)
    for size in (os.path.getsize(weights) - 10, 100, 4):
        with open(weights, "r+b") as f:
            f.truncate(size)
        with pytest.raises(ValueError, match="truncated") as info:
            load_model(source, config, torch.float32, "cpu")
        assert str(weights) in str(info.value) and "\n" not in str(info.value)


@pytest.mark.slow
def test_embedded_greedy_identical_gguf_vs_cache(embedded_llm) -> None:
    """The session engine (loaded through the cache the session wrote on first start) and an
    engine that parses the GGUF file itself produce the same greedy tokens."""
    from phloem import LLM, SamplingParams

    assert embedded_llm.llm_engine.config.model.checkpoint_cache
    assert os.listdir(os.path.join(default_cache_dir(), "checkpoints"))
    direct = LLM(max_num_batched_tokens=64, checkpoint_cache=False, dtype="float32")
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a"]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    cached_out = embedded_llm.generate(prompts, params, use_tqdm=False)
    direct_out = direct.generate(prompts, params, use_tqdm=False)
    for c, d in zip(cached_out, direct_out):
        assert c.prompt_token_ids == d.prompt_token_ids
        assert c.outputs[0].token_ids == d.outputs[0].token_ids
        assert len(c.outputs[0].token_ids) == 32
    chat = [{"role": "user", "content": "Name a color."}]
    assert embedded_llm.encode_chat(chat) == direct.encode_chat(chat)


def test_generate_cli_cache_dir_flag_and_load_s(tiny_gguf, tmp_path, capsys) -> None:
    """`--cache-dir` puts the conversion there; the summary (stderr and JSON) reports load_s."""
    from phloem.entrypoints import cli

    src = tmp_path / "in.jsonl"
    src.write_text('{"prompt": "Hello"}\n{"prompt": "Bye"}\n')
    cache = tmp_path / "flag_cache"
    summary_path = tmp_path / "summary.json"
    argv = ["generate", "-i", str(src), "-o", str(tmp_path / "out.jsonl"), "--model", tiny_gguf,
            "--cache-dir", str(cache), "--max-tokens", "3", "--no-progress",
            "--summary-json", str(summary_path)]  # fmt: skip
    assert cli.main(argv) == 0
    (converted,) = os.listdir(cache / "checkpoints")
    assert is_complete(str(cache / "checkpoints" / converted))
    summary = json.loads(summary_path.read_text())
    assert 0 < summary["load_s"] < 600
    assert f"load time (load_s):    {summary['load_s']:.2f} s" in capsys.readouterr().err
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 2
