"""The Prefect UI as a person uses it: headless Chromium opens the served rollflow-run deployment, starts a
Custom run with one field changed, and finds the run's progress, report (its plots shown) and dataset link."""

from __future__ import annotations

import copy
import os
import re
import time
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest
from rollout_data import assert_complete, write_rows
from served_runs import artifacts, deployment, ok, serve, spec_in_force, wait_final

CHROMIUM = Path("/usr/bin/chromium")
# Screenshots go to the test's temporary directory; ROLLFLOW_UI_SHOTS=docs/img refreshes the README's.
SHOTS_ENV = "ROLLFLOW_UI_SHOTS"
ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]  # fmt: skip
ROWS = 40
# Every plot a page shows, as (src prefix, natural width): a plot that did not load has width 0.
IMAGES_JS = (
    "() => Array.from(document.querySelectorAll('img'))"
    ".filter(i => i.getAttribute('src') && !i.getAttribute('src').endsWith('.svg'))"
    ".map(i => [i.getAttribute('src').slice(0, 22), i.complete ? i.naturalWidth : 0])"
)


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


def shot(page, shots: Path, name: str) -> None:
    page.wait_for_timeout(300)  # let the page repaint what was typed or loaded
    page.screenshot(path=str(shots / name), full_page=False)


def loaded_images(page, timeout_s: float = 20) -> list[list]:
    """The page's images once every one has loaded or failed (or the time is up)."""
    deadline = time.monotonic() + timeout_s
    found = page.evaluate(IMAGES_JS)
    while time.monotonic() < deadline and not (found and all(width > 0 for _, width in found)):
        page.wait_for_timeout(250)
        found = page.evaluate(IMAGES_JS)
    return found


def submit(page, calls: list[str], runs: Callable[[], list], timeout_s: float = 60) -> bool:
    """Click Submit and wait for the run it creates. Prefect's server answers 503 when SQLite is busy and
    its UI only shows a toast then, so Submit is clicked again after a 503, as a person would (3 at most)."""
    deadline, clicks, mark = time.monotonic() + timeout_s, 0, 0
    while time.monotonic() < deadline:
        if clicks == 0 or (clicks < 3 and any(c.endswith(" 503") for c in calls[mark:])):
            mark, clicks = len(calls), clicks + 1
            page.get_by_role("button", name="Submit").click()
        page.wait_for_timeout(250)
        if runs():
            return True
    return False


@pytest.mark.skipif(not CHROMIUM.exists(), reason="Debian's chromium is installed by .ci/run")
def test_custom_run_with_one_field_changed_publishes_with_the_rest_as_served(
    prefect_server, cli_env, fast_sim, moto_s3, tmp_path
) -> None:
    from playwright.sync_api import sync_playwright

    bucket = moto_s3.new_bucket()
    out = f"s3://{bucket}/ui-run"
    env = {
        **cli_env,
        **moto_s3.env,  # S3 keys stay in the serving process's environment, never in a parameter
        "ROLLFLOW_PIPELINE__INPUT": str(write_rows(tmp_path / "rows.jsonl", ROWS)),
        "ROLLFLOW_PIPELINE__OUTPUT": out,
        "ROLLFLOW_BACKEND__KIND": "chat",
        "ROLLFLOW_BACKEND__URL": fast_sim.url,
        "ROLLFLOW_BACKEND__MODEL": "m",
        "ROLLFLOW_COLLECTION__NUM_REPEATS": "2",
        "ROLLFLOW_COLLECTION__PARALLELISM": "16",
        "ROLLFLOW_VERIFY__VERIFIER": "math_fast",
        "ROLLFLOW_VERIFY__PROCESSES": "0",
    }
    api, url = prefect_server.env["PREFECT_API_URL"], prefect_server.url
    shots = Path(os.environ.get(SHOTS_ENV) or tmp_path / "shots")
    shots.mkdir(parents=True, exist_ok=True)
    proc = serve(env, "--name", "ui")
    try:
        served = deployment(api, "ui", proc)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=ARGS)
            page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
            calls: list[str] = []  # the page's API calls and console errors, for a failure's message
            page.on("response", lambda r: calls.append(f"{r.request.method} {r.url[len(url) :]} {r.status}"))
            page.on("requestfailed", lambda r: calls.append(f"{r.method} {r.url[len(url) :]} {r.failure}"))
            page.on("console", lambda m: m.type == "error" and calls.append(f"console: {m.text[:300]}"))
            page.goto(f"{url}/deployments/deployment/{served['id']}")
            page.get_by_role("button", name="Run", exact=True).click()
            page.get_by_text("Custom run", exact=True).first.click()
            repeats = field(page, "Num Repeats")
            repeats.wait_for(timeout=30_000)
            assert repeats.input_value() == "2", "the form shows the served value"
            repeats.fill("3")
            repeats.evaluate("e => e.scrollIntoView({block: 'center'})")
            shot(page, shots, "ui-run-form.png")
            query = {"flow_runs": {"deployment_id": {"any_": [served["id"]]}}}
            if not submit(page, calls, lambda: ok(api, "/flow_runs/filter", query)):
                shot(page, shots, "ui-run-submitted.png")
                text = page.locator("body").inner_text()[-1500:]
                seen = "\n".join(calls[-25:])
                pytest.fail(
                    f"no flow run 60 s after Submit; the page at {page.url} read:\n{text}\ncalls:\n{seen}"
                )
            page.wait_for_timeout(1000)  # a second Submit would have created its run by now
            runs = ok(api, "/flow_runs/filter", query)
            assert len(runs) == 1, "the form's Submit created exactly one flow run"
            run_id = runs[0]["id"]
            run = wait_final(api, run_id)
            assert run["state"]["type"] == "COMPLETED", f"{run['state']['type']}: {run['state']['message']}"

            page.goto(f"{url}/runs/flow-run/{run_id}")
            tab = page.get_by_role("tab", name="Artifacts").or_(page.get_by_text("Artifacts", exact=True))
            tab.first.click()
            try:
                for key in ("rollflow-report", "rollflow-dataset", "rollflow-progress"):
                    page.get_by_text(key).first.wait_for(timeout=30_000)
            finally:
                shot(page, shots, "ui-run-artifacts.png")
            found = artifacts(api, run_id)
            page.goto(f"{url}/artifacts/artifact/{found['rollflow-report']['id']}")
            page.get_by_text("rollflow run report").first.wait_for(timeout=30_000)
            images = loaded_images(page)
            page.get_by_text("Rewards", exact=False).first.evaluate("e => e.scrollIntoView({block: 'start'})")
            shot(page, shots, "ui-run-report.png")
            browser.close()
        plots = [i for i in images if i[0].startswith("data:image/png")]
        assert plots and all(width > 0 for _, width in plots), f"the report's plots did not load: {images}"
        assert found["rollflow-progress"]["data"] == 100.0
        assert found["rollflow-dataset"]["data"].startswith(f"[{out}/rollouts.jsonl]")

        expected = copy.deepcopy(served["parameters"])
        expected["collection"]["num_repeats"] = 3
        assert run["parameters"]["collection"]["num_repeats"] == 3
        fs = moto_s3.fs()
        report = orjson.loads(fs.cat_file(f"{out}/report.json"))
        assert spec_in_force(report) == expected, "the one field changed, every other as served"
        lines = fs.cat_file(f"{out}/rollouts.jsonl").splitlines()
        assert_complete(lines, ROWS, 3)
        assert {orjson.loads(line)["response"]["model"] for line in lines} == {"m"}
    finally:
        proc.terminate()
        proc.wait(30)
