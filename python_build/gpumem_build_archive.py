"""The wheel (PEP 427: the files, NAME-VERSION.dist-info with METADATA, WHEEL and a RECORD of
sha256 hashes) and the sdist (NAME-VERSION.tar.gz with PKG-INFO), written with zipfile and
tarfile. The wheel holds native libraries loaded into this Python's process, so it is tagged
for this interpreter and platform and installs into platlib."""

import base64
import hashlib
import io
import os
import shutil
import stat
import sys
import sysconfig
import tarfile
import time
import zipfile

GENERATOR = "gpumem_build"
# Never in an sdist: build output and what an editable install copies into the sources.
SDIST_SKIP_DIRS = {"__pycache__", ".git"}
SDIST_SKIP_SUFFIXES = (".pyc", ".so", ".torch")


def wheel_tag():
    """interpreter-abi-platform, e.g. cp311-cp311-linux_x86_64."""
    impl = sys.implementation.name
    version = "%d%d" % sys.version_info[:2]
    interpreter = {"cpython": "cp", "pypy": "pp"}.get(impl, impl[:2]) + version
    abi = "cp%s%s" % (version, sys.abiflags) if impl == "cpython" else "none"
    platform = sysconfig.get_platform().replace("-", "_").replace(".", "_")
    return "%s-%s-%s" % (interpreter, abi, platform)


def _dist_name(meta):
    return "%s-%s" % (meta["name"].replace("-", "_"), meta["version"])


def _wheel_text(tag):
    return ("Wheel-Version: 1.0\nGenerator: %s\nRoot-Is-Purelib: false\nTag: %s\n"
            % (GENERATOR, tag))


def write_dist_info(directory, meta, tag):
    """The .dist-info folder alone (prepare_metadata_for_build_wheel); returns its name."""
    name = _dist_name(meta) + ".dist-info"
    folder = os.path.join(directory, name)
    os.makedirs(folder, exist_ok=True)
    for file, text in (("METADATA", meta["text"]), ("WHEEL", _wheel_text(tag))):
        with open(os.path.join(folder, file), "w", encoding="utf-8") as f:
            f.write(text)
    return name


def record_line(arcname, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "%s,sha256=%s,%d" % (arcname, digest.decode("ascii"), len(data))


def _zip_info(arcname, mode):
    # A fixed date: the same inputs give the same wheel.
    info = zipfile.ZipInfo(arcname, date_time=(1980, 1, 1, 0, 0, 0))
    info.external_attr = (stat.S_IFREG | mode) << 16
    info.compress_type = zipfile.ZIP_DEFLATED
    return info


def write_wheel(directory, meta, files, texts=None):
    """Writes the wheel of {path in the wheel: file here} and {path in the wheel: text};
    returns its file name."""
    tag = wheel_tag()
    dist_info = _dist_name(meta) + ".dist-info"
    name = "%s-%s.whl" % (_dist_name(meta), tag)
    os.makedirs(directory, exist_ok=True)
    entries = []
    for arcname in sorted(files):
        path = files[arcname]
        with open(path, "rb") as f:
            data = f.read()
        executable = os.stat(path).st_mode & stat.S_IXUSR
        entries.append((arcname, data, 0o755 if executable else 0o644))
    for arcname, text in sorted((texts or {}).items()):
        entries.append((arcname, text.encode("utf-8"), 0o644))
    entries.append((dist_info + "/METADATA", meta["text"].encode("utf-8"), 0o644))
    entries.append((dist_info + "/WHEEL", _wheel_text(tag).encode("utf-8"), 0o644))
    record = [record_line(arcname, data) for arcname, data, _ in entries]
    record.append(dist_info + "/RECORD,,")
    entries.append((dist_info + "/RECORD", ("\n".join(record) + "\n").encode("utf-8"), 0o644))
    partial = os.path.join(directory, name + ".part")
    with zipfile.ZipFile(partial, "w") as wheel:
        for arcname, data, mode in entries:
            wheel.writestr(_zip_info(arcname, mode), data)
    os.replace(partial, os.path.join(directory, name))
    return name


def copy_file(source, target):
    """Copies through a temporary name, so a process that has the old file loaded keeps
    its mapping intact."""
    partial = target + ".part"
    shutil.copy2(source, partial)
    os.replace(partial, target)


def _sdist_sources(root, parts):
    for part in parts:
        path = os.path.join(root, part)
        if os.path.isfile(path):
            yield part
            continue
        if not os.path.isdir(path):
            raise RuntimeError("gpumem build: the sdist needs %s" % path)
        for folder, dirs, names in os.walk(path):
            dirs[:] = sorted(d for d in dirs if d not in SDIST_SKIP_DIRS)
            for file in sorted(names):
                if not file.endswith(SDIST_SKIP_SUFFIXES):
                    yield os.path.relpath(os.path.join(folder, file), root)


def write_sdist(directory, meta, root, parts):
    """NAME-VERSION.tar.gz: the files and folders of `parts` under NAME-VERSION/, with
    PKG-INFO; returns its file name."""
    base = _dist_name(meta)
    name = base + ".tar.gz"
    os.makedirs(directory, exist_ok=True)
    partial = os.path.join(directory, name + ".part")
    mtime = int(os.environ.get("SOURCE_DATE_EPOCH", time.time()))

    def normalized(info):
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        info.mtime = mtime
        return info

    with tarfile.open(partial, "w:gz", format=tarfile.PAX_FORMAT) as tar:
        for rel in _sdist_sources(root, parts):
            tar.add(os.path.join(root, rel), arcname=base + "/" + rel, recursive=False,
                    filter=normalized)
        data = meta["text"].encode("utf-8")
        info = normalized(tarfile.TarInfo(base + "/PKG-INFO"))
        info.size, info.mode = len(data), 0o644
        tar.addfile(info, io.BytesIO(data))
    os.replace(partial, os.path.join(directory, name))
    return name
