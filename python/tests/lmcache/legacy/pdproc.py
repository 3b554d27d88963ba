"""Runs ``pd_role.py`` processes and LMCache's proxy-notification socket for the tests."""

from __future__ import annotations

import json
import os
import queue
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
ROLE = HERE / "pd_role.py"


def free_ports(n: int) -> list[int]:
    """Ports the kernel just handed out on 127.0.0.1 (closed again for the role to bind)."""
    socks, ports = [], []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
        ports.append(s.getsockname()[1])
    for s in socks:
        s.close()
    return ports


def write_config(path: Path, **keys) -> Path:
    """An LMCache YAML file: the two kvbridge lines plus the PD keys of one role."""
    lines = ['transfer_channel: "kvbridge"', 'pd_buffer_device: "cpu"', "enable_pd: true"]
    for k, v in keys.items():
        lines.append(f"{k}: {json.dumps(v)}")
    path.write_text("\n".join(lines) + "\n")
    return path


class Role:
    """One ``pd_role.py`` process: commands in, ``@@`` events out, everything else logged."""

    def __init__(self, role: str, config: Path, env: Optional[dict] = None, *args: str):
        full_env = dict(os.environ)
        full_env.update(env or {})
        full_env.setdefault("PYTHONUNBUFFERED", "1")
        self.role = role
        self.proc = subprocess.Popen(
            [sys.executable, str(ROLE), role, "--config", str(config), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=full_env,
        )
        self.events: "queue.Queue[dict]" = queue.Queue()
        self.log: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("@@ "):
                self.events.put(json.loads(line[3:]))
            else:
                self.log.append(line)

    def send(self, **cmd) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def expect(self, event: str, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{self.role}: no {event!r} within {timeout} s; log:\n{self.output()}")
            try:
                ev = self.events.get(timeout=min(left, 0.5))
            except queue.Empty:
                if self.proc.poll() is not None and self.events.empty():
                    raise AssertionError(
                        f"{self.role} exited ({self.proc.returncode}) before {event!r}; log:\n{self.output()}"
                    ) from None
                continue
            if ev.get("event") == "error":
                raise AssertionError(f"{self.role}: {ev}; log:\n{self.output()}")
            if ev.get("event") == event:
                return ev

    def output(self) -> str:
        return "".join(self.log[-200:])

    def stop(self) -> None:
        """Asks the process to end (it ``os._exit``s: LMCache's close() hangs); kills it after 10 s."""
        if self.proc.poll() is None:
            try:
                self.send(op="exit")
            except (BrokenPipeError, OSError):
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._reader.join(timeout=5)


class ProxySocket:
    """The proxy's ZMQ PULL socket, decoding what LMCache's sender pushes with LMCache's PDMsg."""

    def __init__(self, port: int):
        import msgspec
        import zmq
        from lmcache.v1.storage_backend.pd_backend_async import PDMsg

        self._decode = lambda b: msgspec.msgpack.decode(b, type=PDMsg)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PULL)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(f"tcp://127.0.0.1:{port}")
        self.port = port

    def collect(self, want: dict[str, int], timeout: float) -> dict[str, int]:
        """Receives until each request id in ``want`` was notified that many times."""
        import zmq

        got: dict[str, int] = {}
        deadline = time.monotonic() + timeout
        while any(got.get(r, 0) < n for r, n in want.items()):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            if self._sock.poll(timeout=int(min(left, 0.5) * 1000), flags=zmq.POLLIN):
                msg = self._decode(self._sock.recv())
                got[msg.req_id] = got.get(msg.req_id, 0) + 1
        return got

    def close(self) -> None:
        self._sock.close(0)
        self._ctx.term()
