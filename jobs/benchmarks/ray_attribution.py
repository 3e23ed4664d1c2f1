"""What readiness itself buys on Ray: `benchmarks.attribution`'s comparison (best readiness over the
best fixed schedule with the same backward split within the same memory) on the runtime part's
measured rows, beside the same comparison of their simulated makespans on the very same traces."""

from __future__ import annotations

import statistics

from benchmarks.attribution import CAPS, FAMILIES, Attribution, Target, attribute, over, targets
from benchmarks.report import Suite, missing, table, x
from benchmarks.rows import Cell, RuntimeRow


class RayRows:
    """The runtime rows shaped as `attribute` reads a suite: one `Cell` per (scenario, P, run), its
    makespan the mean over the seeds of the measured (or, not `measured`, simulated) makespans, the
    per-seed values in seed order, its memory the most any seed measured."""

    def __init__(self, suite: Suite, *, measured: bool) -> None:
        groups: dict[tuple[str, int, str], list[RuntimeRow]] = {}
        for row in suite.runtime:
            groups.setdefault((row.scenario, row.stages, row.run), []).append(row)

        def ms(row: RuntimeRow) -> float:
            return row.measured_ms if measured else row.sim_ms

        self._rows = {
            cell: Cell(
                run=cell[2],
                makespan_ms=statistics.mean(ms(r) for r in rows),
                makespans=tuple(ms(r) for r in sorted(rows, key=lambda r: r.seed)),
                memory_x=max(r.memory_x for r in rows),
            )
            for cell, rows in groups.items()
        }
        measured_at = {scenario for scenario, _, _ in self._rows}
        self.scenarios = [s for s in suite.scenarios if s in measured_at]
        self.stages = sorted({p for _, p, _ in self._rows})

    def cell(self, *, scenario: str, stages: int, run: str) -> Cell | None:
        return self._rows.get((scenario, stages, run))


def ray_attribution_section(suite: Suite) -> list[str]:
    lines = ["## What readiness itself buys on Ray (measured, M = 4P)", ""]
    if not suite.runtime:
        return lines + [missing("runtime") + "."]
    rows = RayRows(suite, measured=True)
    cells = ray_cells(suite)
    measured = {_key(c): c for c in cells["measured"]}
    simulated = {_key(c): c for c in cells["simulated"]}
    families = [f.label for f in FAMILIES if any(key[0] == f.label for key in measured)]
    lines += [
        "The comparison of the section above on the Ray runtime part's rows: per family and cap the best "
        "readiness run over the best fixed schedule within the same memory (measured peaks), each side's "
        "mean over the seeds; *sim* the same comparison of the simulated makespans of the very same traces; "
        "*seeds* the range of the measured per-seed ratio. The runtime part runs the v=1 families and, on "
        "the V placement, zbv against ready-zbv; a dash is a cell measured before it ran the V pair.",
        "",
    ]
    header = ["scenario", "P"] + [f"{family}, cap {cap}" for family in families for cap in CAPS]
    body = []
    for scenario in rows.scenarios:
        for p in rows.stages:
            row: list[object] = [scenario, p]
            for family in families:
                for cap in CAPS:
                    c, s = measured.get((family, cap, scenario, p)), simulated.get((family, cap, scenario, p))
                    row.append("-" if c is None else _text(c, s))
            if any(cell != "-" for cell in row[2:]):  # no row for a (scenario, P) the part did not measure
                body.append(row)
    lines += [*table(header, body), "", "### Targets on Ray (cap 1x: equal memory, equal split)", ""]
    lines += [
        "The suite's three targets on the measured cells (P="
        + "/".join(map(str, rows.stages))
        + "), beside the same targets on the simulated makespans of the very same traces: where both miss, "
        "the policy misses it on these traces and the runtime is not what loses it; where only the measurement "
        "misses, the runtime lost it.",
        "",
    ]
    body = [[family, mine.text, _verdict(mine), _verdict(sim)] for family, mine, sim in ray_targets(**cells)]
    return lines + table(("family", "target", "measured", "simulated, same traces"), body)


def ray_cells(suite: Suite) -> dict[str, list[Attribution]]:
    """The runtime part's cells, measured and simulated: `ray_targets`' arguments."""
    if not suite.runtime:
        return {"measured": [], "simulated": []}
    return {
        "measured": attribute(RayRows(suite, measured=True)),
        "simulated": attribute(RayRows(suite, measured=False)),
    }


def ray_targets(*, measured: list[Attribution], simulated: list[Attribution]) -> list[tuple[str, Target, Target]]:
    """Per family at cap 1x: each target on the measured runtime cells and on their simulation."""
    out = []
    for family in FAMILIES:
        sims = {t.text: t for t in targets(simulated, family=family.label)}
        out += [(family.label, t, sims[t.text]) for t in targets(measured, family=family.label)]
    return out


def ray_target_lines(suite: Suite) -> list[str]:
    """What the suite prints after its runtime part."""
    return [
        f"target on Ray {family}, cap 1x, {mine.text}: measured {_verdict(mine, no='NOT met')}; "
        f"simulated {_verdict(sim, no='NOT met')}"
        for family, mine, sim in ray_targets(**ray_cells(suite))
    ]


def _verdict(target: Target, *, no: str = "**no**") -> str:
    return "met" if target.met else f"{no}: " + "; ".join(target.misses)


def _key(c: Attribution) -> tuple[str, str, str, int]:
    return c.family, c.cap, c.scenario, c.stages


def _text(c: Attribution, s: Attribution | None) -> str:
    sim = "" if s is None else f"sim {x(s.speedup)}; "
    return (
        f"**{x(c.speedup)}** ({sim}seeds {c.low:.2f}-{c.high:.2f}) {c.ready.run} "
        f"({x(c.ready.memory_x)}{over(c)}) / {c.fixed.run}"
    )
