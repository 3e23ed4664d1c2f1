"""What a busy thread beside a stage's compute costs it: the interpreter's lock against a core, per switch interval.

    python jobs/bench_vlm_gil.py --rounds 3 --reps 20

One thread runs the VLM's encoder (stage 0 at P=2: the patch embedding and its blocks) forward and backward on a
microbatch of `--images` images, `--reps` times, with `torch.set_num_threads(1)`; nothing else in the process, or
beside it a thread that runs pure Python (the simulator's kind of work: it holds the interpreter's lock until the
switch interval forces it off), or beside it a thread that runs large matrix products (it holds a core, and the lock
only between them). Each at the switch intervals `--intervals-ms` (`sys.setswitchinterval`; CPython's default 5 ms),
the cases interleaved over `--rounds` rounds. Prints per interval and case the median wall ms of one forward and
backward and its ratio over the lone thread at that interval, and the busy thread's progress (its loops a second).
On two free cores the two threads beside never share a core with the compute: what the Python thread costs beyond
the matrix products' is the lock's.
"""

from __future__ import annotations

import argparse
import enum
import statistics
import threading
import time

from rrfp_ray.cli import count
from rrfp_ray.job import run_job
from rrfp_ray.runtime.interval import switch_interval


class Beside(enum.Enum):
    NOTHING = "nothing"
    PYTHON = "pure Python"
    COMPUTE = "matrix products"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=count, default=4, help="images in the microbatch (default 4)")
    parser.add_argument("--image-size", type=count, default=48, help="pixels a side of an image (default 48)")
    parser.add_argument("--reps", type=count, default=20, help="forward and backward passes a case (default 20)")
    parser.add_argument("--rounds", type=count, default=3, help="rounds over the cases, interleaved (default 3)")
    parser.add_argument(
        "--intervals-ms", type=float, nargs="+", default=[5.0, 1.0, 0.2], help="switch intervals (default 5 1 0.2)"
    )
    args = parser.parse_args(argv)
    if any(not ms > 0 for ms in args.intervals_ms):
        parser.error(f"argument --intervals-ms: every interval must be > 0, got {args.intervals_ms}")

    import torch
    from pydantic import ValidationError

    from rrfp_ray.models.vlm import EncoderBlock, PatchEmbed, VLMConfig

    try:
        config = VLMConfig(image_size=args.image_size)
    except ValidationError as error:
        parser.error("; ".join(e["msg"] for e in error.errors()))
    torch.set_num_threads(1)
    torch.manual_seed(0)
    encoder = torch.nn.Sequential(PatchEmbed(config), *(EncoderBlock(config) for _ in range(config.encoder_layers)))
    inputs = (
        torch.randn(args.images, config.channels, config.image_size, config.image_size),
        torch.tensor([args.images]),
        torch.zeros(1, 1, dtype=torch.long),
    )

    def passes(reps: int) -> float:
        started = time.perf_counter()
        for _ in range(reps):
            encoder(inputs)[0].sum().backward()
        return time.perf_counter() - started

    passes(3)
    ms: dict[tuple[float, Beside], list[float]] = {}
    loops: dict[tuple[float, Beside], list[float]] = {}
    for _ in range(args.rounds):
        for interval in args.intervals_ms:
            with switch_interval(interval / 1e3):
                for beside in Beside:
                    wall, rate = _case(beside=beside, passes=lambda: passes(args.reps), torch=torch)
                    ms.setdefault((interval, beside), []).append(1e3 * wall / args.reps)
                    loops.setdefault((interval, beside), []).append(rate)
    print(f"the VLM's encoder forward and backward on {args.images} images of {config.image_size} px, one thread")
    result = {}
    for interval in args.intervals_ms:
        alone = statistics.median(ms[interval, Beside.NOTHING])
        for beside in Beside:
            median = statistics.median(ms[interval, beside])
            rate = statistics.median(loops[interval, beside])
            progress = "" if beside is Beside.NOTHING else f", the thread beside {rate:.0f} loops/s"
            print(
                f"switch interval {interval:g} ms, beside {beside.value}: {median:.1f} ms a pass, "
                f"{median / alone:.2f}x the lone thread's{progress}"
            )
            result[f"{interval:g} ms, {beside.value}"] = median / alone
    return result


def _case(*, beside: Beside, passes, torch) -> tuple[float, float]:
    """The wall seconds of `passes()` with `beside` running on a thread of its own, and that thread's loops a second."""
    stop = threading.Event()
    done: list[int] = []

    def python() -> None:
        table: dict[int, int] = {}
        n = 0
        while not stop.is_set():
            for i in range(1000):
                table[i % 97] = table.get(i % 37, 0) + i
            n += 1
        done.append(n)

    def compute() -> None:
        a = torch.randn(512, 512)
        n = 0
        while not stop.is_set():
            a = torch.mm(a, a).tanh_()
            n += 1
        done.append(n)

    worker = {Beside.PYTHON: python, Beside.COMPUTE: compute}.get(beside)
    thread = None if worker is None else threading.Thread(target=worker, name=f"beside {beside.value}")
    if thread is not None:
        thread.start()
    try:
        wall = passes()
    finally:
        stop.set()
        if thread is not None:
            thread.join(timeout=60)
            if thread.is_alive():
                raise TimeoutError(f"the thread running {beside.value} did not stop within 60 s")
    return wall, (done[0] / wall if done else 0.0)


if __name__ == "__main__":
    run_job(main)
