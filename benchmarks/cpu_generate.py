"""CPU throughput: phloem vs transformers' batched `generate` on the embedded model, same run.

Workload: 64 prompts of 100-300 random tokens (seeded), 64 greedy output tokens each (EOS ignored).
Prints both throughputs and their ratio and writes a JSON record to benchmarks/results/.

    OMP_WAIT_POLICY=PASSIVE python benchmarks/cpu_generate.py [--num-prompts 64] [--output-len 64]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402


def make_prompts(num: int, lo: int, hi: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(num)]


def run_phloem(prompts, output_len: int, max_num_batched_tokens: int) -> tuple[float, list]:
    from phloem import LLM, SamplingParams

    llm = LLM(max_num_batched_tokens=max_num_batched_tokens)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return elapsed, [o.outputs[0].token_ids for o in outputs]


@torch.inference_mode()
def run_transformers(prompts, output_len: int) -> tuple[float, list]:
    import transformers

    from phloem.models.loader import resolve_model

    source = resolve_model(None)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        source.path, gguf_file=source.gguf_file, dtype=torch.float32
    ).eval()
    pad = 2
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    kwargs = dict(
        max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, pad_token_id=pad
    )
    model.generate(
        ids[:2], attention_mask=mask[:2], **{**kwargs, "max_new_tokens": 2, "min_new_tokens": 2}
    )
    start = time.perf_counter()
    out = model.generate(ids, attention_mask=mask, **kwargs)
    elapsed = time.perf_counter() - start
    return elapsed, out[:, width:].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--min-prompt-len", type=int, default=100)
    parser.add_argument("--max-prompt-len", type=int, default=300)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out-dir", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()

    prompts = make_prompts(
        args.num_prompts, args.min_prompt_len, args.max_prompt_len, 49152, args.seed
    )
    num_in = sum(map(len, prompts))
    num_out = args.num_prompts * args.output_len
    t_phloem, tok_phloem = run_phloem(prompts, args.output_len, args.max_num_batched_tokens)
    t_hf, tok_hf = run_transformers(prompts, args.output_len)
    agree = sum(a == b for a, b in zip(tok_phloem, tok_hf)) / len(prompts)
    record = {
        "benchmark": "cpu_generate",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)",
        "torch_threads": torch.get_num_threads(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__},
        "command": " ".join([Path(sys.executable).name] + sys.argv),
        "model": "SmolLM2-135M-Instruct Q4_1 GGUF (dequantized, float32)",
        "workload": {
            "num_prompts": args.num_prompts,
            "prompt_len": [args.min_prompt_len, args.max_prompt_len],
            "output_len": args.output_len,
            "num_prompt_tokens": num_in,
            "num_output_tokens": num_out,
        },
        "phloem": {"wall_s": t_phloem, "output_tokens_per_s": num_out / t_phloem,
                   "total_tokens_per_s": (num_in + num_out) / t_phloem},
        "transformers": {"wall_s": t_hf, "output_tokens_per_s": num_out / t_hf,
                         "total_tokens_per_s": (num_in + num_out) / t_hf},
        "ratio_phloem_over_transformers": t_hf / t_phloem,
        "greedy_agreement": agree,
    }  # fmt: skip
    print(json.dumps(record, indent=2))
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = datetime.datetime.now(datetime.UTC).strftime("%Y%m%d-%H%M%S")
    (out_dir / f"cpu_generate-{stamp}.json").write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
