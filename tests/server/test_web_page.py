"""The page at `/`, driven in a real headless Chromium over the DevTools protocol: the model picker
fills from /v1/models, a typed message streams its answer in, Stop ends a long answer, and the
live view shows the server's numbers. Screenshots land in the test's tmp directory.

Needs Chromium (Debian: `apt-get install -y chromium`); skipped with that hint when it is absent.
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest

BROWSER = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
pytestmark = pytest.mark.skipif(BROWSER is None, reason="needs Chromium: apt-get install -y chromium")


class Page:
    """One browser tab over the DevTools protocol (commands by id over its websocket)."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.ws = ws
        self.next_id = 0

    async def send(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        await self.ws.send_json({"id": self.next_id, "method": method, "params": params})
        while True:  # skip the events the tab sends in between
            msg = json.loads((await self.ws.receive(timeout=30)).data)
            if msg.get("id") == self.next_id:
                assert "error" not in msg, msg
                return msg["result"]

    async def eval(self, expression: str, *, may_throw: bool = False) -> Any:
        result = await self.send("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if may_throw and "exceptionDetails" in result:
            return None
        assert "exceptionDetails" not in result, result
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 60.0) -> Any:
        """Poll until truthy; an exception counts as not yet (e.g. the page is still loading)."""
        deadline = time.monotonic() + timeout
        while True:
            value = await self.eval(expression, may_throw=True)
            if value:
                return value
            assert time.monotonic() < deadline, f"timed out waiting for {expression}"
            await asyncio.sleep(0.05)

    async def type_text(self, selector: str, text: str) -> None:
        await self.eval(f"document.querySelector({json.dumps(selector)}).focus()")
        await self.send("Input.insertText", text=text)

    async def press_enter(self) -> None:
        for kind in ("keyDown", "keyUp"):
            await self.send("Input.dispatchKeyEvent", type=kind, key="Enter", code="Enter",
                            windowsVirtualKeyCode=13, **({"text": "\r"} if kind == "keyDown" else {}))

    async def screenshot(self, path: Path) -> None:
        shot = await self.send("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(shot["data"]))


@pytest.fixture
def browser(tmp_path):
    """A headless Chromium with a DevTools port; yields the port."""
    profile = tmp_path / "profile"
    assert BROWSER is not None
    proc = subprocess.Popen(
        [BROWSER, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
         "--remote-debugging-port=0", f"--user-data-dir={profile}", "--window-size=1280,900", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    port_file = profile / "DevToolsActivePort"  # Chromium writes its chosen port here
    deadline = time.monotonic() + 60
    while not (port_file.exists() and port_file.read_text().strip()):
        assert proc.poll() is None, "chromium exited at start-up"
        assert time.monotonic() < deadline, "chromium did not open its DevTools port"
        time.sleep(0.1)
    try:
        yield int(port_file.read_text().split()[0])
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


async def _open_page(port: int) -> tuple[aiohttp.ClientSession, Page]:
    session = aiohttp.ClientSession()
    async with session.get(f"http://127.0.0.1:{port}/json/list") as resp:
        targets = await resp.json()
    tab = next(t for t in targets if t["type"] == "page")
    ws = await session.ws_connect(tab["webSocketDebuggerUrl"], max_msg_size=0)
    return session, Page(ws)


def _running(base_url: str) -> int:
    with urllib.request.urlopen(base_url + "/status", timeout=10) as resp:
        return json.load(resp)["requests_running"]


def test_playground_streams_an_answer_and_stops(browser, base_url, tmp_path):
    async def scenario() -> None:
        session, page = await _open_page(browser)
        try:
            await page.send("Page.navigate", url=base_url + "/")
            # The model picker fills from /v1/models, the live view from /status.
            assert await page.wait_for("document.getElementById('model').value") == "smol"
            await page.wait_for("/^\\d+$/.test(document.getElementById('stat-running').textContent)")
            assert await page.eval("document.getElementById('server-state').textContent") == "healthy"

            await page.eval("document.getElementById('temperature').value = '0';"
                            "document.getElementById('max-tokens').value = '24'")
            await page.type_text("#prompt", "What is the capital of France? Answer in English.")
            await page.press_enter()
            done = "document.querySelector('.msg.assistant')?.dataset.done"
            assert await page.wait_for(done) in ("stop", "length")
            answer = await page.eval("document.querySelector('.msg.assistant .text').textContent")
            assert "Paris" in answer, answer
            # It came as a stream: several text deltas, not one reply at the end.
            assert int(await page.eval("document.querySelector('.msg.assistant').dataset.chunks")) > 2
            assert await page.eval("document.querySelector('.msg.user .text').textContent") == \
                "What is the capital of France? Answer in English."
            # The live view saw the tokens go through.
            await page.wait_for("parseFloat(document.getElementById('stat-gen-tps').textContent) > 0", timeout=10)
            await page.screenshot(tmp_path / "playground.png")

            # Stop: a long answer ends at once, and the server drops the request.
            await page.eval("document.getElementById('max-tokens').value = '900'")
            await page.type_text("#prompt", "Write a very long story about a dragon.")
            await page.press_enter()
            last = "document.querySelectorAll('.msg.assistant')[1]"
            await page.wait_for(f"Number({last}?.dataset.chunks || 0) > 2")
            await page.eval("document.getElementById('stop').click()")
            assert await page.wait_for(f"{last}.dataset.done", timeout=10) == "stopped"
            assert await page.eval("document.getElementById('send').disabled") is False
            await page.screenshot(tmp_path / "playground-stopped.png")
        finally:
            await page.ws.close()
            await session.close()

    asyncio.run(scenario())
    deadline = time.monotonic() + 10
    while _running(base_url) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _running(base_url) == 0
    assert (tmp_path / "playground.png").stat().st_size > 10_000
