#!/usr/bin/env python3
"""Lists C and C++ functions longer than a limit (default 80 lines), longest first, with a
reason where one is stated: a comment line just above the function (or its first line)
beginning "Long:", or one saying the function is "over N lines" and why. A rough brace count, not a parser: string and character literals and
comments and preprocessor lines are blanked first; a body is a '{' whose text before it, back to the last ';',
'{' or '}', reads as a function head (a parameter list, not a control statement, a
class or a namespace). Lambdas and local classes count toward the function holding them.

usage: long_functions.py [--limit N] [--unexplained] PATH...   (folders are walked)
exit status: 1 with --unexplained when a function over the limit states no reason.
"""
import os
import re
import sys

SUFFIXES = (".cpp", ".hpp", ".h", ".c", ".cu", ".cc")
NOT_A_FUNCTION = re.compile(r"^\s*(if|for|while|switch|catch|do|else|namespace|class|struct|"
                            r"union|enum|return|try)\b|=\s*$|\]\s*(\([^)]*\))?\s*"
                            r"(mutable\s*)?(noexcept\s*)?(->\s*[\w:<>&*\s]+)?$")


def blank(text):
    """The text with comments and literals replaced by spaces (newlines kept)."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == 'R' and text.startswith('R"', i):
            m = re.match(r'R"([^(\s]*)\(', text[i:])
            if not m:
                out.append(c)
                i += 1
                continue
            end = ")" + m.group(1) + '"'
            j = text.find(end, i)
            j = n if j < 0 else j + len(end)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            out.append(" " * (min(j + 1, n) - i))
            i = j + 1
        else:
            out.append(c)
            i += 1
    # Preprocessor lines (#if defined(...), #define F(x) {...}) are no code here.
    return re.sub(r"(?m)^[ \t]*#.*$", lambda m: " " * len(m.group(0)), "".join(out))


def functions(path):
    raw = open(path, encoding="utf-8", errors="replace").read()
    lines = raw.split("\n")
    text = blank(raw)
    depth_stack = []  # for each open brace: (is_function_start, start_line)
    in_function = 0
    head_start = 0
    line = 1
    for i, c in enumerate(text):
        if c == "\n":
            line += 1
        elif c == "{":
            head = text[head_start:i]
            is_fn = (in_function == 0 and ")" in head and "(" in head and
                     not NOT_A_FUNCTION.search(head.strip()) and
                     not re.search(r"\b(if|for|while|switch)\s*\(", head))
            if is_fn:
                name = re.search(r"([~\w:]+(?:<[^<>]*>)?(?:operator\S*)?)\s*\([^()]*", head)
                start = line - head.strip("\n ").count("\n") if head.strip() else line
                depth_stack.append((True, start, name.group(1) if name else "?"))
                in_function += 1
            else:
                depth_stack.append((False, line, None))
            head_start = i + 1
        elif c == "}":
            if depth_stack:
                is_fn, start, name = depth_stack.pop()
                if is_fn:
                    in_function -= 1
                    yield name, start, line, lines
            head_start = i + 1
        elif c == ";":
            head_start = i + 1


def reason(lines, start):
    for k in range(max(0, start - 3), min(len(lines), start + 1)):
        m = re.search(r"(//|/\*|#)\s*Long:\s*(.*)", lines[k])
        if m:
            return m.group(2).strip()
        if re.search(r"(//|/\*).*over \d+ lines", lines[k]):
            return lines[k].strip().lstrip("/* ")
    return ""


def main(argv):
    limit, unexplained_only, paths = 80, False, []
    it = iter(argv)
    for a in it:
        if a == "--limit":
            limit = int(next(it))
        elif a == "--unexplained":
            unexplained_only = True
        else:
            paths.append(a)
    found = []
    for p in paths:
        files = [p] if os.path.isfile(p) else [os.path.join(d, f) for d, _, fs in os.walk(p)
                                               for f in fs if f.endswith(SUFFIXES)]
        for f in sorted(files):
            for name, start, end, lines in functions(f):
                n = end - start + 1
                if n > limit:
                    found.append((n, f, start, name, reason(lines, start)))
    found.sort(key=lambda x: -x[0])
    bad = 0
    for n, f, start, name, why in found:
        if unexplained_only and why:
            continue
        bad += not why
        print(f"{n:5d}  {f}:{start}  {name}" + (f"  (long: {why})" if why else ""))
    return 1 if unexplained_only and bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
