"""bench/sglang_pd.py's summary: per backend and front, the transfer time and its tail (the
transfer timer's spans, every timed request of every run), TTFT; then kvbridge's ratio to the
best of the other backends behind the same router, per run, as the median of the runs' ratios
with their spread (the issue's goal: transfer time at most 0.5x, TTFT no worse)."""

from __future__ import annotations

import statistics

#: (metric, the spans' or samples' key, the issue's goal for kvbridge / best of the others)
METRICS = (("transfer", "transfer_s", 0.5), ("tail", "tail_s", None), ("TTFT", None, 1.0))


def values(m: dict, key: str | None) -> list[float]:
    """One front's timed requests' values of ``key`` in ms (``None``: TTFT)."""
    if key is None:
        return [v * 1e3 for v in m["samples"]]
    return [sp[key] * 1e3 for sp in m["spans"] if key in sp]


def p50_range(vals: list[float]) -> str:
    if not vals:
        return "n/a"
    return f"{statistics.median(vals):.1f} ({min(vals):.1f}-{max(vals):.1f}, {len(vals)})"


def rows(names: list[str], results: dict[str, list[dict]]) -> list[tuple[str, str]]:
    fronts = []
    for name in names:
        for front in results[name][0]["fronts"] if results[name] else ():
            fronts.append((name, front))
    return fronts


def print_tables(names: list[str], results: dict[str, list[dict]]) -> None:
    print("\n| backend | front | transfer ms, metadata to Success, p50 (min-max, n) | tail ms, last chunk handed "
          "over to Success, p50 (min-max, n) | TTFT ms p50, every request (min-max, n) | TTFT p50, median of runs "
          "(runs' min-max) |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name, front in rows(names, results):
        runs = [r["fronts"][front] for r in results[name]]
        every = {key: [v for m in runs for v in values(m, key)] for _, key, _ in METRICS}
        p50s = [statistics.median(values(m, None)) for m in runs]
        print(f"| {name} | {front} | {p50_range(every['transfer_s'])} | {p50_range(every['tail_s'])} "
              f"| {p50_range(every[None])} | {statistics.median(p50s):.1f} ({min(p50s):.1f}-{max(p50s):.1f}) |")  # fmt: skip
    print("\nparts of the transfer span (the timer's events on both servers), p50 (min-max, n) in ms over every "
          "timed request:")  # fmt: skip
    print("| backend | front | metadata to the prefill's first chunk handed over | first to last chunk (compute, "
          "transfers overlapping) | last chunk to Success (tail) | decode polls from metadata to Success |")  # fmt: skip
    print("|---|---|---|---|---|---|")
    for name, front in rows(names, results):
        runs = [r["fronts"][front] for r in results[name]]
        cells = [p50_range([v for m in runs for v in values(m, k)]) for k in ("to_first_chunk_s", "chunks_s", "tail_s")]
        polls = [float(sp["polls"]) for m in runs for sp in m["spans"]]
        print(f"| {name} | {front} | {' | '.join(cells)} | {p50_range(polls)} |")
    others = [n for n in names if n != "kvbridge" and results[n]]
    if "kvbridge" not in names or not others:
        return
    print("\nkvbridge / best of the others behind SGLang's router (" + ", ".join(others) + "), per run the ratio of "
          "its p50 to the lowest other backend's p50, median of the runs' ratios (min-max):")  # fmt: skip
    for front in results["kvbridge"][0]["fronts"]:
        cells = []
        for metric, key, goal in METRICS:
            ratios = run_ratios(results, others, front, key)
            if not ratios:
                continue
            med = statistics.median(ratios)
            verdict = "" if goal is None else f", goal <= {goal}: {'met' if med <= goal else 'MISSED'}"
            cells.append(f"{metric} {med:.3f} ({min(ratios):.3f}-{max(ratios):.3f}){verdict}")
        print(f"- kvbridge via {front}: " + "; ".join(cells))


def run_ratios(results: dict[str, list[dict]], others: list[str], front: str, key: str | None) -> list[float]:
    """Per run: kvbridge's p50 through ``front`` over the lowest p50 of the other backends
    (through SGLang's router) in the same run."""
    out = []
    for i, r in enumerate(results["kvbridge"]):
        mine = values(r["fronts"][front], key)
        theirs = [values(results[n][i]["fronts"]["router"], key) for n in others if i < len(results[n])]
        theirs = [statistics.median(v) for v in theirs if v]
        if mine and theirs:
            out.append(statistics.median(mine) / min(theirs))
    return out
