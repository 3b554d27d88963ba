#!/usr/bin/env python3
"""Fails when a module of a crate imports from a module that (directly or through others)
imports it back: the modules of each crate must form layers, every import pointing down.

A module is a file: `src/datapath/pending.rs` is `datapath::pending`, `src/datapath/mod.rs`
is `datapath`, so a folder may hold layers of its own (`transport::tcp::writer` may import
`datapath::pending` while `datapath` imports `transport::shm`). An import is a path outside
`#[cfg(test)]` modules: `crate::a::b` (the longest prefix that is a module), `super::` and
`self::` relative to the file's module, and a child module's name used as a path's head in
its parent. A name that a module re-exports (`pub use child::Name`, `pub(crate) use ...`)
counts as an import of the module that defines it; a name the crate root defines itself is
the root, which is the bottom layer (declaring modules and re-exporting them are not
imports). A glob (`use super::*`) imports the module it names.

With `--enclosing` it also fails when a module looks a name up in a module that encloses
it (`crate::name` for a name the crate root defines or re-exports, `super::Name`,
`use super::*`): a module's parent is above it, and reaching back up through it hides which
layer a name comes from.

Usage: scripts/check-layers.py [--graph] [--enclosing] [CRATE_DIR...]   (default: every crate in
crates/ and python/)

ALLOWED_LOOPS names known loops that are to be cut; a crate listed there fails if its loop
grows or another appears, and the check asks for the entry's removal once the loop is gone.
"""

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# crate dir -> the modules of the one loop it is allowed to have while it is being cut; any
# other loop, or this one grown, fails.
ALLOWED_LOOPS = {}

CFG_TEST_RE = re.compile(r"#\[cfg\((?:test|all\(test,[^\]]*\))\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+\w+\s*\{")


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
    """Module path -> file, for every `.rs` file under `src/` (binaries in `src/bin` aside)."""
    mods = {}
    for dp, dirs, fs in os.walk(src_dir):
        rel = os.path.relpath(dp, src_dir)
        if rel == "bin" or rel.startswith("bin" + os.sep):
            continue
        parts = [] if rel == "." else rel.split(os.sep)
        for f in fs:
            if not f.endswith(".rs"):
                continue
            if not parts and f in ("lib.rs", "main.rs"):
                continue
            name = parts + ([] if f == "mod.rs" else [f[:-3]])
            mods["::".join(name)] = os.path.join(dp, f)
    return mods


REEXPORT_RE = re.compile(
    r"pub(?:\([^)]*\))?\s+use\s+((?:(?:self|super|crate)::)?(?:[a-z_][a-z0-9_]*::)*)"
    r"(\{[^}]*\}|[A-Za-z_][A-Za-z0-9_]*)")


def reexports(mod, src, mods):
    """Name -> defining module for the `pub use` / `pub(crate) use` re-exports of `mod`."""
    names = {}
    for m in REEXPORT_RE.finditer(src):
        prefix, what = m.group(1).rstrip(":"), m.group(2)
        target = resolve(mod, prefix.split("::") if prefix else [], mods, {})
        if target is None:
            continue
        for n in re.findall(r"([A-Za-z_][A-Za-z0-9_]*)(?:\s+as\s+([A-Za-z_][A-Za-z0-9_]*))?",
                            what.strip("{}")):
            if n[0] in ("self",):
                continue
            names[n[1] or n[0]] = target
    return names


def path_start(base, segs, mods):
    """Where a path's lookup starts, seen from module `base` (a list of names): the module
    its first segment names and the segments after it, or None for a path that leaves the
    crate."""
    head = segs[0]
    if head == "crate":
        return [], segs[1:]
    if head == "super":
        cur, rest = base[:-1], segs[1:]
        while rest and rest[0] == "super":
            cur, rest = cur[:-1], rest[1:]
        return cur, rest
    if head == "self":
        return base, segs[1:]
    if "::".join(base + [head]) in mods:
        return base, segs
    return None


def walk(base, segs, mods):
    """The longest prefix of a path that is a module (`"a::b"`, `""` the root) and the
    segment after it (None when the whole path is a module), or None for a path that
    leaves the crate."""
    start = path_start(base, segs, mods)
    if start is None:
        return None
    cur, rest = start
    for x in rest:
        if "::".join(cur + [x]) not in mods:
            return "::".join(cur), x
        cur = cur + [x]
    return "::".join(cur), None


