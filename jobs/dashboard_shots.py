"""Screenshots of a job in the Ray dashboard, taken by headless Chromium: the job's page and
the Actors page, after logging in with the cluster's token.

    python jobs/dashboard_shots.py --address http://127.0.0.1:8265 --job raysubmit_XXXX --out runs/shots

Needs Debian's `chromium` and `chromium-driver` and `pip install selenium`. The token comes
from `ray get-auth-token` (RAY_AUTH_MODE=token) unless --token is given; the pictures are
taken only once the login dialog is gone, so none shows the token. Prints the job's state
and the names of the actors on the Actors page.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

from rrfp_ray.job import run_job

_WAIT_S = 60.0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", default="http://127.0.0.1:8265", help="the dashboard's URL")
    parser.add_argument("--job", required=True, help="the job's submission id (ray job list) or job id")
    parser.add_argument("--out", default="runs/dashboard", help="where the screenshots go")
    parser.add_argument("--token", default=None, help="the cluster's token (default: ray get-auth-token)")
    args = parser.parse_args(argv)
    for command in ("chromium", "chromedriver"):
        if shutil.which(command) is None:
            parser.error(f"no `{command}` on PATH: apt-get install -y chromium chromium-driver")
    try:
        import selenium  # noqa: F401
    except ImportError:
        parser.error("selenium is not installed: pip install selenium")
    if args.token is None and ray_cli() is None:
        parser.error(
            f"no `ray` command beside this Python ({sys.executable}) or on PATH to read the cluster's token: "
            "run it with the project's virtualenv (. .venv/bin/activate), or give --token"
        )
    return args


def ray_cli() -> str | None:
    """The `ray` command of this Python's environment (a virtualenv need not be activated), else PATH's."""
    beside = Path(sys.executable).parent / "ray"
    return str(beside) if beside.is_file() else shutil.which("ray")


def cluster_token() -> str:
    done = subprocess.run(
        [ray_cli(), "get-auth-token"],
        env=os.environ | {"RAY_AUTH_MODE": "token"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if done.returncode != 0 or not done.stdout.strip():
        sys.exit(f"dashboard_shots.py: error: `ray get-auth-token` gave no token: {done.stderr.strip()[-500:]}")
    return done.stdout.strip().splitlines()[-1]


def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = shutil.which("chromium")
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1600,1000"):
        options.add_argument(flag)
    return webdriver.Chrome(service=Service(shutil.which("chromedriver")), options=options)


def wait_for(driver, test, *, what: str, timeout_s: float = _WAIT_S):
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout_s, poll_frequency=0.5).until(lambda d: test(d))
    except TimeoutException:
        sys.exit(
            f"dashboard_shots.py: error: timed out after {timeout_s:g} s waiting for {what} at {driver.current_url}"
        )


def log_in(driver, *, address: str, token: str) -> None:
    """Type the token into the dashboard's dialog; return once the dialog is gone."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    driver.get(address)
    field = wait_for(
        driver, lambda d: _visible(d.find_elements(By.CSS_SELECTOR, "[role=dialog] input")), what="the login dialog"
    )
    field.send_keys(token, Keys.ENTER)
    wait_for(
        driver,
        lambda d: not _visible(d.find_elements(By.CSS_SELECTOR, "[role=dialog]")),
        what="the login dialog to close",
    )


def _visible(elements: list):
    return next((e for e in elements if e.is_displayed()), None)


def page_text(driver) -> str:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.TAG_NAME, "body").text


def shoot(driver, *, url: str, ready, what: str, path: Path) -> str:
    """Open `url`, wait until `ready(text of the page)`, then save the screenshot; returns the page's text."""
    driver.get(url)
    wait_for(driver, lambda d: ready(page_text(d)), what=what)
    time.sleep(1.0)  # let the tables finish drawing
    driver.save_screenshot(str(path))
    return page_text(driver)


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    token = args.token or cluster_token()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    address = args.address.rstrip("/")
    driver = browser()
    try:
        log_in(driver, address=address, token=token)
        print("logged in; login dialog gone")
        states = ("SUCCEEDED", "FAILED", "STOPPED", "RUNNING", "PENDING")
        text = shoot(
            driver,
            url=f"{address}/#/jobs/{args.job}",
            ready=lambda t: args.job in t and any(s in t for s in states),
            what=f"job {args.job}'s page",
            path=out / "job.png",
        )
        state = next(s for s in states if s in text)
        print(f"job {args.job}: {state}")
        text = shoot(
            driver,
            url=f"{address}/#/actors",
            ready=lambda t: "rrfp-driver-" in t,
            what="the Actors page to list rrfp-driver",
            path=out / "actors.png",
        )
        names = sorted(set(re.findall(r"rrfp-(?:driver|stage)[\w.-]*", text)))
        print(f"actors: {', '.join(names)}")
        print(f"wrote {out}/: job.png, actors.png")
    finally:
        driver.quit()


if __name__ == "__main__":
    run_job(main)
