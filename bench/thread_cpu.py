#!/usr/bin/env python3
"""CPU time and run-queue wait per thread name of a command and its child processes.

    python3 bench/thread_cpu.py [--timeout S] -- COMMAND...

e.g. (one block size, so the data threads' figures belong to one measurement):

    UCX_TLS=tcp KVBRIDGE_UCX_TRUSTED_FABRIC=1 python3 bench/thread_cpu.py -- \\
        target/release/kvbridge bench transfer \\
        --transport ucx --block-sizes 65536 --batch 16 --inflight 2 --total 1G --reps 1 --json

Runs COMMAND, samples /proc/PID/task/TID/schedstat (time on a CPU, time runnable but waiting
for one, time slices) of the command and every descendant every 10 ms, and prints the
command's stdout, then per process and thread name the last sample of its threads summed.
Threads that end between two samples lose their last 10 ms; what exits first is not missed
(a thread's counters only grow). Linux only. The command is killed after --timeout seconds
(default 600) and the script fails.
"""
import argparse
import collections
import os
import subprocess
import sys
import time


def descendants(root):
    """The pids of `root` and every process below it."""
    parent = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                # The name may hold spaces and parentheses: the ppid follows the last ')'.
                parent[int(pid)] = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    found, frontier = {root}, [root]
    while frontier:
        p = frontier.pop()
        for c, pp in parent.items():
            if pp == p and c not in found:
                found.add(c)
                frontier.append(c)
    return found


def sample(pids, last):
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    comm = f.read().strip()
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    run, wait, slices = map(int, f.read().split())
            except (OSError, ValueError):
                continue
            last[(pid, tid)] = (comm, run, wait, slices)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    cmd = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not cmd:
        ap.error("no command")
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE)
    last = {}
    end = time.monotonic() + a.timeout
    while p.poll() is None:
        if time.monotonic() > end:
            p.kill()
            p.wait()
            sys.exit(f"thread_cpu.py: {cmd[0]} ran past {a.timeout} s")
        sample(descendants(p.pid), last)
        time.sleep(0.01)
    out = p.stdout.read().decode()
    sys.stdout.write(out)
    if p.returncode != 0:
        sys.exit(f"thread_cpu.py: {cmd[0]} exited with {p.returncode}")
    agg = collections.defaultdict(lambda: [0, 0, 0, 0])
    for (pid, _), (comm, run, wait, slices) in last.items():
        t = agg[(pid, comm)]
        t[0] += run
        t[1] += wait
        t[2] += slices
        t[3] += 1
    print("pid      thread name       threads  cpu ms  run-queue wait ms  slices")
    for (pid, comm), (run, wait, slices, n) in sorted(agg.items()):
        print(f"{pid:<8} {comm:<17} {n:>7} {run / 1e6:>7.1f} {wait / 1e6:>18.1f} {slices:>7}")


if __name__ == "__main__":
    main()
