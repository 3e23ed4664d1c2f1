"""A submitted job's tasks as Ray's state API lists them: every task name, and the FAILED ones.

Read in a process of its own: the state API's client reads RAY_AUTH_MODE once per process."""

from __future__ import annotations

import json
import subprocess
import sys

_LIST_TASKS = """
import json, sys
from ray.job_submission import JobSubmissionClient
from ray.util.state import list_tasks
address, submission = sys.argv[1:]
job = JobSubmissionClient(address).get_job_info(submission).job_id
tasks = list_tasks(address=address, filters=[("job_id", "=", job)], limit=10000, raise_on_missing_output=False)
failed = list_tasks(
    address=address, filters=[("job_id", "=", job), ("state", "=", "FAILED")], raise_on_missing_output=False
)
print(json.dumps({
    "names": sorted({t.name for t in tasks}),
    "failed": [[t.name, t.error_type, t.error_message] for t in failed],
}))
"""


def job_tasks(*, dashboard_url: str, submission_id: str, env: dict[str, str]) -> dict[str, list]:
    """`{"names": [...], "failed": [[name, error type, message], ...]}` of the job `submission_id`."""
    done = subprocess.run(
        [sys.executable, "-c", _LIST_TASKS, dashboard_url, submission_id],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])
