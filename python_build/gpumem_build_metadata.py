"""The package's metadata: pyproject.toml's [project] table, read with tomllib where Python
has it (3.11+), else with read_project_table(), which reads the subset of TOML that table
uses (strings, arrays of strings over several lines, comments), and written out as core
metadata (METADATA / PKG-INFO)."""

import ast
import os
import re

# The [project] keys this backend writes into METADATA; any other key is refused, so a key
# added to pyproject.toml is never silently left out of the package.
FIELDS = {"name": "Name", "version": "Version", "description": "Summary",
          "requires-python": "Requires-Python"}
LISTS = {"classifiers": "Classifier", "dependencies": "Requires-Dist"}
KNOWN = set(FIELDS) | set(LISTS) | {"readme"}


def read_project_table(text):
    """The [project] table of a pyproject.toml's text as a dict of strings and lists of
    strings; ValueError naming the line for anything else."""
    table, section, pending = {}, None, None
    for number, line in enumerate(text.splitlines(), 1):
        stripped = _strip_comment(line).strip()
        if pending is not None:
            key, parts = pending
            parts.append(stripped)
            if stripped.endswith("]"):
                table[key] = _value(key, " ".join(parts), number)
                pending = None
            continue
        if not stripped:
            continue
        if stripped.startswith("["):
            section = stripped.strip("[]").strip()
            continue
        if section != "project":
            continue
        key, sep, value = stripped.partition("=")
        if not sep:
            raise ValueError("pyproject.toml line %d: expected key = value" % number)
        key, value = key.strip().strip('"'), value.strip()
        if value.startswith("[") and not value.endswith("]"):
            pending = (key, [value])
        else:
            table[key] = _value(key, value, number)
    if pending is not None:
        raise ValueError("pyproject.toml: the array of '%s' is not closed" % pending[0])
    return table


def _strip_comment(line):
    """The line without a trailing # comment (a # inside a string is kept)."""
    quote, escaped = None, False
    for i, ch in enumerate(line):
        if quote:
            if escaped:
                escaped = False
            elif ch == "\\" and quote == '"':
                escaped = True
            elif ch == quote:
                quote = None
        elif ch in "\"'":
            quote = ch
        elif ch == "#":
            return line[:i]
    return line


def _value(key, text, number):
    text = re.sub(r",\s*\]$", "]", text.strip())  # TOML allows a trailing comma
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        value = None
    if isinstance(value, str) or (isinstance(value, list) and
                                  all(isinstance(v, str) for v in value)):
        return value
    raise ValueError("pyproject.toml line %d: %s: only strings and arrays of strings are read "
                     "in [project] here, not %s" % (number, key, text))


def project_table(root):
    path = os.path.join(root, "pyproject.toml")
    try:
        import tomllib
    except ImportError:
        with open(path, encoding="utf-8") as f:
            return read_project_table(f.read())
    with open(path, "rb") as f:
        return tomllib.load(f).get("project", {})


def read(root):
    """{"name", "version", "text": the METADATA file's text} for the project at root."""
    project = project_table(root)
    unknown = sorted(set(project) - KNOWN)
    if unknown:
        raise ValueError("gpumem build: pyproject.toml [project] keys this backend does not "
                         "write: %s" % ", ".join(unknown))
    for key in ("name", "version"):
        if not isinstance(project.get(key), str):
            raise ValueError("gpumem build: pyproject.toml [project] needs %s" % key)
    lines = ["Metadata-Version: 2.1"]
    lines += ["%s: %s" % (field, project[key]) for key, field in FIELDS.items() if key in project]
    for key, field in LISTS.items():
        lines += ["%s: %s" % (field, item) for item in project.get(key, [])]
    body = ""
    readme = project.get("readme")
    if readme is not None and not isinstance(readme, str):
        raise ValueError("gpumem build: pyproject.toml [project] readme must be a file name")
    if readme:
        with open(os.path.join(root, readme), encoding="utf-8") as f:
            body = f.read()
        kind = "text/markdown" if readme.endswith(".md") else "text/plain"
        lines.append("Description-Content-Type: " + kind)
    text = "\n".join(lines) + "\n\n" + body
    return {"name": project["name"], "version": project["version"], "text": text}
