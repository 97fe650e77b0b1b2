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


def test_rows_are_encoded_from_ray_data_values_and_bad_rows_are_named():
    """The driver's row encoding without a cluster: Ray Data hands lists back as numpy arrays;
    a row needs exactly one prompt field and n = 1."""
    np = pytest.importorskip("numpy")
    from phloem.ray.processor import Processor, plain

    processor = Processor(PhloemProcessorConfig(engine_kwargs={"dtype": "float32"}))
    message = {"role": "user", "content": "Hi"}
    row = plain({"messages": np.array([message], dtype=object),
                 "sampling_params": {"max_tokens": np.int64(3), "stop": None}})  # fmt: skip
    ids, params = processor._encode(row)
    assert ids == processor.planner.encode_chat([message])[1] and params.max_tokens == 3
    ids, _ = processor._encode(plain({"prompt_token_ids": np.array([5, 6, 7])}))
    assert ids == [5, 6, 7]
    with pytest.raises(ValueError, match="exactly one of"):
        processor._encode({"prompt": "a", "messages": [message]})
    with pytest.raises(ValueError, match="sampling_params.n must be 1"):
        processor._encode({"prompt": "a", "sampling_params": {"n": 2}})


def test_share_blocks_cut_only_where_a_group_ends():
    from phloem.engine.replica_report import Deal
    from phloem.ray.engine import share_blocks

    request_group = [0, 0, 0, 1, 2, 2, 3]
    deal = Deal("prefix", [[0, 1, 2, 3], [4, 5, 6]], [2, 2], [1.0, 1.0], 0, 0)
    assert share_blocks(deal, request_group, None) == [(0, [0, 1, 2, 3]), (1, [4, 5, 6])]
    # a group larger than batch_size stays whole; blocks of the two shares interleave
    assert share_blocks(deal, request_group, 2) == [
        (0, [0, 1, 2]), (1, [4, 5]), (0, [3]), (1, [6])
    ]  # fmt: skip
