#!/usr/bin/env python3
"""Per-step breakdown of `kvbridge bench handshake --transport ucx` from its timeline
(RUST_LOG=kvbridge::timeline=debug, both processes' stderr in one file): each sample is cut
at the initiator's `dial`; the steps are the gaps between the marks below, medians [p10-p90]
in microseconds over the samples.

Usage: UCX_TLS=tcp KVBRIDGE_UCX_TRUSTED_FABRIC=1 RUST_LOG=kvbridge::timeline=debug kvbridge bench
handshake --transport ucx --peers 50 2>steps.log; python3 bench/ucx-handshake-steps.py steps.log"""
import re, sys, statistics as st
from datetime import datetime
rx = re.compile(r'^(\S+Z)\s+\w+\s+kvbridge::timeline: (.*)$')
samples, cur = [], None
for line in open(sys.argv[1], errors='replace'):
    line = re.sub(r'\x1b\[[0-9;]*m', '', line).rstrip('\n')
    m = rx.match(line)
    if not m:
        continue
    t = datetime.strptime(m.group(1), '%Y-%m-%dT%H:%M:%S.%fZ').timestamp() * 1e6
    what = m.group(2)
    if what.startswith('dial '):
        cur = []
        samples.append(cur)
    if cur is not None:
        cur.append((t, what))

def first(s, pat, after=0.0):
    for t, w in s:
        if t >= after and re.search(pat, w):
            return t, w
    return None, None

MARKS = [
    ('dial', r'^dial '),
    ('TCP connect', r'^control connected '),
    ('Hello -> Welcome', r'^received .*msg="Welcome"'),
    ('data connections, MemInfo, Ready', r'^established .*peer=bench-listener'),
    ('listener registers the region, UcxOffer', r'^received .*msg="UcxOffer"'),
    ('ucp_ep_create (initiator)', r'^ucx endpoint '),
    ('UcxAccept -> UcxMap', r'^received .*msg="UcxMap"'),
    ('rkey import', r'^ucx key imported '),
    ('UcxSync, settled, up', r'^up .*peer=bench-listener'),
    ('first 4 KiB write over UCX (put + flush)', r'^ucx batch .*dir=Write'),
]
rows = {name: [] for name, _ in MARKS[1:]}
extra = {'ucp_ep_create call': [], 'rkey import call': [], 'listener region export call': [],
         'first write batch': [], 'read batch after it': [], 'dial -> first write done': []}
for s in samples:
    ts, prev = [], 0.0
    ok = True
    for name, pat in MARKS:
        t, _ = first(s, pat, prev)
        if t is None:
            ok = False
            break
        ts.append(t)
        prev = t
    if not ok:
        continue
    for (name, _), a, b in zip(MARKS[1:], ts, ts[1:]):
        rows[name].append(b - a)
    extra['dial -> first write done'].append(ts[-1] - ts[0])
    for key, pat in [('ucp_ep_create call', r'^ucx endpoint .*took_us=(\d+)'),
                     ('rkey import call', r'^ucx key imported .*took_us=(\d+)'),
                     ('listener region export call', r'^ucx region exported .*took_us=(\d+)'),
                     ('first write batch', r'^ucx batch .*dir=Write.*took_us=(\d+)'),
                     ('read batch after it', r'^ucx batch .*dir=Read.*took_us=(\d+)')]:
        for t, w in s:
            m = re.search(pat, w)
            if m:
                extra[key].append(float(m.group(1)))
                break

def q(v, p):
    v = sorted(v)
    return v[min(len(v) - 1, int(p * (len(v) - 1) + 0.5))]

n = len(rows['TCP connect'])
print(f'{n} samples; microseconds, median [p10-p90]')
for name, v in list(rows.items()) + list(extra.items()):
    if v:
        print(f'{name:45s} {st.median(v):8.0f} [{q(v, .1):.0f}-{q(v, .9):.0f}]')
