"""The documented blocks that start a Ray head and submit a job, run as written: from the
repository root, in an empty HOME, with PATH=/usr/bin:/bin and nothing else prepared.

A block is marked by the HTML comment `MARK` on the line before its fence. Each runs in
namespaces of its own (user, PID, mount and network, made with `unshare`): its `ray stop`
reaches only the processes of its own head, its default ports (6379, 8265) clash with no
other Ray on the machine, and its /tmp is a fresh directory; everything it started ends
with its namespace. `ray up` blocks need a cloud and are not marked.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARK = "<!-- test: head-and-submit -->"
BLOCK_S = 900


def marked_blocks() -> list[tuple[str, str]]:
    """(file, bash source) of every marked block in README.md and docs/."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in re.findall(re.escape(MARK) + r"\n```bash\n(.*?)```", path.read_text(), flags=re.DOTALL):
            found.append((str(path.relative_to(ROOT)), block))
    return found


def test_the_readme_marks_a_block_that_starts_a_head_and_submits_a_job():
    blocks = [block for where, block in marked_blocks() if where == "README.md"]
    assert blocks, f"no block after {MARK} in README.md"
    for block in blocks:
        assert "ray start --head" in block and "ray job submit" in block and "ray stop" in block, block


def _isolated(*, tmp: Path, script: str) -> list[str]:
    """A command running `script` (a path inside the namespace's /tmp, which is `tmp` outside)."""
    inner = (
        f"/usr/sbin/ip link set lo up && mount --bind {tmp} /tmp && cd {ROOT} && "
        f"exec env -i HOME=/tmp/home PATH=/usr/bin:/bin /bin/bash -e {script}"
    )
    namespaces = ["--user", "--map-root-user", "--pid", "--fork", "--mount", "--mount-proc", "--net"]
    return ["unshare", *namespaces, "/bin/bash", "-c", inner]


BLOCKS = marked_blocks()


@pytest.mark.slow  # a Ray head of its own
@pytest.mark.parametrize("where, block", BLOCKS, ids=[f"{where}-{i}" for i, (where, _) in enumerate(BLOCKS)])
def test_a_marked_block_runs_as_written_in_an_empty_home(where: str, block: str, tmp_path: Path):
    if shutil.which("unshare") is None or not Path("/usr/sbin/ip").is_file():
        pytest.skip("needs util-linux's unshare and iproute2's ip to give the block a head of its own")
    probe = subprocess.run(
        _isolated(tmp=tmp_path, script="/dev/null"), check=False, capture_output=True, text=True, timeout=60
    )
    if probe.returncode != 0:
        pytest.skip(f"this machine refuses the namespaces the block runs in: {probe.stderr.strip()[-300:]}")
    assert (ROOT / ".venv" / "bin" / "activate").is_file(), "the block activates .venv: build it first (`make test`)"
    home = tmp_path / "home"
    home.mkdir()
    (tmp_path / "block.sh").write_text(block)
    done = subprocess.run(
        _isolated(tmp=tmp_path, script="/tmp/block.sh"), check=False, capture_output=True, text=True, timeout=BLOCK_S
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{where}: the block exited {done.returncode}:\n{output[-4000:]}"
    assert re.search(r"Job '\S+' succeeded", output), output[-4000:]
    assert "Stopped all" in output, output[-2000:]  # its own `ray stop` ended its head
    summaries = list(home.glob("rrfp-runs/*/summary.json"))
    assert len(summaries) == 1, f"the job's outputs under the empty HOME: {sorted(home.rglob('*'))[:20]}"
