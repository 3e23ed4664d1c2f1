"""Render docs/RESULTS.md and its plots from the suite's JSON, in seconds, measuring nothing.

    python jobs/results.py [--json docs/results/suite.json] [--out docs/RESULTS.md] [--plots docs/results]

The JSON is what `python jobs/bench_suite.py` writes. Every paper claim gets one row: what
rrfp-ray measures for it, where (scenario, command), the result, and whether it reproduces.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from benchmarks.render import render
from benchmarks.report import DEFAULTS, SUITE, Suite
from rrfp_ray.installed import missing_extra
from rrfp_ray.job import run_job


def main(argv: Sequence[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--json", default=str(DEFAULTS["json"]), help="the suite's JSON (default docs/results/suite.json)"
    )
    parser.add_argument("--out", default=str(DEFAULTS["out"]), help="the Markdown to write (default docs/RESULTS.md)")
    parser.add_argument("--plots", default=str(DEFAULTS["plots"]), help="folder for the PNGs (default docs/results)")
    args = parser.parse_args(argv)
    source, out = Path(args.json), Path(args.out)
    if not source.is_file():
        parser.error(f"argument --json: no file {source}; run `{SUITE}` first")
    if not out.resolve().parent.is_dir():
        parser.error(f"argument --out: no directory {out.resolve().parent}")
    try:
        suite = Suite(json.loads(source.read_text()))
    except (ValueError, KeyError) as error:
        parser.error(f"argument --json: {source} is not the suite's JSON ({error})")
    missing = missing_extra("matplotlib", extra="plots")
    if missing:
        print(f"plots skipped: {missing}")
        made = {}
    else:
        from benchmarks.plots import plots

        made = plots(suite, directory=Path(args.plots))
    out.write_text(
        render(suite, source=source.resolve(), out=out.resolve(), plots={k: v.resolve() for k, v in made.items()})
    )
    print(f"wrote {out} and {len(made)} plot(s) under {args.plots}")
    return out


if __name__ == "__main__":
    run_job(main)
