"""Headless Chromium driven over the DevTools protocol, with a stdlib websocket client (no
browser-driver package needed): `with Browser(url, tmp) as page: page.eval("1 + 1")`."""

import base64
import json
import os
import shutil
import socket
import struct
import subprocess
import time
import urllib.request
from urllib.parse import urlparse

from serve_helpers import free_port

CHROMIUM = "/usr/bin/chromium"


def chromium_path() -> str | None:
    return CHROMIUM if os.access(CHROMIUM, os.X_OK) else shutil.which("chromium")


class WebSocket:
    """Just enough of RFC 6455 for DevTools: text frames, client-masked, unfragmented."""

    def __init__(self, url: str, timeout: float = 30):
        parts = urlparse(url)
        self.sock = socket.create_connection((parts.hostname, parts.port), timeout=timeout)
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall(
            (
                f"GET {parts.path} HTTP/1.1\r\nHost: {parts.netloc}\r\nUpgrade: websocket\r\n"
                f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                "Sec-WebSocket-Version: 13\r\n\r\n"
            ).encode()
        )
        head = b""
        while b"\r\n\r\n" not in head:
            head += self.sock.recv(1)
        assert head.startswith(b"HTTP/1.1 101"), head

    def send(self, text: str) -> None:
        data = text.encode()
        mask = os.urandom(4)
        n = len(data)
        if n < 126:
            header = struct.pack("!BB", 0x81, 0x80 | n)
        elif n < 1 << 16:
            header = struct.pack("!BBH", 0x81, 0x80 | 126, n)
        else:
            header = struct.pack("!BBQ", 0x81, 0x80 | 127, n)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(data))
        self.sock.sendall(header + mask + masked)

    def _read(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            assert chunk, "DevTools closed the connection"
            out += chunk
        return out

    def recv(self) -> str:
        message = b""
        while True:
            first, second = self._read(2)
            n = second & 0x7F
            if n == 126:
                n = struct.unpack("!H", self._read(2))[0]
            elif n == 127:
                n = struct.unpack("!Q", self._read(8))[0]
            message += self._read(n)
            if first & 0x80:  # FIN
                return message.decode()

    def close(self) -> None:
        self.sock.close()


class Browser:
    """Chromium, headless, on `url`; `eval` runs JavaScript in the page (awaiting promises)."""

    def __init__(self, url: str, profile_dir, width: int = 900, height: int = 700, extra_args=()):
        self.port = free_port()
        self.process = subprocess.Popen(
            [
                chromium_path(),
                "--headless=new",
                "--no-sandbox",  # CI runs as root, where Chromium's sandbox refuses to start
                "--disable-gpu",
                "--no-first-run",
                f"--remote-debugging-port={self.port}",
                f"--user-data-dir={profile_dir}",
                f"--window-size={width},{height}",
                *extra_args,
                url,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.next_id = 0
        self.events: list[dict] = []  # DevTools events seen while waiting for answers

    def __enter__(self) -> "Browser":
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/json/list") as r:
                    pages = [t for t in json.load(r) if t["type"] == "page"]
                if pages:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "Chromium's DevTools did not come up"
            time.sleep(0.2)
        self.ws = WebSocket(pages[0]["webSocketDebuggerUrl"])
        return self

    def __exit__(self, *exc):
        self.ws.close()
        self.process.terminate()
        self.process.wait(timeout=20)

    def call(self, method: str, **params) -> dict:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:  # skip events until our answer
            message = json.loads(self.ws.recv())
            if message.get("id") == self.next_id:
                assert "error" not in message, message
                return message["result"]
            if "method" in message:
                self.events.append(message)

    def eval(self, expression: str):
        result = self.call(
            "Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True
        )
        assert "exceptionDetails" not in result, result["exceptionDetails"]
        return result["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 60):
        """Poll `expression` until it is truthy in JavaScript."""
        deadline = time.monotonic() + timeout
        while not self.eval(f"!!({expression})"):
            assert time.monotonic() < deadline, f"timed out waiting for {expression}"
            time.sleep(0.1)

    def events_of(self, method: str) -> list[dict]:
        """The params of the events `method` seen so far (enable its domain first)."""
        return [e["params"] for e in self.events if e["method"] == method]

    def screenshot(self, path) -> None:
        data = self.call("Page.captureScreenshot", format="png")["data"]
        with open(path, "wb") as f:
            f.write(base64.b64decode(data))
