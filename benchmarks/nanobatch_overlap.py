"""Does a decode step get faster when two halves of its batch run on two CUDA streams (NanoFlow)?

Issue 19: decode-heavy (1000 in / 1000 out) sits at 0.49 of the roofline for phloem and vLLM
alike, and the attention kernel already reads KV at 0.81-1.02 of copy bandwidth
(benchmarks/results/2026-11-26b-h200x2): a decode step runs its GEMMs (compute-bound at batch
~500) and its attention (bound by reading KV) one after the other. NanoFlow (arXiv 2408.12757,
§3-4) splits the batch into nano-batches whose operations of different kinds run at the same
time. Before the engine is restructured for it, this measures the effect on decoder layers of
Llama-3.1-8B shapes (bf16, random weights, `--layers` layers with their own weights so none stays
in L2), captured in CUDA graphs as decode steps are:

  serial     the whole batch through the layers on one stream (today's decode step)
  split      the batch in two halves, each through the layers on its own stream: two independent
             chains the GPU interleaves (one half's attention beside the other's GEMMs); the
             weights are read twice
  split-lag  the same, the second half starting once the first has run its first attention (so
             the halves start out of phase: the first half's MLP GEMMs meet the second's
             attention)

A layer: RMSNorm, qkv projection, attention over the paged KV cache (FlashInfer's fa2 paged
prefill kernel at q_len 1, the kernel phloem's bf16 decode graphs replay; its own workspace per
stream), o projection and residual, RMSNorm, gate_up, SiLU-and-mul, down and residual (RoPE and
the KV write are left out: < 3% of the step). The halves' outputs are checked against the serial
run's (bf16: max |diff| <= --atol).

    python benchmarks/nanobatch_overlap.py --batch 256 512 --context 1000 2000 --json OUT.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from phloem.bench.graph_timing import graph_replay_seconds

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER = 4096, 32, 8, 128, 14336
PAGE = 16


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=[256, 512])
    p.add_argument("--context", type=int, nargs="+", default=[1000, 2000])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--atol", type=float, default=0.1)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def make_layers(n: int, device) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator(device=device).manual_seed(0)

    def w(*shape):
        scale = shape[-1] ** -0.5
        return torch.randn(*shape, generator=g, device=device, dtype=torch.bfloat16) * scale

    qkv = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    return [dict(qkv=w(qkv, HIDDEN), o=w(HIDDEN, HEADS * HEAD_DIM), gate_up=w(2 * INTER, HIDDEN),
                 down=w(HIDDEN, INTER)) for _ in range(n)]  # fmt: skip


class Half:
    """One chain of sequences: its own attention wrapper (planned into fixed buffers, its own
    workspace), its page table into the shared KV cache, input and output buffers."""

    def __init__(self, flashinfer, kv, indices, x, context: int) -> None:
        batch, pages, device = x.shape[0], -(-context // PAGE), x.device
        i32 = dict(dtype=torch.int32, device=device)
        self.kv, self.x = kv, x
        self.workspace = torch.zeros(512 << 20, dtype=torch.uint8, device=device)
        self.wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace, "NHD", use_cuda_graph=True,
            qo_indptr_buf=torch.arange(batch + 1, **i32),
            paged_kv_indptr_buf=torch.empty(batch + 1, **i32),
            paged_kv_indices_buf=torch.empty(indices.numel(), **i32),
            paged_kv_last_page_len_buf=torch.empty(batch, **i32), backend="fa2",
        )  # fmt: skip
        self.wrapper.plan(torch.arange(batch + 1, dtype=torch.int32),
                          torch.arange(0, batch * pages + 1, pages, dtype=torch.int32), indices,
                          torch.full((batch,), context - (pages - 1) * PAGE, dtype=torch.int32),
                          HEADS, KV_HEADS, HEAD_DIM, PAGE, causal=True, sm_scale=HEAD_DIM**-0.5,
                          q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)  # fmt: skip
        self.out = torch.empty_like(x)
        self.attn = torch.empty(batch, HEADS, HEAD_DIM, device=device, dtype=torch.bfloat16)

    def attention(self, h: torch.Tensor, w: dict[str, torch.Tensor]) -> None:
        """RMSNorm, qkv projection and attention into `self.attn`."""
        qkv = F.linear(rms_norm(h), w["qkv"])
        q = qkv[:, : HEADS * HEAD_DIM].view(-1, HEADS, HEAD_DIM)
        self.wrapper.run(q, self.kv, out=self.attn)

    def rest(self, h: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
        """o projection and residual, RMSNorm, the MLP and residual."""
        h = h + F.linear(self.attn.view(-1, HEADS * HEAD_DIM), w["o"])
        gate, up = F.linear(rms_norm(h), w["gate_up"]).chunk(2, dim=-1)
        return h + F.linear(F.silu(gate) * up, w["down"])

    def forward(self, layers, after_first_attention=None) -> None:
        h = self.x
        for i, w in enumerate(layers):
            self.attention(h, w)
            if i == 0 and after_first_attention is not None:
                after_first_attention()
            h = self.rest(h, w)
        self.out.copy_(h)


def rms_norm(x: torch.Tensor) -> torch.Tensor:
    return F.rms_norm(x, (x.shape[-1],), eps=1e-5)


def run_case(flashinfer, args, batch: int, context: int, layers, device) -> dict:
    pages = -(-context // PAGE)
    g = torch.Generator(device=device).manual_seed(batch + context)
    kv = torch.randn(batch * pages, 2, PAGE, KV_HEADS, HEAD_DIM, generator=g, device=device,
                     dtype=torch.bfloat16)  # fmt: skip
    indices = torch.randperm(batch * pages, dtype=torch.int32)  # fragmented pages
    x = torch.randn(batch, HIDDEN, generator=g, device=device, dtype=torch.bfloat16)
    whole = Half(flashinfer, kv, indices, x, context)
    n = batch // 2
    halves = [Half(flashinfer, kv, indices[k * n * pages : (k + 1) * n * pages],
                   x[k * n : (k + 1) * n].clone(), context) for k in range(2)]  # fmt: skip
    side = torch.cuda.Stream()

    def serial():
        whole.forward(layers)

    def split(lag: bool):
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        started = torch.cuda.Event()

        def second_half():
            with torch.cuda.stream(side):
                side.wait_event(started)
                halves[1].forward(layers)

        if lag:  # the second half starts once the first has done its first attention
            halves[0].forward(layers, lambda: (started.record(), second_half()))
        else:
            started.record()
            second_half()
            halves[0].forward(layers)
        main.wait_stream(side)

    result = {"batch": batch, "context": context, "layers": len(layers)}
    for name, fn in (("serial", serial), ("split", lambda: split(False)),
                     ("split-lag", lambda: split(True))):  # fmt: skip
        seconds = graph_replay_seconds(fn, args.iters) / len(layers)
        result[f"{name}_us_per_layer"] = seconds * 1e6
        if name != "serial":
            fn()  # once more, eagerly, then compare with the serial run's
            torch.cuda.synchronize()
            diff = (torch.cat([h.out for h in halves]).float() - whole.out.float()).abs().max()
            result[f"{name}_max_abs_diff"] = diff.item()
    base = result["serial_us_per_layer"]
    for name in ("split", "split-lag"):
        result[f"{name}_speedup"] = base / result[f"{name}_us_per_layer"]
    print(f"B={batch:4d} L={context:5d}: serial {base:7.1f} us/layer; split "
          f"{result['split_us_per_layer']:7.1f} ({result['split_speedup']:.3f}x, diff "
          f"{result['split_max_abs_diff']:.3f}); split-lag {result['split-lag_us_per_layer']:7.1f} "
          f"({result['split-lag_speedup']:.3f}x)", flush=True)  # fmt: skip
    ok = all(result[f"{n}_max_abs_diff"] <= args.atol for n in ("split", "split-lag"))
    result["ok"] = ok
    return result


def main(argv=None) -> None:
    args = parse_args(argv)
    import flashinfer

    device = torch.device("cuda")
    layers = make_layers(args.layers, device)
    out = {"device": torch.cuda.get_device_name(device), "cases": []}
    for context in args.context:
        for batch in args.batch:
            out["cases"].append(run_case(flashinfer, args, batch, context, layers, device))
            torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
