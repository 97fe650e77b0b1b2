"""Bad input of phloem's Ray paths (issue 16): `phloem generate --ray-address` without Ray
installed, or with no cluster at the address, fails before any work (exit 2, naming the flag);
a processor config with bad values is refused naming the field. No Ray cluster starts here."""

from __future__ import annotations

import sys

import pytest

from phloem.entrypoints.cli import main
from phloem.ray import PhloemProcessorConfig


def _generate(tmp_path, address):
    source = tmp_path / "in.jsonl"
    source.write_text('{"prompt": "hi"}\n')
    output = tmp_path / "out.jsonl"
    # a model that does not exist: the Ray check must come first
    argv = ["generate", "-i", str(source), "-o", str(output), "--model", str(tmp_path / "none"),
            "--ray-address", address]  # fmt: skip
    return main(argv), output


def test_ray_not_installed(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    code, output = _generate(tmp_path, "auto")
    err = capsys.readouterr().err
    assert code == 2
    assert "--ray-address" in err and "pip install 'phloem[ray]'" in err
    assert not output.exists()


def test_unreachable_address(tmp_path, capsys):
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        pytest.skip("this process is connected to a Ray cluster already")
    code, output = _generate(tmp_path, "127.0.0.1:1")
    err = capsys.readouterr().err
    assert code == 2
    assert "--ray-address '127.0.0.1:1': no Ray cluster answers there" in err
    assert not output.exists()


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"concurrency": 0}, "concurrency must be an integer >= 1"),
        ({"batch_size": 0}, "batch_size must be an integer >= 1"),
        ({"max_restarts": -1}, "max_restarts must be an integer >= 0"),
        ({"num_gpus": -1}, "num_gpus must be a number >= 0"),
        ({"engine_kwargs": {"data_parallel_size": 2}}, "set it as concurrency"),
        ({"engine_kwargs": {"block_size": 0}}, "block_size"),
    ],
)
def test_bad_config(fields, message):
    with pytest.raises(ValueError, match=message):
        PhloemProcessorConfig(**fields).engine_args()
