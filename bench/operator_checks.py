"""Issue #30's before/after figures for one source tree (run by hand, not by `make bench`):

    python bench/operator_checks.py [TREE]     # TREE: a checkout, e.g. `git archive main | tar -x -C /tmp/main`

- each start-up mistake: the exit status and how many lines it printed (the goal: 2 and 1);
- `systemd-analyze security` of TREE/deploy/codebuddy2api.service (goal: <= 3.0);
- the widest page of the WebUI at 390 x 844 and 1280 x 800 (document scrollWidth; goal: the
  viewport's width), when Playwright and /usr/bin/chromium are there.

The gateway under test is TREE's (first on PYTHONPATH); this interpreter's packages serve it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TREE = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent).resolve()
ENV = {k: v for k, v in os.environ.items() if not k.startswith("CODEBUDDY2API_")} | {"PYTHONPATH": str(TREE)}
LITELLM = "model_list:\n  - model_name: gpt\n    litellm_params:\n      model: openai/gpt\n"


def startup(tmp: Path) -> None:
    (tmp / "config.yaml").write_text(LITELLM)
    cases = {
        "missing --upstream-api-key-file": (["--upstream-url", "http://127.0.0.1:9/v1", "--upstream-api-key-file", str(tmp / "absent")], {}),
        "misspelt CODEBUDDY2API_STREM_MODE": (["--simulator"], {"CODEBUDDY2API_STREM_MODE": "realtime"}),
        "change-me-admin-token placeholder": (["--simulator"], {"CODEBUDDY2API_ADMIN_TOKEN": "change-me-admin-token"}),
        "LiteLLM config.yaml": (["--config", str(tmp / "config.yaml")], {}),
    }
    for name, (args, extra) in cases.items():
        command = [sys.executable, "-m", "gateway", "serve", "--port", "0", "--data-dir", str(tmp / name.split()[0]), *args]
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=8, env=ENV | extra, cwd=tmp)
            status, lines = str(done.returncode), len((done.stdout + done.stderr).strip().splitlines())
        except subprocess.TimeoutExpired as exc:
            status = "started (still running after 8 s)"
            lines = len(((exc.stdout or b"") + (exc.stderr or b"")).decode().strip().splitlines())
        print(f"  {name:36} exit {status:34} {lines} line(s)")


def systemd() -> None:
    if not shutil.which("systemd-analyze"):
        print("  systemd-analyze: not installed")
        return
    out = subprocess.run(["systemd-analyze", "security", "--offline=yes", str(TREE / "deploy" / "codebuddy2api.service")],
                         capture_output=True, text=True, timeout=60).stdout
    score = re.search(r"Overall exposure level for \S+: (.+)", out)
    print(f"  systemd-analyze security: {score.group(1) if score else out[-200:]}")


def webui(tmp: Path) -> None:
    try:
        from playwright import sync_api
    except ImportError:
        print("  WebUI: playwright not installed")
        return
    if not Path("/usr/bin/chromium").exists():
        print("  WebUI: /usr/bin/chromium missing")
        return
    sys.path.insert(0, str(TREE))
    import httpx

    from tests.processes import free_port, wait_healthy

    token = "bench-operator-admin-token-0123456789"
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--simulator", "--port", str(port),
                             "--admin-token", token, "--data-dir", str(tmp / "ui"), "--log-level", "error"],
                            env=ENV, cwd=tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # cwd: not this checkout's gateway/
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url)
        for i in range(6):
            httpx.post(url + "/v1/chat/completions", timeout=20,
                       json={"model": "echo" if i % 3 else "server_error", "messages": [{"role": "user", "content": "hi"}]})
        time.sleep(1.5)
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=["--no-sandbox", "--disable-gpu"])
            for width, height in ((390, 844), (1280, 800)):
                page = browser.new_context(viewport={"width": width, "height": height}).new_page()
                page.goto(url + "/#/dashboard")
                page.fill("#token", token)
                page.click("#login-button")
                page.wait_for_selector("#topbar:not([hidden])")
                widths = {}
                for name in ("dashboard", "settings", "audit", "credentials"):
                    page.goto(f"{url}/#/{name}")
                    page.wait_for_timeout(1500)
                    widths[name] = page.evaluate("document.documentElement.scrollWidth")
                print(f"  WebUI at {width} px: scrollWidth {widths}")
            browser.close()
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    print(f"tree: {TREE}")
    with tempfile.TemporaryDirectory() as directory:
        startup(Path(directory))
        systemd()
        webui(Path(directory))
