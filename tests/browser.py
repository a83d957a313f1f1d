"""Headless Chromium (Debian's `chromium`) driven over the DevTools protocol: load a page, let its JavaScript render,
read the rendered text, click a tab, save a screenshot. Only the standard library and `websockets` (a Prefect
dependency); `optipng` (Debian) shrinks the screenshots when it is there."""
from __future__ import annotations

import itertools
import base64
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--no-first-run"]


def ensure_chromium() -> str:
    """Install Debian's chromium when missing (the test set-up; a no-op once it is there)."""
    subprocess.run(["bash", str(REPO / "infra" / "stack" / "system-deps.sh"), "chromium"], check=True, timeout=900)
    return shutil.which("chromium")


class Chromium:
    def __init__(self, width: int = 1400, height: int = 1000):
        from websockets.sync.client import connect

        self.profile = tempfile.mkdtemp(prefix="baton-chromium-")
        self.proc = subprocess.Popen(
            [ensure_chromium(), *FLAGS, "--remote-debugging-port=0", f"--user-data-dir={self.profile}",
             f"--window-size={width},{height}", "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        port_file = Path(self.profile) / "DevToolsActivePort"
        deadline = time.time() + 60
        while not port_file.exists() or not port_file.read_text().strip():
            if time.time() > deadline or self.proc.poll() is not None:
                self.close()
                raise RuntimeError("chromium did not open its DevTools port")
            time.sleep(0.2)
        port = int(port_file.read_text().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            page = next(t for t in json.loads(r.read()) if t["type"] == "page")
        self.ws = connect(page["webSocketDebuggerUrl"], max_size=None, open_timeout=30)
        self.ids = itertools.count(1)
        # the viewport is exactly width × height (the window size alone leaves room for browser chrome)
        self.send("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def send(self, method: str, **params) -> dict:
        msg_id = next(self.ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=60))
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})

    def evaluate(self, expression: str):
        res = self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        return res.get("result", {}).get("value")

    def goto(self, url: str) -> None:
        self.send("Page.navigate", url=url)

    def text(self) -> str:
        return self.evaluate("document.body ? document.body.innerText.replace(/\\u00a0/g, ' ') : ''") or ""

    def wait_for(self, needles: list[str], timeout: float = 90) -> str:
        """The page's rendered text once every needle appears in it (AssertionError with the text otherwise)."""
        deadline = time.time() + timeout
        text = ""
        while time.time() < deadline:
            text = self.text()
            if all(n in text for n in needles):
                return text
            time.sleep(0.5)
        missing = [n for n in needles if n not in text]
        raise AssertionError(f"not rendered after {timeout}s: {missing}\n--- page text ---\n{text[:3000]}")

    def wait_until(self, expression: str, timeout: float = 60) -> None:
        """Until a JavaScript expression on the page is truthy (AssertionError naming it otherwise)."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.evaluate(expression):
                return
            time.sleep(0.3)
        raise AssertionError(f"still false after {timeout}s: {expression}\n--- page text ---\n{self.text()[:2000]}")

    def type_into(self, selector: str, text: str) -> None:
        """Focus the first element matching selector and type text into it as a keyboard does (the page's framework
        sees real input events)."""
        self.wait_until(f"!!document.querySelector({json.dumps(selector)})")
        self.evaluate(f"document.querySelector({json.dumps(selector)}).focus()")
        self.send("Input.insertText", text=text)

    def send_headers(self, headers: dict[str, str]) -> None:
        """Send these headers with every request from now on: what a browser does with HTTP basic auth once the
        user has answered its prompt (headless Chromium shows no prompt)."""
        self.send("Network.enable")
        self.send("Network.setExtraHTTPHeaders", headers=headers)

    def click_text(self, label: str) -> bool:
        """Click the innermost element whose text is label (a tab, a link, a button with an icon), or the button,
        link or tab around it."""
        return bool(self.evaluate(f"""(() => {{
            const label = {json.dumps(label)};
            const hits = [...document.querySelectorAll('body *')].filter(e => e.textContent.trim() === label);
            const el = hits.find(e => ![...e.children].some(c => c.textContent.trim() === label));
            if (!el) return false;
            (el.closest('button, a, label, [role=tab], [role=switch]') || el).click();
            return true;
        }})()"""))

    def scroll_to_bottom(self) -> None:
        """Lists below the fold render their rows only once scrolled into view."""
        self.evaluate("window.scrollTo(0, document.body.scrollHeight); "
                      "document.querySelectorAll('*').forEach(e => { if (e.scrollHeight > e.clientHeight + 50) "
                      "e.scrollTop = e.scrollHeight; })")

    def scroll_to_top(self) -> None:
        self.evaluate("window.scrollTo(0, 0); document.querySelectorAll('*').forEach(e => { e.scrollTop = 0; })")

    def click_all(self, selector: str) -> int:
        return int(self.evaluate(f"""(() => {{
            const found = [...document.querySelectorAll({json.dumps(selector)})];
            found.forEach(e => e.click());
            return found.length;
        }})()"""))

    def screenshot(self, path: Path) -> int:
        """Save the viewport as a PNG (losslessly optimised when optipng is installed); returns its size in bytes."""
        data = base64.b64decode(self.send("Page.captureScreenshot", format="png")["data"])
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp.png")
        tmp.write_bytes(data)
        if shutil.which("optipng"):
            subprocess.run(["optipng", "-quiet", "-o2", "-strip", "all", str(tmp)], check=False, timeout=300)
        os.replace(tmp, path)
        return path.stat().st_size

    def close(self) -> None:
        try:
            self.ws.close()
        except Exception:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
            self.proc.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> "Chromium":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