def resolve(mod, segs, mods, reexp):
    """The module a path names, seen from module `mod` (`""` is the root): the longest prefix
    of the path that is a module, or the module that re-exports the next name."""
    base = [] if mod == "" else mod.split("::")
    segs = [x for x in segs if x]
    if not segs:
        return mod if mod in mods or mod == "" else None
    walked = walk(base, segs, mods)
    if walked is None:
        return None
    name, x = walked
    return reexp.get(name, {}).get(x, name) if x is not None else name


def looked_up_in(mod, segs, mods):
    """The module in which a path looks up its first name that is not a module (`""` is the
    root), or None for a path that names a module itself or leaves the crate."""
    base = [] if mod == "" else mod.split("::")
    glob = bool(segs) and segs[-1] == "*"
    segs = [x for x in segs if x and x != "*"]
    if not segs:
        return None
    walked = walk(base, segs, mods)
    if walked is None:
        return None
    name, x = walked
    # A path that names a module looks names up there only as a glob.
    return name if x is not None or glob else None


def encloses(outer, mod):
    """Whether module `outer` encloses module `mod` (the root encloses every module)."""
    return outer == "" or mod.startswith(outer + "::")


PATH_ANY_RE = re.compile(
    r"(?<![A-Za-z0-9_:])((?:crate|super|self|[a-z_][a-z0-9_]*)(?:::(?:[A-Za-z_][A-Za-z0-9_]*|\*))+"
    r"|(?:crate|super|self|[a-z_][a-z0-9_]*)(?:::[A-Za-z_][A-Za-z0-9_]*)*::\{[^}]*\})")


# (module, the enclosing module it looks a name up in, the path), filled by `graph`.
enclosing = set()


def graph(crate_dir):
    src_dir = os.path.join(crate_dir, "src")
    root = next((os.path.join(src_dir, f) for f in ("lib.rs", "main.rs")
                 if os.path.exists(os.path.join(src_dir, f))), None)
    if root is None:
        return {}
    mods = modules_of(src_dir)
    texts = {m: strip_comments_and_tests(open(f).read()) for m, f in mods.items()}
    texts[""] = strip_comments_and_tests(open(root).read())
    reexp = {m: reexports(m, t, mods) for m, t in texts.items()}
    edges = {m: set() for m in mods}
    enclosing.clear()
    for mod in mods:
        # A re-export is the module's face, not a use of what it re-exports.
        body = re.sub(r"pub(?:\([^)]*\))?\s+use\s[^;]*;", "", texts[mod])
        for m in PATH_ANY_RE.finditer(body):
            path = m.group(1)
            if "{" in path:
                prefix, inner = path.split("{", 1)
                prefix = [x for x in prefix.split("::") if x]
                heads = [prefix + [x for x in h.strip().split(" ")[0].split("::") if x]
                         for h in inner.rstrip("}").split(",") if h.strip()]
            else:
                heads = [[x for x in path.split("::") if x]]
            for segs in heads:
                outer = looked_up_in(mod, segs, mods)
                if outer is not None and encloses(outer, mod):
                    enclosing.add((mod, outer or "crate root", "::".join(segs)))
                segs = [x for x in segs if x != "*"]
                target = resolve(mod, segs, mods, reexp)
                if target is None or target == mod or target == "":
                    continue
                # A module declaring its children is not an import of them; using them is.
                if target in mods:
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
    # Not yet in CI: the modules that still look names up in an enclosing one are listed
    # by `--enclosing` until none is left (issue 40).
    check_enclosing = "--enclosing" in argv
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
        if check_enclosing:
            for mod, outer, path in sorted(enclosing):
                failed = True
                print(f"{crate}: {mod} imports from an enclosing module ({outer}): {path}")
        for comp in allowed:
            failed = True
            print(f"{crate}: the loop {' <-> '.join(sorted(comp))} is gone or changed: "
                  "update ALLOWED_LOOPS in scripts/check-layers.py")
    if failed:
        print("check-layers: FAILED (an import points up a layer)")
        return 1
    known = " (besides the known loops listed)" if ALLOWED_LOOPS else ""
    print(f"check-layers: {len(targets)} crates, every import points down{known}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
