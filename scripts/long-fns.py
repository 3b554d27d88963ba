#!/usr/bin/env python3
"""Lists the functions of non-test Rust code longer than 120 lines, and fails when one has no
comment saying why it must be one function.

Non-test code is every `.rs` file under `crates/*/src` and `python/src`, less the bodies of
`#[cfg(test)]` modules and the functions marked `#[test]` (or `#[tokio::test]`, ...). A
function's length is its lines from the one holding `fn` to its closing brace; a function
nested in another counts in both. A long function is justified by a line comment among the
comments and attributes right above it that starts `long-fn:` and says why:

    // long-fn: one match over every message, each arm a line or two; split, the arms would
    // be read apart from the state they change.
    fn step(...) {

KNOWN_LONG names the functions that are being split in another change; one listed there
fails when it grows past the length noted, and is reported (not failed) once it is no longer
long, so that its entry is removed.

Usage: scripts/long-fns.py [--all] [--max N]   (--all: every function over the limit, the
justified and known ones too)
"""

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LINES = 120

# (file, function) -> its length when listed: functions another change is splitting (none
# now: the demo's driver and kvbridge-pd's long functions were split for issue 40).
KNOWN_LONG = {}


def blank_out(src):
    """`src` with comments, string and char literals replaced by spaces (newlines kept), so
    braces in them do not count and lines stay where they are."""
    out = list(src)
    i, n = 0, len(src)

    def wipe(a, b):
        for k in range(a, b):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            wipe(i, j)
            i = j
        elif src.startswith("/*", i):
            depth, j = 1, i + 2
            while j < n and depth:
                if src.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif src.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            wipe(i, j)
            i = j
        elif (m := re.compile(r'b?r(#*)"').match(src, i)) and (i == 0 or not (
                src[i - 1].isalnum() or src[i - 1] == "_")):
            end = src.find('"' + m.group(1), m.end())
            j = n if end < 0 else end + 1 + len(m.group(1))
            wipe(i, j)
            i = j
        elif c == '"':
            j = i + 1
            while j < n and src[j] != '"':
                j += 2 if src[j] == "\\" else 1
            wipe(i, j + 1)
            i = j + 1
        elif c == "'":
            # A char literal ('x', '\n', '\u{7f}', '{'), else a lifetime or a label.
            m = re.compile(r"'(?:\\(?:u\{[0-9a-fA-F]+\}|x[0-9a-fA-F]{2}|.)|[^\\'\n])'").match(src, i)
            if m:
                wipe(i, m.end())
                i = m.end()
            else:
                i += 1
        else:
            i += 1
    return "".join(out)


CFG_TEST_MOD = re.compile(r"#\[cfg\((?:test|all\(test[^\]]*\))\)\]\s*(?:pub(?:\([^)]*\))?\s+)?mod\s+\w+\s*\{")
FN_RE = re.compile(r"\bfn\s+([A-Za-z_][A-Za-z0-9_]*)")
TEST_ATTR = re.compile(r"#\[(?:[a-z_]+::)*test\b")


def close_of(text, open_at):
    """Index of the brace that closes the one at `open_at`."""
    depth = 0
    for j in range(open_at, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return len(text) - 1


def above(lines, line_no):
    """The comments and attributes right above line `line_no` (0-based), nearest first."""
    block = []
    k = line_no - 1
    while k >= 0:
        s = lines[k].strip()
        if s.startswith("//") or s.startswith("#[") or s.startswith("#!") or (
                block and block[-1].startswith("#[") and not s.endswith(";") and s and s[0] in ")]}"):
            block.append(s)
            k -= 1
        else:
            break
    return block


def long_fns(path):
    """(name, first line, length, justified) of each non-test function over the limit."""
    src = open(path, encoding="utf-8").read()
    text = blank_out(src)
    lines = src.split("\n")
    tests = [(m.start(), close_of(text, m.end() - 1)) for m in CFG_TEST_MOD.finditer(text)]
    found = []
    for m in FN_RE.finditer(text):
        if any(a <= m.start() <= b for a, b in tests):
            continue
        j = m.end()
        depth = 0
        while j < len(text):
            ch = text[j]
            if ch in "([<" and not (ch == "<" and text[j - 1] == "-"):
                depth += 1
            elif ch in ")]>" and not (ch == ">" and text[j - 1] in "-="):
                depth -= 1
            elif depth <= 0 and ch in "{;":
                break
            j += 1
        if j >= len(text) or text[j] == ";":
            continue
        end = close_of(text, j)
        first = text.count("\n", 0, m.start())
        last = text.count("\n", 0, end)
        length = last - first + 1
        block = above(lines, first)
        if any(TEST_ATTR.match(s) for s in block):
            continue
        if length > MAX_LINES:
            justified = any(re.match(r"//\s*long-fn:", s) for s in block)
            found.append((m.group(1), first + 1, length, justified))
    return found


def rust_files():
    dirs = [os.path.join(ROOT, "python", "src")]
    crates = os.path.join(ROOT, "crates")
    dirs += [os.path.join(crates, c, "src") for c in sorted(os.listdir(crates))]
    for d in dirs:
        for dp, _, fs in os.walk(d):
            for f in sorted(fs):
                if f.endswith(".rs"):
                    yield os.path.join(dp, f)


def main(argv):
    show_all = "--all" in argv
    failed = False
    seen = set()
    for path in rust_files():
        rel = os.path.relpath(path, ROOT)
        for name, line, length, justified in long_fns(path):
            key = (rel, name)
            if key in KNOWN_LONG:
                seen.add(key)
                if length > KNOWN_LONG[key]:
                    failed = True
                    print(f"{rel}:{line}: fn {name}: {length} lines, grown past the "
                          f"{KNOWN_LONG[key]} noted in KNOWN_LONG")
                elif show_all:
                    print(f"{rel}:{line}: fn {name}: {length} lines (known, being split)")
            elif justified:
                if show_all:
                    print(f"{rel}:{line}: fn {name}: {length} lines (justified)")
            else:
                failed = True
                print(f"{rel}:{line}: fn {name}: {length} lines, over {MAX_LINES} and no "
                      "`// long-fn:` comment saying why it must be one")
    for key in sorted(set(KNOWN_LONG) - seen):
        print(f"{key[0]}: fn {key[1]} is no longer over {MAX_LINES} lines (or is justified): "
              "remove it from KNOWN_LONG in scripts/long-fns.py")
    if failed:
        print(f"long-fns: FAILED (a function over {MAX_LINES} lines says not why)")
        return 1
    print(f"long-fns: no unexplained function over {MAX_LINES} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
