"""The Prefect UI as a person uses it: headless Chromium fills rollflow-run's form and submits a run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import orjson
import pytest
from rollout_data import assert_complete, write_rows

CHROMIUM = Path("/usr/bin/chromium")
# Screenshots go to the test's temporary directory; ROLLFLOW_UI_SHOTS=docs/img refreshes the README's.
SHOTS_ENV = "ROLLFLOW_UI_SHOTS"
ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip


def prop(page, label: str):
    """The run form's property labelled `label` (first match, in form order)."""
    name = page.locator(".schema-form-property__label").filter(
        has_text=re.compile(rf"^{label}( \(Optional\))?$")
    )
    return name.first.locator(
        "xpath=ancestor::div[contains(concat(' ', @class, ' '), ' schema-form-property ')][1]"
    )


def field(page, label: str):
    """The text or number box of the property labelled `label`."""
    return prop(page, label).locator("textarea, input").first


def choose(page, label: str, option: str) -> None:
    """Pick `option` in the select of the property labelled `label` (an enum such as the backend kind)."""
    control = prop(page, label).locator(".p-select-button__control").first
    control.focus()
    page.keyboard.press(" ")  # the select opens on the keyboard reliably; a click only focuses it
    page.get_by_role("option", name=option, exact=True).click()
    expect_value = prop(page, label).locator(".p-select-button__value").first
    expect_value.filter(has_text=option).wait_for(timeout=10_000)


def api(server, path: str, body: dict | None = None) -> object:
    data = orjson.dumps(body) if body is not None else None
    req = urllib.request.Request(
        f"{server.url}/api{path}", data=data, headers={"Content-Type": "application/json"}
    )
    return orjson.loads(urllib.request.urlopen(req, timeout=30).read())


@pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's chromium is installed by .ci/run")
def test_run_form_submits_a_run_that_publishes_to_s3(prefect_server, cli_env, fast_sim, moto_s3, tmp_path):
    from playwright.sync_api import sync_playwright

    inp = write_rows(tmp_path / "rows.jsonl", 120)
    bucket = moto_s3.new_bucket()
    out = f"s3://{bucket}/ui-run"
    exe = str(Path(sys.executable).with_name("rollflow"))
    # The served process looks for submitted runs every PREFECT_RUNNER_POLL_FREQUENCY seconds (10 by
    # default): each second here, so the run starts soon after Submit
    env = {**cli_env, **moto_s3.env, "PREFECT_RUNNER_POLL_FREQUENCY": "1"}
    serve = subprocess.Popen(
        [exe, "serve", "--name", "ui"], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 60
        deployment = None
        while deployment is None and time.monotonic() < deadline:
            try:
                deployment = api(prefect_server, "/deployments/name/rollflow-run/ui")
            except urllib.error.HTTPError:
                time.sleep(0.25)
        assert deployment is not None, "rollflow serve did not register its deployment"
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
            context = browser.new_context(viewport={"width": 1400, "height": 1000})
            page = context.new_page()
            page.goto(f"{prefect_server.url}/deployments/deployment/{deployment['id']}/run")
            field(page, "Input").wait_for(timeout=30_000)
            field(page, "Input").fill(str(inp))
            field(page, "Output").fill(out)
            choose(page, "Kind", "agent")
            field(page, "Url").fill(fast_sim.url)  # the first Url is the backend's
            field(page, "Parallelism").fill("16")
            field(page, "Chunk Size").fill("50")
            shots = Path(os.environ.get(SHOTS_ENV) or tmp_path / "shots")
            shots.mkdir(parents=True, exist_ok=True)
            prop(page, "Input").evaluate("e => e.scrollIntoView({block: 'start'})")
            page.wait_for_timeout(300)  # let the form repaint what was typed
            page.screenshot(path=str(shots / "ui-run-form.png"), full_page=False)
            page.get_by_role("button", name="Submit").click()
            page.wait_for_url(f"**/deployments/deployment/{deployment['id']}**", timeout=30_000)
            runs: list = []
            deadline = time.monotonic() + 30
            while not runs and time.monotonic() < deadline:
                time.sleep(0.25)
                runs = api(
                    prefect_server, "/flow_runs/filter", {"deployments": {"id": {"any_": [deployment["id"]]}}}
                )
            assert len(runs) == 1, "the form's Submit created exactly one flow run"
            run_id = runs[0]["id"]
            state = "PENDING"
            deadline = time.monotonic() + 180
            while state not in ("COMPLETED", "FAILED", "CRASHED") and time.monotonic() < deadline:
                time.sleep(0.5)
                state = api(prefect_server, f"/flow_runs/{run_id}")["state"]["type"]
            assert state == "COMPLETED", state
            page.goto(f"{prefect_server.url}/runs/flow-run/{run_id}")
            page.get_by_role("tab", name="Artifacts").or_(
                page.get_by_text("Artifacts", exact=True)
            ).first.click()
            page.get_by_text("rollflow-report").first.wait_for(timeout=30_000)
            page.screenshot(path=str(shots / "ui-run-artifacts.png"), full_page=False)
            browser.close()
        fs = moto_s3.fs()
        assert_complete(fs.cat_file(f"{out}/rollouts.jsonl").splitlines(), 120, 1)
        artifacts = api(
            prefect_server, "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run_id]}}}
        )
        keys = {a["key"] for a in artifacts}
        assert {"rollflow-report", "rollflow-dataset", "rollflow-progress"} <= keys, keys
        report = next(a for a in artifacts if a["key"] == "rollflow-report")
        assert "rows_written" in report["data"] and "published" in report["data"]
        params = api(prefect_server, f"/flow_runs/{run_id}")["parameters"]
        assert params["backend"]["kind"] == "agent" and params["collection"]["parallelism"] == 16, params
        run_json = orjson.loads(fs.cat_file(f"{out}/run.json"))
        assert run_json["parallelism"] == 16, run_json
    finally:
        serve.terminate()
        serve.wait(30)
