"""The constrained step's order on the engine loop, a grammar thread and a device stream, timed on
a CPU stand-in (issue 21): which segment is in series with the bitmask fill.

Two threads and a process stand in for the H200 run's (1,024 requests x 128 tokens under one
schema):

- the engine loop (`LLMEngine.step`, async scheduling, a held constrained step), host work as
  Python holding the GIL: schedule(N+2) and prepare(N+2); `sample_held`: wait for the fill of
  N+1, then enqueue its sampling (`--sample-enqueue-ms`); `launch(N+2)` (`--launch-ms`, the
  forward enqueued after `--launch-before-forward-ms` of it); `collect(N+1)`: wait for N+1's
  tokens, then `--collect-ms` of Python; `collected`; `--update-ms` (update and outputs);
  presample (enqueue the noise of N+2, `--presample-ms`);
- the grammar thread: `--advance-ms` + `--fill-ms` with the GIL released (the library's
  threads), then the fill is done;
- the device: one stream in a process of its own (a queue worked through in order, sleeping
  through each item; no GIL shared with the loop): the
  forward (`--forward-ms`), the noise (`--noise-ms`) and the sampling (`--sample-ms`), the
  tokens ready at its end.

Orders (`--order`):

- `collect`: the tree's: the fill of N+2 starts in `collected`, after `collect(N+1)`, which
  the loop reaches after enqueueing N+1's sampling and launching N+2;
- `event`: the grammar thread waits for N+1's tokens itself (a semaphore: one C call with the
  GIL released, as `torch.cuda.Event.synchronize`) as soon as the sampling is enqueued, then needs `--token-read-ms` of Python (the GIL) before the
  advance: the fill starts when the tokens exist, whatever the loop is doing.

Reports ms per step (mean over the steps after `--warm-up`): the period, the loop's waits for
the fill and for the tokens, the device's idle time, and the gap from the sampling's enqueue to
the tokens. Fit the device split (`--forward-ms`, `--sample-ms`) to a measured run's period and
collect wait, then read what the other order would give.

    python benchmarks/structured_serial_sim.py --forward-ms 21 --sample-ms 17 \
        --order collect,event --rounds 2 --out DIR/sim.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from structured_fill_wait import python_work  # noqa: E402  (`ms` of Python holding the GIL)


class Device:
    """One stream in a process of its own (no GIL shared with the loop, as a GPU): items
    (ms, index into `tokens` or -1) run in the order enqueued, sleeping through each; an
    item's pair of semaphores (the loop's, the grammar thread's) is released when it ends: one
    C call to wait on, as `torch.cuda.Event.synchronize` (a `threading.Event` or a
    multiprocessing one runs Python after the wake-up, each step of it a wait for the GIL).
    `close` returns the stream's busy seconds."""

    def __init__(self, tokens: list) -> None:
        ctx = multiprocessing.get_context("fork")
        self.items, self.busy = ctx.SimpleQueue(), ctx.SimpleQueue()
        self.process = ctx.Process(target=self._run, args=(tokens,), daemon=True)
        self.process.start()

    def enqueue(self, ms: float, done: int = -1) -> None:
        self.items.put((ms, done))

    def _run(self, tokens: list) -> None:
        busy = 0.0
        while True:
            item = self.items.get()
            if item is None:
                self.busy.put(busy)
                return
            ms, done = item
            start = time.perf_counter()
            time.sleep(ms / 1e3)
            busy += time.perf_counter() - start
            if done >= 0:
                for semaphore in tokens[done]:
                    semaphore.release()

    def close(self) -> float:
        self.items.put(None)
        busy = self.busy.get()
        self.process.join()
        return busy


def _fill_job(args, tokens, done: threading.Event) -> threading.Thread:
    """The grammar thread's job for one step: (with `tokens`: wait for it, then read the tokens
    holding the GIL) the advance and the fill, GIL released; `done` set at the end."""

    def job() -> None:
        if tokens is not None:
            tokens.acquire()
            python_work(args.token_read_ms)
        time.sleep((args.advance_ms + args.fill_ms) / 1e3)
        done.set()

    thread = threading.Thread(target=job, daemon=True)
    thread.start()
    return thread


