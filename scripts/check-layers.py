#!/usr/bin/env python3
"""Fails when a module of a crate imports from a module that (directly or through others)
imports it back: the modules of each crate must form layers, every import pointing down.

A module is a top-level file or folder of `src/` (`src/kv_events/` is `kv_events`). An import
is any `crate::NAME` path outside `#[cfg(test)]` modules; a name that the crate root
re-exports (`pub use module::Name`) counts as an import of `module`, and a name the root
defines itself as an import of the root, which is the bottom layer (declaring modules and
re-exporting them are not imports).

Usage: scripts/check-layers.py [--graph] [CRATE_DIR...]   (default: every crate in
crates/ and python/ that is not listed in ALLOWED_LOOPS with its current loop)

ALLOWED_LOOPS names known loops that are to be cut (none today: every crate is loop-free); a
crate listed there fails if its loop grows or another appears, and the check asks for the
entry's removal once the loop is gone.
"""

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# crate dir -> the modules of the one loop it is allowed to have while it is being cut; any
# other loop, or this one grown, fails.
ALLOWED_LOOPS = {}

PATH_RE = re.compile(r"\bcrate::(?:\{([^}]*)\}|([A-Za-z_][A-Za-z0-9_]*))")
CFG_TEST_RE = re.compile(r"#\[cfg\(test\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+\w+\s*\{")


def strip_comments_and_tests(src):
    """Drops line comments (doc comments included: a doc link is not an import) and the
    bodies of `#[cfg(test)] mod x { ... }`."""
    src = re.sub(r"//[^\n]*", "", src)
    out = []
    i = 0
    while True:
        m = CFG_TEST_RE.search(src, i)
        if not m:
            out.append(src[i:])
            break
        out.append(src[i:m.start()])
        depth = 1
        j = m.end()
        while j < len(src) and depth:
            if src[j] == "{":
                depth += 1
            elif src[j] == "}":
                depth -= 1
            j += 1
        i = j
    return "".join(out)


def modules_of(src_dir):
    mods = {}
    for entry in sorted(os.listdir(src_dir)):
        p = os.path.join(src_dir, entry)
        if entry in ("lib.rs", "main.rs"):
            continue
        if entry.endswith(".rs"):
            mods[entry[:-3]] = [p]
        elif os.path.isdir(p) and entry != "bin":
            files = []
            for dp, _, fs in os.walk(p):
                files += [os.path.join(dp, f) for f in fs if f.endswith(".rs")]
            mods[entry] = sorted(files)
    return mods


def root_reexports(root_src):
    """Name -> module for the root's `pub use module::...` re-exports."""
    names = {}
    for m in re.finditer(r"pub\s+use\s+([a-z_][a-z0-9_]*)::(\{[^}]*\}|[A-Za-z_][A-Za-z0-9_]*)",
                         root_src):
        module, what = m.group(1), m.group(2)
        for n in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)(?:\s+as\s+([A-Za-z_][A-Za-z0-9_]*))?",
                            what.strip("{}")):
            names[n[1] or n[0]] = module
    return names


def graph(crate_dir):
    src_dir = os.path.join(crate_dir, "src")
    root = next((os.path.join(src_dir, f) for f in ("lib.rs", "main.rs")
                 if os.path.exists(os.path.join(src_dir, f))), None)
    if root is None:
        return {}
    mods = modules_of(src_dir)
    reexp = root_reexports(open(root).read())
    edges = {m: set() for m in mods}
    for mod, files in mods.items():
        for f in files:
            text = strip_comments_and_tests(open(f).read())
            for m in PATH_RE.finditer(text):
                heads = [m.group(2)] if m.group(2) else [
                    h.strip().split("::")[0].split(" ")[0] for h in m.group(1).split(",")]
                for h in heads:
                    if not h or h in ("self",):
                        continue
                    target = h if h in mods else reexp.get(h, "<root>")
                    if target != mod and target in mods:
                        edges[mod].add(target)
    return edges


def loops(edges):
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                on.discard(w)
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(comp)

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def crates():
    found = []
    for base in ("crates", "python"):
        d = os.path.join(ROOT, base)
        if base == "python":
            if os.path.isdir(os.path.join(d, "src")):
                found.append("python")
            continue
        for c in sorted(os.listdir(d)):
            if os.path.isdir(os.path.join(d, c, "src")):
                found.append(f"{base}/{c}")
    return found


def main(argv):
    show = "--graph" in argv
    targets = [a.rstrip("/") for a in argv if not a.startswith("--")] or crates()
    failed = False
    for crate in targets:
        edges = graph(os.path.join(ROOT, crate))
        if show:
            for m in sorted(edges):
                print(f"{crate}: {m} -> {', '.join(sorted(edges[m])) or '-'}")
        allowed = [ALLOWED_LOOPS[crate]] if crate in ALLOWED_LOOPS else []
        for comp in loops(edges):
            if comp in allowed:
                allowed.remove(comp)
                print(f"{crate}: known loop, to be cut: {' <-> '.join(sorted(comp))}")
                continue
            failed = True
            print(f"{crate}: modules import each other in a loop: "
                  f"{' <-> '.join(sorted(comp))}")
            for m in sorted(comp):
                back = sorted(edges[m] & comp)
                print(f"    {m} imports {', '.join(back)}")
        for comp in allowed:
            failed = True
            print(f"{crate}: the loop {' <-> '.join(sorted(comp))} is gone or changed: "
                  "update ALLOWED_LOOPS in scripts/check-layers.py")
    if failed:
        print("check-layers: FAILED (an import points up a layer)")
        return 1
    print(f"check-layers: {len(targets)} crates, every import points down "
          "(besides the known loops listed)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
