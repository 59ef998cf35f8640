"""`make lab-check`: does the first hour work? JupyterLab serves the kit, notebook 00 runs in it, and
the page shows the notebook with its outputs.

Steps: register the kit's kernel (`ensure_kernel`); install Chromium with apt if no Chromium or
Chrome is on PATH; copy notebooks/00_setup_check.ipynb to artifacts/lab_check/ (the committed
notebook stays output-free); start JupyterLab on a free port of 127.0.0.1 with the repository as
its root, as `make lab` does; open a session for the copy in the kernel `qerl-kit` through the
server's REST API and execute every code cell over the kernel's websocket, collecting outputs as
JupyterLab would; save the executed notebook through the server's contents API; load the notebook's
page in headless Chromium twice, once to read the DOM JupyterLab rendered (the check: it must show
the notebook's last output) and once for a screenshot, artifacts/lab_check.png.

Exit status 0 when every cell ran and the page shows the outputs; otherwise 1 with one line naming
what failed (the screenshot is still taken when the server runs). Not part of `make test`: it
needs Chromium and a minute or two.
"""

from __future__ import annotations

import contextlib
import html
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import nbformat
import requests

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from qerl_lib.cli.notebook_runner import KERNEL_NAME, ensure_kernel  # noqa: E402
from qerl_lib.io import write_text_atomic  # noqa: E402

NOTEBOOK = REPO / "notebooks" / "00_setup_check.ipynb"
WORK = REPO / "artifacts" / "lab_check"             # the executed copy and the server's log
SCREENSHOT = REPO / "artifacts" / "lab_check.png"
BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
CELL_TIMEOUT_S = 300
SERVER_START_S = 90
WINDOW = (1400, 2200)  # tall enough for notebook 00 with its outputs in one screen


class CheckFailed(Exception):
    """One line saying what failed."""


# ---------------------------------------------------------------------------------------------
# Chromium


def find_or_install_chromium() -> str:
    """A Chromium/Chrome on PATH; installs Debian's `chromium` with apt-get when there is none."""
    for name in BROWSERS:
        if found := shutil.which(name):
            return found
    if not shutil.which("apt-get"):
        raise CheckFailed("no Chromium on PATH and no apt-get: install Chromium (or Chrome) and rerun")
    sudo = [] if os.geteuid() == 0 else (["sudo", "-n"] if shutil.which("sudo") else None)
    if sudo is None:
        raise CheckFailed("no Chromium on PATH: run `apt-get install -y chromium` as root, then rerun")
    print("lab-check: installing Chromium with apt-get (once)", flush=True)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = [*sudo, "apt-get", "install", "-y", "-q", "chromium"]
    if subprocess.run(install, env=env, stdout=subprocess.DEVNULL).returncode != 0:
        subprocess.run([*sudo, "apt-get", "update", "-q"], env=env, stdout=subprocess.DEVNULL)
        if subprocess.run(install, env=env, stdout=subprocess.DEVNULL).returncode != 0:
            raise CheckFailed("`apt-get install -y chromium` failed: install Chromium by hand and rerun")
    for name in BROWSERS:
        if found := shutil.which(name):
            return found
    raise CheckFailed("apt-get installed chromium but no chromium is on PATH: add it to PATH and rerun")


def chromium(browser: str, url: str, profile: Path, *args: str, timeout: int = 180) -> str:
    """Run headless Chromium on `url` with `args`, giving JupyterLab's scripts time to render; stdout."""
    command = [browser, "--headless", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
               "--no-first-run", "--mute-audio", f"--user-data-dir={profile}",
               f"--window-size={WINDOW[0]},{WINDOW[1]}", "--virtual-time-budget=30000", *args, url]
    if os.geteuid() == 0:
        command.insert(1, "--no-sandbox")  # Chromium refuses to run as root with its sandbox
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise CheckFailed(f"headless Chromium did not finish loading {url.split('?')[0]} in {timeout} s") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        raise CheckFailed(f"headless Chromium failed (exit {done.returncode}): {last}")
    return done.stdout