def simulate(args, order: str) -> dict:
    """The loop over `args.steps` constrained steps in `order`; ms per step after warm-up."""
    ctx = multiprocessing.get_context("fork")
    # each step's tokens: (the loop's semaphore, the grammar thread's), released by the device
    tokens = [(ctx.Semaphore(0), ctx.Semaphore(0)) for _ in range(args.steps + 2)]
    fills = [threading.Event() for _ in range(args.steps + 2)]
    device = Device(tokens)
    fills[0].set()  # step 0's bitmask: the start state's, filled before the loop
    device.enqueue(args.forward_ms)  # step 0 launched; its noise drawn
    device.enqueue(args.noise_ms)
    rows, last = [], time.perf_counter()
    for n in range(args.steps):  # this iteration: sample n, launch n+1, collect n
        python_work(args.schedule_ms + args.prepare_ms)
        waited = time.perf_counter()
        fills[n].wait()
        fill_wait = time.perf_counter() - waited
        python_work(args.sample_enqueue_ms)
        device.enqueue(args.sample_ms, n)
        enqueued = time.perf_counter()
        if order == "event":
            _fill_job(args, tokens[n][1], fills[n + 1])
        before = min(args.launch_ms, args.launch_before_forward_ms)
        python_work(before)
        device.enqueue(args.forward_ms)
        python_work(args.launch_ms - before)
        waited = time.perf_counter()
        tokens[n][0].acquire()
        token_wait = time.perf_counter() - waited
        tokens_at = time.perf_counter()
        python_work(args.collect_ms)
        if order == "collect":
            _fill_job(args, None, fills[n + 1])
        python_work(args.update_ms)
        device.enqueue(args.noise_ms)
        python_work(args.presample_ms)
        now = time.perf_counter()
        rows.append((now - last, fill_wait, token_wait, tokens_at - enqueued, now))
        last = now
    fills[args.steps].wait()
    busy_s = device.close()
    kept = rows[args.warm_up :]
    ms = [[1e3 * v for v in r[:4]] for r in kept]
    num = len(ms)
    # the device's idle share: its busy time over the whole run against the loop's
    busy_ms = 1e3 * busy_s / (args.steps + 1)
    mean = [sum(col) / num for col in zip(*ms)]
    names = ("period", "fill_wait", "token_wait", "enqueue_to_tokens_seen")
    return (
        {"order": order, "steps": num}
        | {f"{k}_ms": round(v, 2) for k, v in zip(names, mean)}
        | {"device_idle_ms": round(mean[0] - busy_ms, 2)}
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--order", default="collect,event", help="comma-separated: collect, event")
    add("--steps", type=int, default=40)
    add("--warm-up", type=int, default=5, help="steps left out of the means")
    add("--rounds", type=int, default=1)
    # host, ms (defaults: the H200 run's so-1024-seeded-noise.json means, rounded)
    add("--schedule-ms", type=float, default=2.5)
    add("--prepare-ms", type=float, default=1.0, help="part of the JSON's launch_ms")
    add("--sample-enqueue-ms", type=float, default=4.0)
    add("--launch-ms", type=float, default=11.8, help="launch_ms less prepare")
    add(
        "--launch-before-forward-ms",
        type=float,
        default=11.8,
        help="the launch's host work before the forward's first kernel is enqueued",
    )
    add("--collect-ms", type=float, default=1.0, help="collect's Python after the tokens")
    add("--update-ms", type=float, default=6.6)
    add("--presample-ms", type=float, default=1.0)
    add("--token-read-ms", type=float, default=0.3, help="event order: the thread's Python")
    add("--advance-ms", type=float, default=2.7, help="the thread's advance (and start)")
    add("--fill-ms", type=float, default=25.6)
    # device, ms
    add("--forward-ms", type=float, default=21.0)
    add("--noise-ms", type=float, default=1.0)
    add("--sample-ms", type=float, default=17.0)
    add("--out", default=None)
    args = parser.parse_args()
    runs = []
    for round_ in range(args.rounds):
        for order in args.order.split(","):
            run = simulate(args, order) | {"round": round_}
            print(json.dumps(run), flush=True)
            runs.append(run)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
