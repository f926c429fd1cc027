"""Files on disk: atomic writes (a reader or a resumed run sees the old version or the new one, never half of one),
JSONL reading that splits records on newlines only, and checks that an output path is usable before any compute."""

from __future__ import annotations

import ctypes
import gzip
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from pathlib import Path

from dspark.errors import DSparkError


def atomic_write_text(path: str | Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        make_public(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def make_public(path: str | Path) -> None:
    """A file written privately (mkstemp, some libraries' writers) gets the modes of ordinary ones."""
    os.chmod(path, 0o666 & ~_umask())


def _public(folder: Path) -> None:
    """mkdtemp/mkstemp create private files; give the finished output the modes of ordinary ones."""
    mask = _umask()
    os.chmod(folder, 0o777 & ~mask)
    for p in folder.rglob("*"):
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


def atomic_write_json(path: str | Path, data) -> None:
    atomic_write_text(path, json.dumps(data, indent=2) + "\n")


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux renameat2). False where the system cannot."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0


def _old_copies(path: Path) -> list[Path]:
    return sorted(path.parent.glob(f".{path.name}.old-*"), key=lambda p: p.stat().st_mtime)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _dead_writers_tmp(path: Path) -> list[Path]:
    """Temporary folders of `atomic_dir(path)` whose writer was killed (its pid, in the name, is gone)."""
    stale = []
    for tmp in path.parent.glob(f".{path.name}.tmp-*"):
        pid = tmp.name[len(f".{path.name}.tmp-") :].split("-")[0]
        if pid.isdigit() and not _alive(int(pid)):
            stale.append(tmp)
    return stale


def recover_dir(path: str | Path) -> None:
    """Undo a replacement that was killed half-way (old folder moved aside, new one not yet in): put the old back.
    Also remove the half-written temporary folders that killed writers left beside `path`."""
    path = Path(path)
    if not path.parent.is_dir():
        return
    olds = _old_copies(path)
    if not path.exists() and olds:
        os.replace(olds.pop(), path)
    for stale in olds + _dead_writers_tmp(path):
        shutil.rmtree(stale, ignore_errors=True)


OUTPUT_MANIFEST = ".dspark-output.json"


def check_replaceable(out: str | Path, overwrite: bool, source: str | Path | None = None) -> Path:
    """An output folder that is new, empty, or (with `overwrite`) an earlier output of ours, holding only the files
    its manifest lists; never a file, the input itself, a folder containing the input, or a folder inside it."""
    out = Path(out)
    if out.is_symlink():
        raise DSparkError(f"{out} is a symbolic link; --overwrite never replaces or follows a link. Give the real path")
    if out.exists() and not out.is_dir():
        raise DSparkError(f"{out} is a file; this command writes a folder. Choose another output path")
    if source is not None:
        src, dst = Path(source).resolve(), out.resolve()
        if dst == src:
            raise DSparkError(f"{out} is the input folder; write to another folder")
        if src.is_relative_to(dst):
            raise DSparkError(f"{out} contains the input {source}; write to a folder outside it")
        if dst.is_relative_to(src):
            raise DSparkError(f"{out} is inside the input folder {source}; write to a folder outside it")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise DSparkError(
                f"{out} already exists and is not empty; choose a new folder or pass --overwrite to "
                "replace an earlier output of this command"
            )
        foreign = _files_not_ours(out)
        if foreign:
            raise DSparkError(
                f"{out} holds files dspark did not write there ({foreign[0]}"
                f"{f' and {len(foreign) - 1} more' if len(foreign) > 1 else ''}); --overwrite only "
                "replaces an earlier output. Choose a new folder"
            )
    return check_output_dir(out, "output folder")


def _files_not_ours(folder: Path) -> list[str]:
    try:
        listed = set(json.loads((folder / OUTPUT_MANIFEST).read_text(encoding="utf-8"))["files"])
    except (OSError, ValueError, KeyError, TypeError):
        listed = set()
    links, present = [], []
    for p in sorted(folder.rglob("*")):
        if p.is_symlink():  # never ours (we write none): replacing the folder would delete the user's link
            links.append(str(p.relative_to(folder)))
        elif not p.is_dir():
            present.append(str(p.relative_to(folder)))
    return links + [name for name in present if name != OUTPUT_MANIFEST and name not in listed]


@contextmanager
def atomic_dir(path: str | Path, manifest: bool = False):
    """Yield a temporary folder beside `path`; on success it replaces `path`. At every instant `path` holds either
    the old folder or the new one: the two are exchanged in one step where the system allows, else the old one is
    moved aside first and `recover_dir` (run by every later writer and reader) puts it back after a kill.

    manifest: list the files written in the folder's OUTPUT_MANIFEST, so that a later --overwrite can tell an
    earlier output of ours from a folder holding anything else (`check_replaceable`)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise DSparkError(f"{path} is a file, not a folder; choose another output path")
    path.parent.mkdir(parents=True, exist_ok=True)
    recover_dir(path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-{os.getpid()}-", dir=path.parent))
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if manifest:
        written = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if not p.is_dir())
        (tmp / OUTPUT_MANIFEST).write_text(json.dumps({"written_by": "dspark", "files": written}, indent=2) + "\n")
    _public(tmp)
    if path.exists() and _exchange(tmp, path):
        shutil.rmtree(tmp, ignore_errors=True)  # tmp now holds the old folder
        return
    old = None
    if path.exists():
        old = path.parent / f".{path.name}.old-{os.getpid()}"
        os.replace(path, old)
    os.replace(tmp, path)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def check_input_file(path: str | Path, what: str) -> Path:
    """An input that must be a readable file: missing and folder are told apart."""
    path = Path(path)
    if path.is_dir():
        raise DSparkError(f"{what} {path} is a folder; give the path of a file")
    if not path.is_file():
        raise DSparkError(f"{what} {path} does not exist")
    return path


def read_json(path: str | Path, what: str, fix: str):
    """A JSON file's content; anything unreadable (missing, a folder, not UTF-8, not JSON) is one line naming the
    file, the problem and `fix`."""
    path = check_input_file(path, what)
    try:
        return json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise DSparkError(
            f"{what} {path} is not UTF-8 text (byte {e.object[e.start]:#x} at offset {e.start}); {fix}"
        ) from e
    except json.JSONDecodeError as e:
        raise DSparkError(f"{what} {path} is not valid JSON ({e.msg} at line {e.lineno}); {fix}") from e
    except OSError as e:
        raise DSparkError(f"{what} {path} cannot be read ({e.strerror}); {fix}") from e


def jsonl_lines(path: str | Path) -> list[tuple[int, str]]:
    """(line number, text) of every non-blank line of a JSONL file (gzipped when it ends in .gz).

    Records are split on '\\n' only: str.splitlines() also splits on U+2028 and friends, which JSON strings may hold."""
    path = check_input_file(path, "data file")
    gz = path.suffix == ".gz"
    try:
        raw = gzip.decompress(path.read_bytes()) if gz else path.read_bytes()
        text = raw.decode("utf-8")
    except (OSError, EOFError, gzip.BadGzipFile) as e:
        raise DSparkError(
            f"{path}: cannot read it{' as gzipped UTF-8 text' if gz else ''} ({e}); data files are "
            "JSONL, .jsonl.gz or .txt"
        ) from e
    except UnicodeDecodeError as e:
        line = raw[: e.start].count(b"\n") + 1
        raise DSparkError(f"{path}:{line}: not UTF-8 text (byte {raw[e.start]:#x}); save the file as UTF-8") from e
    return [(n, line) for n, line in enumerate(text.split("\n"), 1) if line.strip()]


def read_jsonl(path: str | Path) -> list[dict]:
    """Every record of a JSONL file; a bad line is reported with its file and line number."""
    records = []
    for n, line in jsonl_lines(path):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise DSparkError(f"{path}:{n}: not valid JSON ({e.msg} at column {e.colno})") from e
        if not isinstance(record, dict):
            raise DSparkError(f"{path}:{n}: each line must be a JSON object")
        records.append(record)
    return records


def check_output_file(
    path: str | Path,
    what: str = "output file",
    inputs: Iterable[str | Path] = (),
    ours: Callable[[Path], bool] | None = None,
) -> Path:
    """Fail before any compute unless `path` may be written as a file: the one rule for every output (also
    check_output_dir and check_replaceable). An output is never a link (replacing it would delete the user's link,
    writing through it would change its target), never one of the run's `inputs` (compared by the file itself, so hard
    and symbolic links count; an input folder covers every file in it), never a file of the installed dspark package
    (the shipped drafter, the evaluation sets), and where it exists, `ours(path)` must recognise it as an earlier
    output of the same command."""
    path = Path(path)
    if path.is_dir():
        raise DSparkError(f"{what} {path} is a folder; give a file path")
    _check_not_input_or_package(path, what, inputs)
    if path.exists() and ours is not None and not ours(path):
        raise DSparkError(
            f"{what} {path} already holds a file this command did not write; give a new path (dspark replaces only "
            "its own earlier output)"
        )
    _check_parent_writable(path, what)
    return path


def _check_not_input_or_package(path: Path, what: str, inputs: Iterable[str | Path]) -> None:
    if path.is_symlink():
        raise DSparkError(
            f"{what} {path} is a symbolic link; dspark neither writes through a link nor replaces one. Give the real "
            "path, or a new one"
        )
    resolved = path.resolve()
    for source in map(Path, inputs):
        if not source.exists():
            continue
        if source.is_dir() and resolved.is_relative_to(source.resolve()):
            raise DSparkError(f"{what} {path} is inside {source}, an input of this run; write somewhere else")
        if path.exists() and os.path.samefile(path, source):
            raise DSparkError(
                f"{what} {path} is {source} (an input of this run, or a link to it); write somewhere else"
            )
    package = Path(__file__).resolve().parent
    if resolved.is_relative_to(package):
        raise DSparkError(f"{what} {path} is inside the installed dspark package ({package}); write somewhere else")


def is_matplotlib_png(path: Path) -> bool:
    """An earlier plot of ours: a PNG that matplotlib wrote (it names itself in the file's first chunks)."""
    try:
        with path.open("rb") as f:
            head = f.read(512)
    except OSError:
        return False
    return head.startswith(b"\x89PNG") and b"matplotlib" in head.lower()


def is_json_with(path: Path, *keys: str) -> bool:
    """An earlier JSON output of ours: an object holding these keys."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and all(k in data for k in keys)


def check_output_dir(path: str | Path, what: str = "output folder", inputs: Iterable[str | Path] = ()) -> Path:
    """Fail before any compute if `path` cannot be created or written as a folder, or breaks check_output_file's
    rule (a link, an input of the run, the installed package)."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise DSparkError(f"{what} {path} is a file; give a folder path")
    _check_not_input_or_package(path, what, inputs)
    if path.is_dir():
        if not os.access(path, os.W_OK | os.X_OK):
            raise DSparkError(f"{what} {path} is not writable; choose a folder you can write to")
        return path
    _check_parent_writable(path, what)
    return path


def _check_parent_writable(path: Path, what: str) -> None:
    parent = path.parent
    while not parent.exists():  # the nearest existing ancestor is where the folders will be created
        parent = parent.parent
    if not parent.is_dir():
        raise DSparkError(f"{what} {path}: {parent} is a file, so nothing can be created under it")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise DSparkError(f"{what} {path}: {parent} is not writable; choose a path you can write to")
