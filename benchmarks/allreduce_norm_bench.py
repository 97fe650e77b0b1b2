"""All-reduce + residual add + RMSNorm on 2+ GPUs, inside CUDA graphs: microseconds per call of
the three ways phloem can run a row-parallel layer's output into the next norm (issue 17).

    nccl       dist.all_reduce (NCCL, in place), then the engine's compiled add + RMSNorm
    symm_mem   PyTorch's one-shot symmetric-memory all-reduce, then the same norm
    symm_norm  phloem's one kernel: one-shot all-reduce + add + RMSNorm (symm_norm_all_reduce.py)

Each graph holds CALLS calls in a row, each after a copy of the partial sum (the all-reduce
input; NCCL sums in place), alternating buffer slots as the model does; a copy-only graph gives
the copies' share. Rows 1, 4, 16 (decode batches) x --hidden (4096: Llama-3.1-8B), bf16. Checks
that each way's outputs are within bf16 rounding of an fp32 reference and that symm_norm's are
the same bits on every rank. Launch (NVLink multicast off, as on the lent machines):

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        python3 -m torch.distributed.run --nproc-per-node 2 benchmarks/allreduce_norm_bench.py \\
        --json OUT.json

Rank 0 prints one line per (way, rows) and writes the JSON (us per call: the slower rank's).
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist

from phloem.distributed.symm_all_reduce import OneShotAllReduce
from phloem.distributed.symm_norm_all_reduce import SymmNormAllReduce
from phloem.layers.norm import RMSNorm

EPS = 1e-5


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--calls", type=int, default=32, help="calls captured in one graph")
    p.add_argument("--replays", type=int, default=200, help="timed replays of each graph")
    p.add_argument("--json", default="")
    return p.parse_args()


def timed_graph(step, replays: int) -> float:
    """Capture `step()` in a CUDA graph (after a warm-up run), replay it `replays` times
    between a group barrier and events; the slower rank's milliseconds per replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # warm-up: compiles, creates NCCL's graph resources
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    ms = torch.tensor([start.elapsed_time(end) / replays], device="cuda")
    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
    del graph
    return float(ms)


def ways(x, residual, norm, small, fused, calls: int):
    """{name: step()} where step runs `calls` calls of one way, returning the last outputs."""

    def copy_only():
        for _ in range(calls):
            y = x.clone()
        return y, residual

    def nccl():
        for _ in range(calls):
            y = x.clone()
            dist.all_reduce(y)
            out = norm(y, residual)
        return out

    def symm_mem():
        for _ in range(calls):
            out = norm(small(x.clone()), residual)
        return out

    def symm_norm():
        for i in range(calls):
            out = fused(x.clone(), residual, norm.weight, norm.eps, i % 2)
        return out

    return {"copy": copy_only, "nccl": nccl, "symm_mem": symm_mem, "symm_norm": symm_norm}


def check(name: str, out, reference, rank: int) -> dict:
    """Max abs error of (normed, residual) against the fp32 reference; for symm_norm also
    whether every rank got the same bits."""
    normed, new_residual = out
    ref_normed, ref_residual = reference
    result = {
        "max_err_normed": float((normed.float() - ref_normed).abs().max()),
        "max_err_residual": float((new_residual.float() - ref_residual).abs().max()),
    }
    # nccl and symm_mem round the sum to bf16 before the add: two roundings, hence the atol
    ok = torch.allclose(normed.float(), ref_normed, rtol=2**-6, atol=5e-2) and torch.allclose(
        new_residual.float(), ref_residual, rtol=2**-6, atol=5e-2
    )
    if name == "symm_norm":
        gathered = [torch.empty_like(normed) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, normed)
        result["same_on_every_rank"] = all(torch.equal(g, gathered[0]) for g in gathered)
        ok = ok and result["same_on_every_rank"]
    result["ok"] = bool(ok)
    return result


def main() -> None:
    args = parse_args()
    rank = int(os.environ["RANK"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    world = dist.get_world_size()
    group = dist.group.WORLD
    dtype, hidden, max_rows = torch.bfloat16, args.hidden, max(args.rows)
    norm = RMSNorm(hidden, EPS, dtype).to(device)
    norm.use_compiled(torch.compile(RMSNorm.compute, dynamic=True))  # the engine's norm
    small = OneShotAllReduce(group, device, max_rows * hidden * 2)
    fused = SymmNormAllReduce(group, device, hidden, max_rows, dtype)
    results = []
    for rows in args.rows:
        gen = torch.Generator(device=device).manual_seed(1000 + rows)
        parts = [torch.randn(rows, hidden, generator=gen, device=device).to(dtype)
                 for _ in range(world)]  # fmt: skip
        residual = torch.randn(rows, hidden, generator=gen, device=device).to(dtype)
        with torch.no_grad():
            norm.weight.normal_(generator=gen)
        total = sum(p.float() for p in parts) + residual.float()
        ref = (total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + EPS)
               * norm.weight.float(), total)  # fmt: skip
        x = parts[rank].clone()
        for name, step in ways(x, residual, norm, small, fused, args.calls).items():
            ms = timed_graph(step, args.replays)
            row = {"way": name, "rows": rows, "hidden": hidden, "world": world,
                   "us_per_call": 1000 * ms / args.calls}  # fmt: skip
            if name != "copy":
                row.update(check(name, step(), ref, rank))
            results.append(row)
            if rank == 0:
                print(json.dumps(row), flush=True)
    copy = {r["rows"]: r["us_per_call"] for r in results if r["way"] == "copy"}
    for r in results:
        r["us_minus_copy"] = r["us_per_call"] - copy[r["rows"]]
    if rank == 0:
        for r in results:
            print(f"{r['way']:>9} rows {r['rows']:>2}: {r['us_per_call']:6.2f} us/call "
                  f"({r['us_minus_copy']:5.2f} without the copy) ok={r.get('ok', '-')}")  # fmt: skip
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"calls_per_graph": args.calls, "results": results}, f, indent=1)
    dist.barrier()
    fused.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
