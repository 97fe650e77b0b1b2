"""benchmarks/fp8_kv_decode.py on the CPU (issue 18): its tiny mode runs phloem's Triton kernel
under the interpreter on bf16 and FP8 caches against float64 and writes the JSON the GPU run
writes (untimed); candidate selection and the speed table's arithmetic on given numbers."""

from __future__ import annotations

import json

from benchmarks import fp8_kv_decode as bench


def test_tiny_cpu_run_checks_the_triton_kernel(tmp_path):
    out = tmp_path / "r.json"
    names = ["triton/bn32/w4/s2", "triton/bn32/w4/s2/q", "flashinfer-xqa"]
    assert (
        bench.main(["--device", "cpu", "--tiny", "--candidates", *names, "--json", str(out)]) == 0
    )
    r = json.loads(out.read_text())
    assert r["candidates"] == names[:2] and r["failed"] == []  # FlashInfer needs CUDA
    assert [(c["kv_dtype"], sorted(c["kernels"])) for c in r["cases"]] == [
        ("bf16", ["triton/bn32/w4/s2"]),
        ("fp8", ["triton/bn32/w4/s2", "triton/bn32/w4/s2/q"]),
    ]
    fp8 = r["cases"][1]
    assert (fp8["k_scale"], fp8["v_scale"]) == (0.5, 2.0)
    for entry in fp8["kernels"].values():
        assert entry["ok"] and entry["rel_err"] < bench.REL_TOL["16-bit"]
        assert entry["us_per_layer"] is None


def test_candidate_choice_and_speed_table():
    assert "fi-fa3-fp8q" not in bench.chosen(["default"], "cuda")
    assert "fi-fa3-fp8q" in bench.chosen(["all"], "cuda")
    assert all(not bench.CANDIDATES[n].flashinfer for n in bench.chosen(["all"], "cpu"))
    cases = [
        {"batch": 64, "kv": 1024, "kv_dtype": "bf16",
         "kernels": {"flashinfer": {"us_per_layer": 80.0, "kv_read_tb_s": 3.4}}},
        {"batch": 64, "kv": 1024, "kv_dtype": "fp8",
         "kernels": {"flashinfer": {"us_per_layer": 80.0, "kv_read_tb_s": 1.7},
                     "flashinfer-xqa": {"us_per_layer": 50.0, "kv_read_tb_s": 2.7},
                     "broken": {"error": "x", "ok": False}}},
    ]  # fmt: skip
    table = bench.compare(cases)
    assert table[2].startswith("| 64 | 1024 | bf16 | flashinfer | 80.0 | 3.40 | 1.00x")
    assert table[3].startswith("| 64 | 1024 | fp8 | flashinfer-xqa | 50.0 | 2.70 | 1.60x")
    assert cases[1]["kernels"]["flashinfer"]["vs_bf16"] == 1.0
