"""The job as a user sees it: a Ray head of its own (dashboard, token auth) in a subprocess,
`ray job submit` of jobs/train_gpt.py (validation on and off), then what the dashboard
shows: the job SUCCEEDED with no FAILED task, its Task Timeline holds one span per
executed op, and, in a real browser, the named actors and the job's state.

One head serves every test here; it is stopped by the pids it started, never `ray stop`.
Slow tier (`make test-slow`, which CI runs after `make test`).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
from ray_tasks import job_tasks

pytestmark = pytest.mark.slow  # a head of its own: `make test-slow`

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the venv's: the head's `python` is the project's
TINY = (
    "--iterations 3 --stages 2 --microbatches 4 --micro-batch-size 2 --seq-len 16 --n-layer 2 --n-embd 32 "
    "--n-head 2 --block-size 16 --no-compare --policy bf --t-f 1 --log-level info"
)
JOB_S = 300.0
AGENT_S = 120.0


@dataclass(frozen=True)
class Head:
    url: str
    token: str
    env: dict[str, str]

    def get(self, path: str) -> dict:
        request = urllib.request.Request(self.url + path, headers={"authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(request, timeout=30) as response:
            return json.loads(response.read())

    def ray(self, *args: str, timeout: float = 120) -> str:
        """The `ray` CLI against this head. A submission the head refuses because its job agent is
        not up yet (a loaded machine starts it after the dashboard answers) is tried again, for up
        to `AGENT_S`."""
        deadline = time.monotonic() + AGENT_S
        while True:
            done = subprocess.run(
                [str(BIN / "ray"), *args], env=self.env, capture_output=True, text=True, timeout=timeout, check=False
            )
            if "No available agent to submit job" not in done.stdout + done.stderr or time.monotonic() > deadline:
                break
            time.sleep(3)
        assert done.returncode == 0, f"ray {' '.join(args)}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
        return done.stdout


@dataclass(frozen=True)
class Job:
    submission_id: str
    job_id: str
    out: Path
    logs: str


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _descendants(pid: int) -> list[int]:
    """`pid`'s processes, children first, read from /proc (no psutil here)."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return list(reversed(found))


def _stop(process: subprocess.Popen) -> None:
    """End the head and every process it started, by pid: SIGTERM, then SIGKILL after 10 s."""
    pids = [*_descendants(process.pid), process.pid]
    for sig, grace_s in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while pids and time.monotonic() < deadline:
            process.poll()  # reap the head's own process
            time.sleep(0.5)
            pids = [pid for pid in pids if _alive(pid)]
        if not pids:
            return


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def head():
    temp = Path(tempfile.mkdtemp(prefix="rrfp-head-", dir="/tmp"))  # short: Ray's socket paths live under it
    gcs, dashboard, client, agent, agent_grpc, metrics, runtime_env = _free_ports(7)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env |= {"RAY_AUTH_MODE": "token", "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}", "PYTHONPATH": str(ROOT)}
    command = [
        str(BIN / "ray"), "start", "--head", "--block", "--num-cpus", "8", "--temp-dir", str(temp),
        "--port", str(gcs), "--dashboard-host", "127.0.0.1", "--dashboard-port", str(dashboard),
        "--ray-client-server-port", str(client), "--dashboard-agent-listen-port", str(agent),
        "--dashboard-agent-grpc-port", str(agent_grpc), "--metrics-export-port", str(metrics),
        "--runtime-env-agent-port", str(runtime_env),
    ]  # fmt: skip
    log = (temp / "head.log").open("w")
    process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        token = subprocess.run(
            [str(BIN / "ray"), "get-auth-token"], env=env, capture_output=True, text=True, timeout=60, check=True
        ).stdout.strip()
        head = Head(
            url=f"http://127.0.0.1:{dashboard}", token=token, env=env | {"RAY_ADDRESS": f"http://127.0.0.1:{dashboard}"}
        )
        deadline = time.monotonic() + 120
        while True:
            try:
                head.get("/api/jobs/")
                break
            except OSError as error:
                assert process.poll() is None, f"the head exited: {(temp / 'head.log').read_text()[-3000:]}"
                assert time.monotonic() < deadline, f"no dashboard at {head.url} within 120 s: {error}"
                time.sleep(1)
        yield head
    finally:
        _stop(process)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="module")
def jobs(head, tmp_path_factory) -> dict[str, Job]:
    """Two jobs at once (they share the head's 8 CPUs): validation every iteration (and TensorBoard scalars), and
    none."""
    outs = {name: tmp_path_factory.mktemp(f"job-{name}") for name in ("val", "noval")}  # outside the working dir
    flags = {"val": f"--val-every 1 --tensorboard {outs['val'] / 'tb'}", "noval": "--val-every 0"}
    ids = {}
    for name, out in outs.items():
        ids[name] = f"rrfp-test-{name}-{os.getpid()}-{int(time.time())}"
        head.ray(
            "job", "submit", "--no-wait", "--submission-id", ids[name], "--working-dir", str(ROOT), "--",
            "python", "jobs/train_gpt.py", *TINY.split(), *flags[name].split(), "--out", str(out),
        )  # fmt: skip
    deadline = time.monotonic() + JOB_S
    found = {}
    for name, submission in ids.items():
        while (info := head.get(f"/api/jobs/{submission}"))["status"] not in ("SUCCEEDED", "FAILED", "STOPPED"):
            assert time.monotonic() < deadline, f"job {submission} still {info['status']} after {JOB_S:g} s"
            time.sleep(2)
        logs = head.ray("job", "logs", submission)
        assert info["status"] == "SUCCEEDED", (
            f"job {submission}: {info['status']} {info.get('message')}\n{logs[-3000:]}"
        )
        found[name] = Job(submission_id=submission, job_id=info["job_id"], out=outs[name], logs=logs)
    return found


