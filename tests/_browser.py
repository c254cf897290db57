"""A student in a real browser: the kit's JupyterLab driven in headless Chromium.

:func:`student_session` starts the kit's own ``jupyter lab`` (as root it needs
``--allow-root``, as ``make lab`` passes), opens lab 1 in Debian's Chromium through
Playwright (``/usr/bin/chromium``; never a browser that Playwright downloads), runs the setup
cell, the first exercise and its test cell on the released stub and on a saved wrong answer,
presses Validate, opens the Nbgrader menu, and returns what the student sees there as text.
Screenshots of each view go to the test's folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from ddp_lab.dist import free_port

CHROMIUM = "/usr/bin/chromium"
#: Flags for Chromium as root in a container without a network (no sandbox, no GPU, no
#: background requests that a closed network refuses).
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
LAB = "lab01_data_parallel"
SETUP = "from ddp_lab.checks import lab01 as checks"
EXERCISE = "def split_batch(x, y, n):"
TEST = "checks.split_batch(split_batch)"
STUB = "    # YOUR CODE HERE\n    raise NotImplementedError()"
#: A wrong answer a student could save: every sample in the first shard.
WRONG = "    return [(x, y)] + [(x[:0], y[:0])] * (n - 1)\n"
TOKEN = "ddp-lab-browser-test"
#: The open notebook.
PANEL = ".jp-NotebookPanel"


@dataclass
class Seen:
    """What the student reads: the test cell's output on the stub and on the wrong answer,
    the Validate dialog, and the entries of the Nbgrader menu."""

    stub: str
    wrong: str
    validate: str
    menu: str
    #: HTTP status of the instructor's and the exchange's pages: 404 when they are off.
    formgrader: int
    assignment_list: int


def _wrong_notebook(folder: Path) -> str:
    """Save a copy of the released lab 1 with a wrong ``split_batch``; return its name."""
    nb = json.loads((folder / f"{LAB}.ipynb").read_text())
    cell = next(c for c in nb["cells"] if c.get("id") == "ex1_split_batch")
    source = "".join(cell["source"])
    assert STUB in source, "the released exercise 1 no longer holds the stub this test edits"
    cell["source"] = source.replace(STUB, WRONG)
    (folder / "wrong.ipynb").write_text(json.dumps(nb))
    return "wrong.ipynb"


def _status(port: int, path: str) -> int:
    try:
        url = f"http://127.0.0.1:{port}/{path}?token={TOKEN}"
        return urllib.request.urlopen(url, timeout=10).status
    except urllib.error.HTTPError as err:
        return err.code


def _wait_for_server(port: int, server: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"jupyter lab exited with {server.returncode}")
        with contextlib.suppress(OSError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={TOKEN}", timeout=5)
            return
        time.sleep(0.5)
    raise AssertionError(f"jupyter lab did not answer within {timeout:g} s")


def _run_cell(page, text: str, shots: Path, timeout: float = 120):
    """Click into the code cell holding ``text``, Shift+Enter, wait until it has run (its
    prompt shows a new execution count).

    A cell that shows no sign of running after 15 s (the keys reached the page before the
    kernel did) is run once more.
    """
    cell = page.locator(f"{PANEL} .jp-CodeCell").filter(has_text=text).first
    cell.wait_for(timeout=60_000)
    prompt = cell.locator(".jp-InputArea-prompt")
    before = prompt.inner_text().strip()
    start, tries = time.monotonic(), 0
    while (now := prompt.inner_text().strip()) in ("", "[ ]:", "[*]:", before):
        elapsed = time.monotonic() - start
        if tries == 0 or (tries == 1 and elapsed > 15 and now != "[*]:"):
            cell.locator(".jp-InputArea-editor").click()
            page.keyboard.press("Shift+Enter")
            tries += 1
        if elapsed > timeout:
            page.screenshot(path=str(shots / "stuck.png"))
            raise AssertionError(f"the cell with {text!r} did not finish in {timeout:g} s")
        time.sleep(0.1)
    return cell


def _open(page, port: int, name: str) -> None:
    # a workspace of its own, reset: this notebook is the only one open
    workspace = Path(name).stem
    page.goto(
        f"http://127.0.0.1:{port}/lab/workspaces/{workspace}/tree/labs/{LAB}/{name}"
        f"?reset&token={TOKEN}"
    )
    page.wait_for_selector(f"{PANEL} .jp-CodeCell", timeout=60_000)
    # the kernel has started and is connected: the status bar says so
    page.locator(".jp-StatusBar-TextItem", has_text="| Idle").wait_for(timeout=120_000)


def _first_check(page, port: int, name: str, shots: Path) -> str:
    """Open notebook ``name``, run setup, exercise 1 and its test; return the test's output."""
    _open(page, port, name)
    _run_cell(page, SETUP, shots)
    _run_cell(page, EXERCISE, shots)
    cell = _run_cell(page, TEST, shots)
    output = cell.locator(".jp-OutputArea-output").first
    output.wait_for(timeout=30_000)
    cell.scroll_into_view_if_needed()
    page.screenshot(path=str(shots / f"{Path(name).stem}-check.png"))
    return output.inner_text()


