"""Local snapshots of public repositories, for the real-code benchmarks (``ecosystem.py``, ``realfixes.py``, ``mutation.py``).

rlguard stores no third-party code: the benchmarks name repositories and commits, and read the files from a bare
git mirror on this machine. Mirrors are looked up under a folder given by ``--mirrors`` or the environment
variable ``RLGUARD_MIRRORS``; for ``owner/name`` any of these layouts is accepted::

    <mirrors>/<owner>+<name>/repo      <mirrors>/<owner>+<name>      <mirrors>/<owner>/<name>.git

Get one with ``git clone --mirror https://github.com/<owner>/<name> <mirrors>/<owner>+<name>``. A repository
whose mirror is absent, or lacks the pinned commit, is skipped with a note (the benchmarks then report on the
rest), so a machine without snapshots runs them as a no-op.

``enclosing_functions`` and ``function_lines`` locate functions by qualified name (``Class.method``) with the
standard ``ast``, so that findings can be attributed to the function a case or a verdict names.
"""

from __future__ import annotations

import ast
import os
import subprocess
from pathlib import Path

from rlguard.lint import neutral

ENV = "RLGUARD_MIRRORS"


def mirrors_root(explicit: str | None = None) -> Path | None:
    value = explicit or os.environ.get(ENV)
    return Path(value).expanduser() if value else None


def find_mirror(root: Path | None, repo: str) -> Path | None:
    """The bare git directory of ``owner/name`` under ``root``, or None."""
    if root is None:
        return None
    owner, _, name = repo.partition("/")
    for candidate in (root / f"{owner}+{name}" / "repo", root / f"{owner}+{name}", root / owner / f"{name}.git",
                      root / f"{name}.git"):
        if (candidate / "objects").is_dir() or (candidate / "HEAD").is_file():
            return candidate
    return None


def git(git_dir: Path, *args: str, binary: bool = False) -> str | bytes:
    out = subprocess.run(["git", f"--git-dir={git_dir}", *args], check=True, capture_output=True)
    return out.stdout if binary else out.stdout.decode("utf-8", "replace")


def has_commit(git_dir: Path, commit: str) -> bool:
    probe = subprocess.run(["git", f"--git-dir={git_dir}", "cat-file", "-e", f"{commit}^{{commit}}"],
                           capture_output=True)
    return probe.returncode == 0


def resolve(git_dir: Path, rev: str) -> str:
    return git(git_dir, "rev-parse", f"{rev}^{{commit}}").strip()


def python_paths(git_dir: Path, commit: str) -> list[str]:
    listing = git(git_dir, "ls-tree", "-r", "-z", "--name-only", commit)
    return sorted(p for p in listing.split("\0") if p.endswith(".py"))


def read_blobs(git_dir: Path, commit: str, paths: list[str]) -> dict[str, bytes]:
    """The contents of ``paths`` at ``commit``, in one ``git cat-file --batch`` process. Paths whose blob the
    mirror lacks (large files a snapshot leaves out) are missing from the result."""
    if not paths:
        return {}
    request = "".join(f"{commit}:{p}\n" for p in paths).encode()
    proc = subprocess.run(["git", f"--git-dir={git_dir}", "cat-file", "--batch"], input=request,
                          capture_output=True, check=True)
    data, out, pos = proc.stdout, {}, 0
    for path in paths:
        end = data.index(b"\n", pos)
        header = data[pos:end].split()
        pos = end + 1
        if len(header) < 3 or header[1] != b"blob":
            continue  # "<rev> missing"
        size = int(header[2])
        out[path] = data[pos:pos + size]
        pos += size + 1
    return out


def show(git_dir: Path, commit: str, path: str) -> str | None:
    blob = read_blobs(git_dir, commit, [path]).get(path)
    return None if blob is None else blob.decode("utf-8", "replace")


def extract_python(git_dir: Path, commit: str, dest: Path) -> int:
    """Write every ``.py`` file of ``commit`` under ``dest`` (once: a finished extraction is kept and reused)."""
    done = dest / ".extracted"
    if done.is_file() and done.read_text() == commit:
        return sum(1 for _ in dest.rglob("*.py"))
    blobs = read_blobs(git_dir, commit, python_paths(git_dir, commit))
    for path, blob in blobs.items():
        target = dest / path
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(blob)
    done.write_text(commit)
    return len(blobs)


def enclosing_functions(source: str) -> list[tuple[int, int, str]]:
    """(first line, last line, qualified name) of every function and method of ``source``, outermost first
    (:func:`rlguard.lint.neutral.enclosing_functions`, the spans the renaming check uses). A file that does not
    parse has none."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError, RecursionError):
        return []
    return neutral.enclosing_functions(tree)


def function_lines(source: str, qualname: str) -> list[tuple[int, int]]:
    """The line ranges of the function ``qualname`` in ``source`` (one per definition: a name redefined, or
    defined in both branches of an ``if``, has several; ``<module>`` is the whole file); empty when absent."""
    if qualname == "<module>":
        return [(1, max(1, len(source.splitlines())))]
    return [(first, last) for first, last, name in enclosing_functions(source) if name == qualname]


def replace_section(doc: Path, heading: str, body: str) -> None:
    """Put ``body`` (which starts with the ``heading`` line) in place of the ``heading`` section of the markdown file
    ``doc`` (up to the next ``## `` heading), or at its end when the section is absent; other sections are kept."""
    text = doc.read_text(encoding="utf-8") if doc.exists() else "# Benchmarks\n"
    start = text.find(heading + "\n")
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + body
    else:
        nxt = text.find("\n## ", start + len(heading))
        text = text[:start] + body + (text[nxt:] if nxt >= 0 else "")
    doc.write_text(text, encoding="utf-8")

