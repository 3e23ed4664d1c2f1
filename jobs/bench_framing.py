"""Print what one message costs in the framing: host frames against frames built with torch ops,
on one thread (alone and beside a busy Python thread), between two processes over TCP, and the
CPU time of one message over TCP on one thread after a 2 ms sleep
(jobs/benchmarks/framing.py says what each figure includes).

    python jobs/bench_framing.py [--payload-elems 4096,262144] [--messages 2000] [--repeats 3]
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from benchmarks.framing import FRAMES, after_sleep, in_thread, ping_pong
from rrfp_ray.cli import count, counts
from rrfp_ray.job import run_job


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--payload-elems", type=counts, default=[4096, 262144], help="float32 payload sizes, comma-separated"
    )
    parser.add_argument("--messages", type=count, default=2000, help="timed messages per figure (busy: a tenth)")
    parser.add_argument("--repeats", type=count, default=3, help="runs per figure; it prints their median")
    args = parser.parse_args(argv)
    sizes = args.payload_elems
    torch.set_num_threads(1)
    print(
        f"us per message, median of {args.repeats} run(s): frame, send and read back (CPU after sleep: thread CPU time)"
    )
    print(
        f"{'payload':>10} {'frames':>10} {'one thread':>11} {'beside busy':>12} {'2 processes':>12} "
        f"{'CPU after sleep':>16}"
    )
    for size in sizes:
        for frames in FRAMES:
            busy_messages = max(1, args.messages // 10)
            alone = _median(
                args.repeats,
                lambda frames=frames, size=size: in_thread(
                    frames=frames, payload_elems=size, busy=False, messages=args.messages
                ),
            )
            busy = _median(
                args.repeats,
                lambda frames=frames, size=size, busy_messages=busy_messages: in_thread(
                    frames=frames, payload_elems=size, busy=True, messages=busy_messages
                ),
            )
            apart = _median(
                args.repeats,
                lambda frames=frames, size=size: ping_pong(frames=frames, payload_elems=size, messages=args.messages),
            )
            cold = _median(
                args.repeats,
                lambda frames=frames, size=size, busy_messages=busy_messages: after_sleep(
                    frames=frames, payload_elems=size, messages=busy_messages
                ),
            )
            print(f"{size * 4 // 1024:>7} KB {frames:>10} {alone:>11.1f} {busy:>12.1f} {apart:>12.1f} {cold:>16.1f}")


def _median(repeats: int, measure: Callable[[], float]) -> float:
    return sorted(measure() for _ in range(repeats))[repeats // 2]


if __name__ == "__main__":
    run_job(main)