def test_a_submitted_job_succeeds_and_writes_where_it_says(jobs):
    for job in jobs.values():
        assert "2 stage actors up in" in job.logs
        assert "for placement: 2 x {CPU: 1}" in job.logs  # the driver's log lines reach the job's
        assert "bf: loss " in job.logs and "median iteration" in job.logs
        wrote = next(line for line in job.logs.splitlines() if line.startswith("wrote "))
        assert wrote.startswith(f"wrote {job.out}/"), wrote
        summary = json.loads((job.out / "summary.json").read_text())
        assert summary["iterations"] == 3
        assert (job.out / "trace-bf.json").is_file() and (job.out / "telemetry-bf.jsonl").is_file()
    assert jobs["val"].logs.count(" val ") == 3 and " val " not in jobs["noval"].logs


def test_the_job_writes_tensorboard_scalars(jobs):
    pytest.importorskip("tensorboard", reason="the optional extra tensorboard is not installed")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(jobs["val"].out / "tb" / "bf"))
    events.Reload()
    steps = {tag: [e.step for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}
    expected = ["loss/train", "loss/val", "time/iteration_ms", "time/tokens_per_s", "pipeline/bubble"]
    assert {tag: steps.get(tag) for tag in expected} == {tag: [0, 1, 2] for tag in expected}
    assert steps["pipeline/blocked_stage_0"] == steps["pipeline/blocked_stage_1"] == [0, 1, 2]


def test_a_successful_job_leaves_no_failed_task(head, jobs):
    for job in jobs.values():
        tasks = job_tasks(dashboard_url=head.url, submission_id=job.submission_id, env=head.env)
        # the filter did find the job's tasks (Ray names an actor's tasks after its repr)
        assert any(n.startswith("StageActor(stage 1") and n.endswith(".run_iteration") for n in tasks["names"])
        assert tasks["failed"] == []


def test_the_task_timeline_holds_one_span_per_executed_op(head, jobs):
    job = jobs["noval"]
    timeline = head.get(f"/api/v0/tasks/timeline?job_id={job.job_id}&download=1")
    spans = sorted(
        (int(e["cat"].split(":")[0].removeprefix("stage ")), int(e["args"]["iteration"]), e["name"])
        for e in timeline
        if str(e.get("cat", "")).startswith("stage ") and e.get("ph") == "X"
    )
    reports = [json.loads(line) for line in (job.out / "telemetry-bf.jsonl").read_text().splitlines()]
    executed = sorted((e["stage"], r["iteration"], e["action"]) for r in reports for e in r["events"])
    assert spans == executed
    ours = json.loads((job.out / "trace-bf.json").read_text())
    ours = ours["traceEvents"] if isinstance(ours, dict) else ours
    assert {name for _, _, name in spans} <= {e["name"] for e in ours}  # named as in our Perfetto trace


@pytest.mark.browser
def test_the_dashboard_in_a_browser_shows_the_named_actors_and_the_job(head, jobs):
    if shutil.which("chromium") is None or shutil.which("chromedriver") is None:
        pytest.skip("needs Debian's chromium and chromium-driver (apt-get install -y chromium chromium-driver)")
    pytest.importorskip("selenium", reason="needs selenium (pip install selenium)")
    job = jobs["val"]
    shots = job.out / "dashboard"  # beside the run's other outputs
    done = subprocess.run(
        [
            sys.executable,
            "jobs/dashboard_shots.py",
            "--address",
            head.url,
            "--job",
            job.submission_id,
            "--out",
            str(shots),
        ],
        cwd=ROOT,
        env=head.env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"job {job.submission_id}: SUCCEEDED" in done.stdout
    assert "actors: rrfp-driver-" in done.stdout and "rrfp-stage-0-" in done.stdout and "rrfp-stage-1-" in done.stdout
    assert "login dialog gone" in done.stdout  # the pictures were taken after it: no token in them
    for name in ("job.png", "actors.png"):
        assert (shots / name).stat().st_size > 10_000


def test_a_submitted_job_and_its_workers_import_the_uploaded_copy(head):
    """Not the installed (editable) checkout: the working dir Ray unpacked comes first on the path."""
    submission = f"rrfp-test-copy-{os.getpid()}-{int(time.time())}"
    head.ray("job", "submit", "--submission-id", submission, "--working-dir", str(ROOT), "--",
             "python", "tests/data/which_copy.py")  # fmt: skip
    logs = head.ray("job", "logs", submission)
    copies = [line.split(" imports ")[1] for line in logs.splitlines() if " imports " in line]
    assert len(copies) == 2, logs[-2000:]
    for path in copies:
        assert not path.startswith(str(ROOT)), f"{path} is the checkout, not the uploaded working dir"
        assert "runtime_resources" in path, path
