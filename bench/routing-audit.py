#!/usr/bin/env python3
"""Per-request attribution of the prefill tokens one `kvbridge demo --workload shared-prefix`
run computed, against an oracle router.

Usage:
  RUST_LOG=kvbridge::prefix=debug kvbridge demo --workload shared-prefix ... 2>run.log
  bench/routing-audit.py run.log [CHUNK_TOKENS (256)] [-v]

The log holds, per workload request, its prompt's length, last token and whole-chunk hashes
(`workload`), and per engine prefill and per KV received, the engine, the prompt's length and
last token and the tokens its prefix cache held (`prefill`, `received`). A prefill is matched
to the first workload request with its length and last token not yet matched (the
one-at-a-time replays after the workload come after it and are left out).

The oracle puts every request where its longest earlier prompt is cached, in one cache that
never evicts: it computes `oracle_prefill_tokens` of the demo's JSON. Each chunk a request
computed beyond the oracle falls in one of:
  evicted     the engine that computed it had stored that prefix before (prefill or KV
              received) and no longer held it;
  elsewhere   another engine had stored more of it: the path (PD prefiller, decoder alone)
              and which kind of engine held it (P prefiller, D decoder) are named;
  not stored  no engine had stored it yet (its earlier prompt was still being prefilled);
Per engine, the first request also computes the prefix every prompt shares (the system
prompt), which the oracle counts once: the line `first on each engine` says how much.
"""
import collections
import re
import sys

args = [a for a in sys.argv[1:] if a != "-v"]
verbose = "-v" in sys.argv
chunk = int(args[1]) if len(args) > 1 else 256
line_re = re.compile(r"DEBUG\s+kvbridge::prefix: (\w+) (.*)$")
field_re = re.compile(r'(\w+)=("[^"]*"|\S+)')

work, events = {}, []
for raw in open(args[0]):
    m = line_re.search(re.sub(r"\x1b\[[0-9;]*m", "", raw.rstrip()))
    if not m:
        continue
    f = {k: v.strip('"') for k, v in field_re.findall(m.group(2))}
    f["kind"] = m.group(1)
    if f["kind"] == "workload":
        work[int(f["request"])] = f
    else:
        events.append(f)
if not work:
    sys.exit("no `workload` lines: run the demo with RUST_LOG=kvbridge::prefix=debug")
reqs = [work[i] for i in sorted(work)]
chains = [r["chunks"].split(".") if r.get("chunks") else [] for r in reqs]
by_key = collections.defaultdict(list)
for i, r in enumerate(reqs):
    by_key[(r["tokens"], r.get("last"))].append(i)


def common_chunks(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


held = collections.defaultdict(list)  # engine -> requests whose prompt it stored
roles, seen, rows = {}, set(), []
for e in events:
    cand = by_key.get((e["tokens"], e.get("last")), [])
    if "role" in e:
        roles[e["engine"]] = e["role"][0]
    if e["kind"] == "received":
        if cand:
            held[e["engine"]].append(cand[0])
        continue
    i = next((c for c in cand if c not in seen), None)
    if i is None:
        continue
    seen.add(i)
    c = chains[i]
    here = max((common_chunks(c, chains[j]) for j in held[e["engine"]]), default=0)
    best, best_eng = 0, None
    for eng, js in held.items():
        v = max((common_chunks(c, chains[j]) for j in js), default=0)
        if v > best:
            best, best_eng = v, eng
    rows.append(dict(request=i, engine=e["engine"], first=not held[e["engine"]],
                     pd=e.get("sending") == "true", tokens=int(e["tokens"]),
                     oracle=int(reqs[i]["lcp"]) // chunk, cached=int(e["cached"]) // chunk,
                     here=here, anywhere=best, best_engine=best_eng))
    held[e["engine"]].append(i)

common = min((common_chunks(chains[0], c) for c in chains[1:]), default=0)
loss = collections.Counter()
for r in rows:
    o, c = r["oracle"], r["cached"]
    h, a = min(r["here"], o), min(r["anywhere"], o)
    if r["first"]:
        first = max(0, min(common, o) - c)
        loss["first on each engine (the common prefix)"] += first
        c += first
    ev = max(0, h - c)
    el = max(0, a - max(h, c))
    ns = max(0, o - max(a, h, c))
    path = "PD prefiller" if r["pd"] else "decoder alone"
    holder = roles.get(r["best_engine"], "D")  # an engine seen only receiving is a decoder
    loss["evicted"] += ev
    loss[f"elsewhere: {path}, held on a {'prefiller' if holder == 'P' else 'decoder'}"] += el
    loss["not stored yet"] += ns
    if verbose and (ev or el or ns):
        print(r, "evicted", ev, "elsewhere", el, "not stored", ns)
computed = sum(r["tokens"] - r["cached"] * chunk for r in rows)
oracle = sum(r["tokens"] - r["oracle"] * chunk for r in rows)
print(f"requests {len(rows)}; engines {len(held)}; computed {computed}; oracle {oracle}; "
      f"beyond the oracle {computed - oracle} tokens")
for k, v in sorted(loss.items()):
    if v:
        print(f"  {k}: {v * chunk} tokens")
