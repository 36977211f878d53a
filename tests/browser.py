"""Headless Chromium for browser tests (Debian's chromium and chromium-driver, driven by Selenium), and a page server."""

from __future__ import annotations

import contextlib
import http.server
import os
import shutil
import threading
from pathlib import Path
from typing import Callable, Iterator

import pytest

CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1280,1050")


def _find(*names: str) -> str | None:
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    return None


@contextlib.contextmanager
def chromium(profile_dir: Path, extra_flags: tuple[str, ...] = ()) -> Iterator[object]:
    """A fresh headless Chromium; skips the test (one line) where the browser cannot be had."""
    browser, driver = _find("chromium", "chromium-browser"), _find("chromedriver")
    if browser is None or driver is None:
        pytest.skip("needs Debian's chromium and chromium-driver (scripts/setup.sh installs them when run as root)")
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("needs selenium (pip install -e '.[test]')")
    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile_dir}", *extra_flags):
        options.add_argument(flag)
    # An explicit driver path keeps Selenium Manager from looking for a driver download.
    service = Service(executable_path=driver, env={**os.environ, "SE_AVOID_STATS": "true"})
    drv = webdriver.Chrome(options=options, service=service)
    drv.set_script_timeout(60)
    drv.set_page_load_timeout(30)
    try:
        yield drv
    finally:
        drv.quit()


@contextlib.contextmanager
def serve_pages(pages: dict[str, Callable[[], bytes]]) -> Iterator[int]:
    """An HTTP server on 127.0.0.1 (a free port) answering GET path -> page(); yields the port."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            page = pages.get(self.path.split("?")[0])
            body = page() if page else b"not here"
            self.send_response(200 if page else 404)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