# ---------------------------------------------------------------------------------------------
# JupyterLab


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Lab:
    """A JupyterLab server of this checkout on 127.0.0.1:`port`, as `make lab` starts it (plus
    --no-browser, and settings and workspaces in `state` so the user's own are not touched)."""

    def __init__(self, state: Path, log_path: Path):
        self.port, self.token = free_port(), secrets.token_hex(24)
        self.base = f"http://127.0.0.1:{self.port}"
        settings = state / "settings" / "@jupyterlab" / "apputils-extension"
        settings.mkdir(parents=True)
        (settings / "notification.jupyterlab-settings").write_text(json.dumps({"fetchNews": "false"}))
        command = [str(Path(sys.executable).parent / "jupyter-lab"), "--no-browser",
                   "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
                   f"--ServerApp.root_dir={REPO}", "--LabApp.default_url=/lab/tree/notebooks",
                   f"--MappingKernelManager.default_kernel_name={KERNEL_NAME}",
                   f"--LabApp.user_settings_dir={state / 'settings'}",
                   f"--LabApp.workspaces_dir={state / 'workspaces'}"]
        if os.geteuid() == 0:
            command.append("--ServerApp.allow_root=True")
        env = dict(os.environ, JUPYTER_TOKEN=self.token, JUPYTER_RUNTIME_DIR=str(state / "runtime"))
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env,
                                        start_new_session=True)

    def url(self, path: str) -> str:
        return f"{self.base}/{path.lstrip('/')}?token={self.token}"

    def api(self, method: str, path: str, **kwargs) -> dict:
        response = requests.request(method, f"{self.base}/{path.lstrip('/')}", timeout=60,
                                    headers={"Authorization": f"token {self.token}"}, **kwargs)
        if response.status_code >= 400:
            raise CheckFailed(f"{method} {path} answered {response.status_code}: {response.text[:200]}")
        return response.json() if response.content else {}

    def wait_until_up(self) -> None:
        deadline = time.monotonic() + SERVER_START_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise CheckFailed(f"JupyterLab exited with {self.process.returncode} on start: see {self.log_path}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(self.url("api/status"), timeout=5).ok:
                    return
            time.sleep(0.5)
        raise CheckFailed(f"JupyterLab did not answer within {SERVER_START_S} s: see {self.log_path}")

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.api("POST", "api/shutdown")  # shuts the kernels down too
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=20)
        self.log.close()


def execute_in_session(lab: Lab, relpath: str, nb: nbformat.NotebookNode) -> tuple[int, str | None]:
    """Open a session for `relpath` in the kit's kernel and execute `nb`'s code cells in it, in order,
    filling in outputs and execution counts; stop at the first error. (cells run, error line or None)."""
    import websocket

    session = lab.api("POST", "api/sessions", json={"path": relpath, "name": Path(relpath).name, "type": "notebook",
                                                    "kernel": {"name": KERNEL_NAME}})
    kernel_id = session["kernel"]["id"]
    ws = websocket.create_connection(
        f"ws://127.0.0.1:{lab.port}/api/kernels/{kernel_id}/channels?session_id={uuid.uuid4().hex}",
        header=[f"Authorization: token {lab.token}"], timeout=CELL_TIMEOUT_S)
    ran = 0
    try:
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            started = time.perf_counter()
            error = run_cell(ws, cell)
            ran += 1
            print(f"lab-check: cell {index} [{cell.execution_count}] "
                  f"{'error' if error else 'ok'} in {time.perf_counter() - started:.1f} s", flush=True)
            if error:
                return ran, f"cell {index} [{cell.execution_count}] raised {error}"
    finally:
        ws.close()
    return ran, None


