"""The PEP 517 backend's parts that need no CMake build (python_build/): the [project] table
read without tomllib matches tomllib's and refuses what it does not read, naming the line;
the metadata refuses [project] keys it would leave out; the wheel's RECORD holds each
file's sha256 and size; CMake's environment under pip's build isolation sees site-packages.
    build_backend_test.py SOURCE_DIR"""

import base64
import csv
import hashlib
import io
import os
import sys
import tempfile
import zipfile

ROOT = os.path.abspath(sys.argv[1])
sys.path.insert(0, os.path.join(ROOT, "python_build"))
import gpumem_build_archive as archive  # noqa: E402
import gpumem_build_metadata as metadata  # noqa: E402
import gpumem_build_native as native  # noqa: E402


def expect_error(fn, *words):
    try:
        fn()
    except ValueError as e:
        for word in words:
            assert word in str(e), (word, str(e))
        return
    raise AssertionError("no ValueError for " + " ".join(words))


def test_project_table():
    with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
        text = f.read()
    table = metadata.read_project_table(text)
    assert table["name"] == "gpumem" and len(table["classifiers"]) == 3, table
    try:
        import tomllib
    except ImportError:
        tomllib = None
    if tomllib is not None:
        assert table == tomllib.loads(text)["project"], (table, tomllib.loads(text))
    odd = ('[project]\nname = "a\\"#b"  # comment\nclassifiers = [\n  "x", # one\n  "y",\n]\n'
           '[tool.other]\nk = { a = 1 }\n')
    assert metadata.read_project_table(odd) == {"name": 'a"#b', "classifiers": ["x", "y"]}
    expect_error(lambda: metadata.read_project_table('[project]\nlicense = { text = "MIT" }\n'),
                 "line 2", "license")
    expect_error(lambda: metadata.read_project_table('[project]\nversion = 1\n'), "line 2")
    expect_error(lambda: metadata.read_project_table('[project]\nclassifiers = [\n "x",\n'),
                 "classifiers", "not closed")
    expect_error(lambda: metadata.read_project_table('[project]\nname\n'), "line 2")


def test_metadata_keys():
    with tempfile.TemporaryDirectory() as root:
        def write(text):
            with open(os.path.join(root, "pyproject.toml"), "w", encoding="utf-8") as f:
                f.write(text)
        write('[project]\nname = "p"\nversion = "1"\nscripts = ["x"]\n')
        expect_error(lambda: metadata.read(root), "scripts")
        write('[project]\nname = "p"\n')
        expect_error(lambda: metadata.read(root), "version")
        write('[project]\nname = "p"\nversion = "1"\ndependencies = ["numpy>=1"]\n')
        meta = metadata.read(root)
        assert "Requires-Dist: numpy>=1\n" in meta["text"], meta["text"]
    meta = metadata.read(ROOT)
    assert meta["text"].startswith("Metadata-Version: 2.1\nName: gpumem\nVersion: 0.1.0\n")
    assert "Description-Content-Type: text/markdown\n\n# gpumem" in meta["text"]


def test_wheel_record():
    meta = {"name": "gpumem", "version": "0.1.0", "text": "Metadata-Version: 2.1\n"}
    with tempfile.TemporaryDirectory() as tmp:
        lib = os.path.join(tmp, "lib.so")
        with open(lib, "wb") as f:
            f.write(os.urandom(4096))
        name = archive.write_wheel(os.path.join(tmp, "out"), meta, {"gpumem/lib.so": lib},
                                   {"x.pth": "/some/path\n"})
        assert name == "gpumem-0.1.0-%s.whl" % archive.wheel_tag(), name
        wheel = zipfile.ZipFile(os.path.join(tmp, "out", name))
        rows = list(csv.reader(io.StringIO(wheel.read("gpumem-0.1.0.dist-info/RECORD").decode())))
        assert sorted(r[0] for r in rows) == sorted(wheel.namelist()), rows
        for path, digest, size in rows:
            if path.endswith("RECORD"):
                assert (digest, size) == ("", ""), rows
                continue
            data = wheel.read(path)
            b64 = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            assert (digest, int(size)) == ("sha256=" + b64, len(data)), (path, digest, size)
        with open(lib, "rb") as f:
            assert wheel.read("gpumem/lib.so") == f.read()
        assert not [n for n in os.listdir(os.path.join(tmp, "out")) if n.endswith(".part")]


def test_configure_environment():
    isolated = os.path.join(tempfile.gettempdir(), "pip-build-env-abc123", "site")
    env = {"PATH": "/bin", "PYTHONPATH": isolated, "PYTHONNOUSERSITE": "1"}
    assert native.configure_environment(env) == {"PATH": "/bin"}
    env["PYTHONPATH"] = os.pathsep.join([isolated, "/mine"])
    assert native.configure_environment(env) == {"PATH": "/bin", "PYTHONPATH": "/mine"}
    plain = {"PATH": "/bin", "PYTHONPATH": "/mine", "PYTHONNOUSERSITE": "1"}
    assert native.configure_environment(plain) == plain


for test in (test_project_table, test_metadata_keys, test_wheel_record,
             test_configure_environment):
    test()
    print("ok", test.__name__)