def _validate(page, shots: Path) -> str:
    page.locator(PANEL).get_by_role("button", name="Validate").click()
    dialog = page.locator(".jp-Dialog", has_text="Validation Results")
    dialog.wait_for(timeout=240_000)
    page.screenshot(path=str(shots / "validate.png"))
    text = dialog.inner_text()
    dialog.get_by_role("button").last.click()
    return text


def _nbgrader_menu(page, shots: Path) -> str:
    page.locator(".lm-MenuBar-itemLabel", has_text="Nbgrader").click()
    menu = page.locator(".lm-Menu").last
    menu.wait_for(timeout=10_000)
    page.screenshot(path=str(shots / "nbgrader-menu.png"))
    text = menu.inner_text()
    page.keyboard.press("Escape")
    return text


@contextlib.contextmanager
def student_session(kit: Path, tmp: Path):
    """Start the kit's JupyterLab, look at lab 1 as a student; yield :class:`Seen`."""
    if not os.access(CHROMIUM, os.X_OK):
        message = f"{CHROMIUM} is missing: apt-get install chromium (.ci/run installs it)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    from playwright.sync_api import sync_playwright

    wrong = _wrong_notebook(kit / "labs" / LAB)
    shots = tmp / "screenshots"
    shots.mkdir()
    settings = tmp / "lab-settings" / "@jupyterlab"
    # every cell rendered (no virtual scrolling), and no news pop-up over the notebook
    (settings / "notebook-extension").mkdir(parents=True)
    (settings / "notebook-extension" / "tracker.jupyterlab-settings").write_text(
        json.dumps({"windowingMode": "none"})
    )
    (settings / "apputils-extension").mkdir(parents=True)
    (settings / "apputils-extension" / "notification.jupyterlab-settings").write_text(
        json.dumps({"fetchNews": "false"})
    )
    port = free_port()
    env = dict(
        os.environ,
        JUPYTERLAB_SETTINGS_DIR=str(tmp / "lab-settings"),
        JUPYTER_RUNTIME_DIR=str(tmp / "runtime"),
        OMP_NUM_THREADS="1",
    )
    env.pop("JUPYTER_CONFIG_DIR", None)
    allow_root = ["--allow-root"] if os.geteuid() == 0 else []
    log = (tmp / "jupyter.log").open("w")
    server = subprocess.Popen(
        [
            str(kit / ".venv" / "bin" / "jupyter"),
            "lab",
            "--no-browser",
            *allow_root,
            "--ip=127.0.0.1",
            f"--port={port}",
            f"--ServerApp.token={TOKEN}",
            f"--ServerApp.root_dir={kit}",
        ],
        cwd=kit,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        _wait_for_server(port, server)
        with sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            page = browser.new_page(viewport={"width": 1400, "height": 1000})
            stub = _first_check(page, port, f"{LAB}.ipynb", shots)
            wrong_out = _first_check(page, port, wrong, shots)
            dialog = _validate(page, shots)
            menu = _nbgrader_menu(page, shots)
            browser.close()
        pages = {"formgrader": _status(port, "formgrader")}
        pages["assignment_list"] = _status(port, "assignments")
        yield Seen(stub=stub, wrong=wrong_out, validate=dialog, menu=menu, **pages)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
        log.close()
