"""`medusa serve` as users start it: a subprocess on a free loopback port (the soak and the browser tests)."""

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx


@contextlib.contextmanager
def medusa_serve(*args: str):
    """`medusa serve` in a subprocess on a free loopback port, one torch thread -> (its URL, its pid). Its log goes
    to a file (a pipe nobody reads would fill and stop it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    log = tempfile.TemporaryFile("w+")
    process = subprocess.Popen([sys.executable, "-m", "medusa_decoding.cli", "serve", "--port", str(port), *args],
                               stdout=log, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600  # a cold cache converts the model and builds the kernels
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise RuntimeError(f"medusa serve did not start: {log.read()[-3000:]}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            time.sleep(0.5)
        yield url, process.pid
    finally:
        process.terminate()
        process.wait(timeout=60)
        log.close()
