#!/usr/bin/env python3
"""Fails when a tracked text file speaks of how the project was developed, or names a repo
file that does not exist.

Development history: work sessions, numbered issues, rounds of work, experiments "tried, not
kept". Those belong to the git history, not to documents, comments, test names or messages.
A file reference is a path under one of the repo's top-level folders (docs/X.md,
scripts/x.sh, src/...) or a bare upper-case document name (BASELINES.md); it must exist.
Paths with placeholders (<name>, *, {a,b}, X, N) are patterns and are not checked.

usage: check_docs_house.py REPO_ROOT
"""
import os
import re
import subprocess
import sys

TEXT_SUFFIXES = (".md", ".cpp", ".hpp", ".h", ".c", ".cu", ".py", ".sh", ".txt", ".cmake",
                 ".in", ".toml", ".cfg")

# Each pattern names development history, never the product.
HISTORY = [
    (re.compile(r"\b(work|development|dev|coding|helper|previous|this|that|last|next|"
                r"earlier|later|same|first|second|third|fourth|fifth|sixth|seventh|eighth|"
                r"ninth|tenth|eleventh|twelfth|thirteenth|fourteenth|fifteenth|sixteenth|"
                r"seventeenth|eighteenth|nineteenth|twentieth|twenty-\w+|thirty-\w+)"
                r" sessions?\b", re.I), "a work session"),
    (re.compile(r"\bsessions? (of work|\d+)\b", re.I), "a work session"),
    (re.compile(r"\b(twenty|thirty|forty)-(first|second|third|fourth|fifth|sixth|seventh|"
                r"eighth|ninth)\b", re.I), "an ordinal of a round of work"),
    (re.compile(r"\b(twentieth|thirtieth)\b", re.I), "an ordinal of a round of work"),
    (re.compile(r"\bissues? #?\d+\b|\bissue #\d+|\bissue's\b", re.I), "an issue number"),
    (re.compile(r"\brounds? of work\b", re.I), "a round of work"),
    (re.compile(r"\btried\b[^.\n]{0,80}\bnot kept\b|; not kept\b", re.I),
     "an experiment not kept"),
    (re.compile(r"\b(fixed|since|until|before|as of)(\*\*)?\s+(\*\*)?\d{4}-\d\d-\d\d",
                re.I), "a change dated in the history"),
]

TOP_DIRS = ("docs", "scripts", "src", "include", "tools", "tests", "bench", "examples",
            "python", "cmake", "data")
PATH = re.compile(r"(?<![\w./$}-])(?:\.\./)?((?:" + "|".join(TOP_DIRS) +
                  r")/[A-Za-z0-9_./<>*{},-]*[A-Za-z0-9_>*}])")
BARE_DOC = re.compile(r"(?<![\w/.-])([A-Z][A-Z0-9_]+\.md)\b")
PLACEHOLDER = re.compile(r"[<>*{}]|(^|/)(X|N|NAME|FILE)(\.|$|/)")


def tracked_files(root):
    out = subprocess.run(["git", "-C", root, "ls-files", "-co", "--exclude-standard"],
                         check=True, capture_output=True, text=True).stdout
    for rel in sorted(set(out.split())):
        if rel.startswith("data/") and not rel.endswith(".md"):
            continue
        name = os.path.basename(rel)
        if name == "CMakeLists.txt" or rel.endswith(TEXT_SUFFIXES):
            yield rel


def exists(root, rel_file, ref):
    ref = ref.rstrip(".,:;")
    if PLACEHOLDER.search(ref):
        return True
    # Relative to the root, or to the referring file's folder (a doc linking a sibling).
    candidates = [ref, os.path.join(os.path.dirname(rel_file), ref)]
    for c in candidates:
        p = os.path.join(root, c)
        # A built program is named by its source (bench/pool_bench: bench/pool_bench.cpp).
        if any(os.path.exists(p + s) for s in ("", ".cpp", ".c", ".py", ".sh")):
            return True
        # Build outputs and installed files are named by path but not tracked.
        if ref.startswith(("build/", "tests/interop/consumer/build")):
            return True
    return False


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else ".")
    me = os.path.relpath(os.path.abspath(__file__), root)
    problems = []
    for rel in tracked_files(root):
        if rel == me:
            continue
        # The install test names files of the installed tree (lib/cmake/gpumem/...).
        installed_tree = rel == "tests/interop/install_test.sh"
        try:
            with open(os.path.join(root, rel), encoding="utf-8") as f:
                lines = f.read().splitlines()
        except (UnicodeDecodeError, FileNotFoundError):
            continue
        for no, line in enumerate(lines, 1):
            for pattern, what in HISTORY:
                m = pattern.search(line)
                if m:
                    problems.append(f"{rel}:{no}: speaks of {what}: '{m.group(0)}'")
            for m in PATH.finditer(line):
                if installed_tree and m.group(1).startswith("cmake/gpumem/"):
                    continue
                if not exists(root, rel, m.group(1)):
                    problems.append(f"{rel}:{no}: names a file that does not exist: "
                                    f"'{m.group(1)}'")
            for m in BARE_DOC.finditer(line):
                name = m.group(1)
                start = m.start(1)
                if line[max(0, start - 1):start] == "/":
                    continue
                if not exists(root, rel, name) and not exists(root, rel, "docs/" + name):
                    problems.append(f"{rel}:{no}: names a document that does not exist: "
                                    f"'{name}'")
    for p in problems:
        print(p)
    if problems:
        print(f"FAIL: {len(problems)} finding(s): documents, comments, test names and "
              "messages speak of the product and name only files that exist", file=sys.stderr)
        return 1
    print("docs house: no development history, no reference to a missing file")
    return 0


if __name__ == "__main__":
    sys.exit(main())