def run_cell(ws, cell: nbformat.NotebookNode) -> str | None:
    """Execute one code cell over the kernel websocket (Jupyter's JSON message protocol); fill in its
    outputs and execution count; return "Ename: evalue" if it raised."""
    msg_id = uuid.uuid4().hex
    ws.send(json.dumps({
        "header": {"msg_id": msg_id, "msg_type": "execute_request", "username": "lab-check",
                   "session": uuid.uuid4().hex, "version": "5.3"},
        "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
        "content": {"code": cell.source, "silent": False, "store_history": True, "user_expressions": {},
                    "allow_stdin": False, "stop_on_error": True},
    }))
    cell.outputs, error, idle, replied = [], None, False, False
    while not (idle and replied):
        msg = json.loads(ws.recv())
        if msg.get("parent_header", {}).get("msg_id") != msg_id:
            continue
        kind, content = msg["header"]["msg_type"], msg["content"]
        if msg["channel"] == "shell" and kind == "execute_reply":
            replied = True
            cell.execution_count = content.get("execution_count")
            if content.get("status") == "error":
                error = error or f"{content.get('ename')}: {content.get('evalue')}"
        elif kind == "status":
            idle = content.get("execution_state") == "idle"
        elif kind == "clear_output":
            cell.outputs = []
        elif kind in ("stream", "display_data", "execute_result", "error"):
            cell.outputs.append(nbformat.v4.output_from_msg(msg))
            if kind == "error":
                error = f"{content['ename']}: {content['evalue']}"
    return error


def last_output_line(nb: nbformat.NotebookNode) -> str:
    """The last non-empty text line the notebook printed: what the rendered page must show."""
    for cell in reversed(nb.cells):
        for output in reversed(cell.get("outputs", [])):
            text = output.get("text") or output.get("data", {}).get("text/plain", "")
            lines = [line.strip() for line in "".join(text).splitlines() if line.strip()]
            if lines:
                return lines[-1]
    raise CheckFailed("the notebook ran but printed nothing to look for on the page")


# ---------------------------------------------------------------------------------------------


def check() -> str:
    """Run the whole check; return the success line, raise `CheckFailed` otherwise."""
    started = time.perf_counter()
    print(f"lab-check: kernel {KERNEL_NAME!r} at {ensure_kernel()}", flush=True)
    browser = find_or_install_chromium()
    WORK.mkdir(parents=True, exist_ok=True)
    relpath = f"artifacts/lab_check/{NOTEBOOK.name}"
    write_text_atomic(REPO / relpath, NOTEBOOK.read_text(encoding="utf-8"))
    with tempfile.TemporaryDirectory(prefix="qerl-lab-check-") as state:
        lab = Lab(Path(state), WORK / "server.log")
        try:
            lab.wait_until_up()
            print(f"lab-check: JupyterLab up at {lab.base} (log {lab.log_path.relative_to(REPO)})", flush=True)
            page = lab.url(f"lab/tree/{relpath}")
            if "jupyter-config-data" not in requests.get(page, timeout=30).text:
                raise CheckFailed(f"{lab.base}/lab/tree/{relpath} did not serve the JupyterLab page")
            nb = nbformat.reads(json.dumps(lab.api("GET", f"api/contents/{relpath}")["content"]), as_version=4)
            ran, error = execute_in_session(lab, relpath, nb)
            lab.api("PUT", f"api/contents/{relpath}", json={"type": "notebook", "format": "json", "content": nb})
            profile = Path(state) / "chromium"
            SCREENSHOT.parent.mkdir(parents=True, exist_ok=True)
            shot = Path(state) / SCREENSHOT.name
            chromium(browser, page, profile, f"--screenshot={shot}")
            if not shot.exists():
                raise CheckFailed("headless Chromium wrote no screenshot")
            shutil.copyfile(shot, SCREENSHOT)  # complete before it appears under artifacts/
            print(f"lab-check: screenshot {SCREENSHOT.relative_to(REPO)}", flush=True)
            if error:
                raise CheckFailed(f"{NOTEBOOK.name} failed in JupyterLab: {error} (screenshot {SCREENSHOT.relative_to(REPO)})")
            expected = last_output_line(nb)
            dom = chromium(browser, page, profile, "--dump-dom")
            if "jp-OutputArea-output" not in dom or html.escape(expected, quote=False) not in dom:
                raise CheckFailed(f"JupyterLab's page does not show the notebook's outputs (looked for {expected!r}; "
                                  f"see {SCREENSHOT.relative_to(REPO)})")
        finally:
            lab.stop()
    return (f"lab-check: ok: {NOTEBOOK.name} ran {ran} cells in JupyterLab's {KERNEL_NAME} kernel and the page "
            f"shows their outputs ({time.perf_counter() - started:.0f} s); screenshot {SCREENSHOT.relative_to(REPO)}")


def main() -> int:
    try:
        print(check())
    except CheckFailed as e:
        print(f"lab-check: FAILED: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
