"""The dashboard in a real headless Chromium (Debian's, driven by Playwright) against a
real server running real jobs: log in, watch a job go to 100 %, cancel another (with the
confirmation), open a checkpoint and see a tensor's layout drawn. Screenshots are kept in
the test's folder (and the README's is made here)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import TOKEN, make_tp4, tensors
from tests.server.test_users import add_user, job_spec

CHROMIUM = os.environ.get("RESHARD_CHROMIUM", "/usr/bin/chromium")
SHOTS = Path(__file__).resolve().parents[2] / "docs" / "dashboard.png"


@pytest.fixture
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    if not shutil.which(CHROMIUM) and not os.path.exists(CHROMIUM):
        pytest.skip(f"no Chromium at {CHROMIUM}: apt-get install chromium")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=["--no-sandbox", "--disable-gpu"]
        )
        yield b
        b.close()


def test_dashboard_jobs_cancel_and_layout(browser, tmp_path, make_server):
    data = tmp_path / "data"
    auth = tmp_path / "auth.yaml"
    alice = add_user(auth, "alice", "--max-running", "0")  # her jobs wait: one to cancel
    server = make_server(auth_file=str(auth), max_running="1")
    src = str(data / "src")
    make_tp4(src, str(tmp_path / "scratch"), tensors(3))
    with server.client() as admin:
        done_id = admin.submit(job_spec(src, str(data / "tp2"))).id
    waiting = httpx.post(
        f"{server.url}/v1/jobs",
        json=job_spec(src, str(data / "alice-tp2")),
        headers={"Authorization": f"Bearer {alice}"},
    ).json()["id"]

    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.on("dialog", lambda d: d.accept())  # the cancel confirmation
    page.goto(f"{server.url}/ui")
    page.fill("#token", "wrong")
    page.click("button[type=submit]")
    page.wait_for_selector("#login-error:has-text('refused')")
    page.fill("#token", TOKEN)
    page.click("button[type=submit]")

    page.wait_for_selector("#who:has-text('admin')")
    # the jobs list: both jobs, owners, alice's waiting reason
    page.wait_for_selector(f"#jobs tr[data-id='{done_id}']")
    row = f"#jobs tr[data-id='{waiting}']"
    page.wait_for_selector(f"{row}:has-text('max_running is 0')", timeout=120_000)  # live
    assert "alice" in page.inner_text(row)

    # one job, live, to 100 %
    page.goto(f"{server.url}/ui#/job/{done_id}")
    page.wait_for_selector("#job-state.state-succeeded", timeout=120_000)
    assert page.locator("#job-progress [role=progressbar]").get_attribute("aria-valuenow") == "100"
    assert '"tp": 2' in page.inner_text("#job-spec")
    page.wait_for_selector("#job-logs:not(:empty)")
    page.wait_for_selector("#worker-table")  # where each worker reads and what it sends
    assert page.locator("#worker-table tr").count() == 1 + 1  # workers=1: one rank
    page.screenshot(path=str(tmp_path / "job.png"), full_page=True)

    # cancel alice's waiting job, confirming
    page.goto(f"{server.url}/ui#/job/{waiting}")
    page.wait_for_selector("#job-state.state-queued")
    page.click("#cancel")
    page.wait_for_selector("#job-state.state-cancelled")
    with server.client() as admin:
        assert admin.get(waiting).state.value == "cancelled"

    # a checkpoint, and a tensor's layout drawn: one rect per cell, 4 boxes (TP=4 on dim 0)
    page.goto(f"{server.url}/ui#/checkpoint?uri={src}")
    page.click("[data-tensor='w']")
    page.wait_for_selector("#layout-svg")
    boxes = page.eval_on_selector_all(
        "#layout-svg rect", "rs => new Set(rs.map(r => r.dataset.box)).size"
    )
    assert boxes == 4
    legend = page.inner_text("#layout-legend")
    assert "rank 0" in legend and "tp=3" in legend
    page.click("[data-tensor='b']")  # replicated: one box, four replicas
    page.wait_for_selector("#layout-legend:has-text('4 replicas')")
    page.screenshot(path=str(tmp_path / "layout.png"), full_page=True)

    # the dashboard's pages are static and strict; its data needs the token
    r = httpx.get(f"{server.url}/ui")
    assert r.status_code == 200 and "script-src" not in r.text
    assert "default-src 'self'" in r.headers["content-security-policy"]
    assert (
        httpx.get(
            f"{server.url}/v1/checkpoints/layout", params={"uri": src, "tensor": "w"}
        ).status_code
        == 401
    )

    # the README's screenshot: the jobs page
    page.goto(f"{server.url}/ui#/jobs")
    page.wait_for_selector(f"#jobs tr[data-id='{done_id}'] .state-succeeded")
    SHOTS.parent.mkdir(exist_ok=True)
    page.screenshot(path=str(tmp_path / "jobs.png"))
    if os.environ.get("RESHARD_UPDATE_SCREENSHOT"):
        shutil.copy(tmp_path / "jobs.png", SHOTS)
