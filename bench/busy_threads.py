#!/usr/bin/env python3
"""Which threads of running processes burn CPU, on which cores, and in what code.

    python3 bench/busy_threads.py --match 'REGEX' [--window 5] [--perf 3] [--every 30] [--count 4]

Every ``--every`` seconds, ``--count`` times at most (and only while a process whose command
line matches REGEX runs): each thread of those processes, its CPU seconds over ``--window``
seconds (from /proc/PID/task/TID/stat), the cores it may run on and its state; then, for each
thread that ran more than half the window, its hottest functions over ``--perf`` seconds
(``perf record -t TID``, user and kernel symbols; needs perf and the right to trace) and,
for a Python thread, its Python stack (``py-spy dump``, when py-spy is on PATH). Used
while bench/vllm-pd.sh runs, e.g. ``--match 'NixlConnector.*kv_producer'`` for a
NixlConnector prefiller (its vLLM server and its engine and worker processes share the
command line's process group)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def groups(pattern: re.Pattern) -> set[int]:
    """The process groups of the processes whose command line matches."""
    out = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if pattern.search(cmd) and int(pid) != os.getpid():
                out.add(os.getpgid(int(pid)))
        except OSError:
            continue
    return out


def threads(pgids: set[int]) -> dict[tuple[int, int], tuple[str, str, str, float]]:
    """(pid, tid) -> (name, allowed cores, state, CPU seconds so far) for every thread of
    every process in ``pgids``."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(pid)) not in pgids:
                continue
            for tid in os.listdir(f"/proc/{pid}/task"):
                base = f"/proc/{pid}/task/{tid}"
                name = Path(f"{base}/comm").read_text().strip()
                status = Path(f"{base}/status").read_text()
                cores = re.search(r"^Cpus_allowed_list:\s*(\S+)", status, re.M)
                fields = Path(f"{base}/stat").read_text().rsplit(")", 1)[1].split()
                cpu = (int(fields[11]) + int(fields[12])) / TICK
                out[(int(pid), int(tid))] = (name, cores.group(1) if cores else "?", fields[0], cpu)
        except (OSError, ValueError, IndexError):
            continue  # ended meanwhile
    return out


def hottest(tid: int, seconds: float, top: int = 8) -> list[str]:
    with tempfile.TemporaryDirectory() as d:
        data = os.path.join(d, "perf.data")
        rec = subprocess.run(
            ["perf", "record", "-q", "-t", str(tid), "-o", data, "--", "sleep", str(seconds)],
            capture_output=True, text=True, timeout=seconds + 60,
        )  # fmt: skip
        if rec.returncode != 0:
            return [f"perf record failed: {rec.stderr.strip()[-300:]}"]
        rep = subprocess.run(
            ["perf", "report", "-i", data, "--stdio", "--no-children", "--sort", "dso,sym"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    lines = [line for line in rep.stdout.splitlines() if line.strip() and not line.startswith("#")]
    return lines[:top]


def python_stack(pid: int, tid: int) -> list[str]:
    """The thread's Python stack from ``py-spy dump`` (nothing for a thread without Python)."""
    try:
        out = subprocess.run(
            ["py-spy", "dump", "--pid", str(pid), "--nonblocking"], capture_output=True, text=True, timeout=60
        ).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return [f"py-spy: {e}"]
    stanzas = re.split(r"\n(?=Thread )", out)
    mine = [st for st in stanzas if re.match(rf"Thread (0x[0-9A-Fa-f]+ )?\(?{tid}\b", st) or f"tid {tid}" in st]
    return mine[0].splitlines()[:12] if mine else []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--match", required=True)
    ap.add_argument("--window", type=float, default=5)
    ap.add_argument("--perf", type=float, default=3)
    ap.add_argument("--every", type=float, default=30)
    ap.add_argument("--count", type=int, default=4)
    ap.add_argument("--wait", type=float, default=1800, help="seconds to wait for a match at most")
    a = ap.parse_args()
    pattern = re.compile(a.match)
    deadline = time.monotonic() + a.wait
    done = 0
    while done < a.count and time.monotonic() < deadline:
        pg = groups(pattern)
        if not pg:
            time.sleep(1)
            continue
        before = threads(pg)
        t0 = time.monotonic()
        time.sleep(a.window)
        after = threads(pg)
        window = time.monotonic() - t0  # reading /proc takes a while on a busy host
        done += 1
        load = " ".join(Path("/proc/loadavg").read_text().split()[:3])
        stamp = time.strftime("%H:%M:%S", time.gmtime())
        print(f"## {stamp} UTC, process groups {sorted(pg)}, load {load}, CPU s over {window:.1f} s:", flush=True)
        busy = []
        used_by = {key: t[3] - before.get(key, t)[3] for key, t in after.items()}
        for key, used in sorted(used_by.items(), key=lambda kv: -kv[1]):
            name, cores, state, cpu = after[key]
            if used > 0.01:
                print(f"pid {key[0]} tid {key[1]} {name}@{cores} state {state}: {used:.2f} (total {cpu:.1f})", flush=True)
            if used > window / 2:
                busy.append((key[0], key[1], name))
        for pid, tid, name in busy:
            print(f"# tid {tid} {name}, hottest over {a.perf} s:", flush=True)
            for line in hottest(tid, a.perf) + python_stack(pid, tid):
                print(f"#   {line}", flush=True)
        time.sleep(max(0.0, a.every - a.window))


if __name__ == "__main__":
    main()
