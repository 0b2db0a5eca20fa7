"""Output folders: a command's --out appears whole, or not at all, and never replaces what is not its own.

The commands that write a folder (`train`, `import`, `export`, `data prepare`) first check --out:
absent, an empty folder, or an earlier output of the command's own kind (each command says which,
`refuse_foreign`); anything else — a file, a folder holding other things — is refused in one line
before any work, so no unrelated file is ever overwritten or deleted.

They then build the output in a staging folder beside it, `OUT.partial`, and rename that into
place only when it is complete (`Staging.commit`): `train` at its first checkpoint, from when on
the run is resumable with --resume; the others at the end. A command that fails removes its staging
folder, so a failed command leaves nothing behind. A kill (SIGKILL, power loss) cannot clean up;
the staging folder holds a marker, `.looplm-partial`, which the command writing it keeps locked
(an advisory `flock`), so the next command into the same OUT knows a stale one from a live one:
a stale one is removed and started afresh, or — `data prepare`, whose journal records finished
shards — continued; a live one is refused. A folder named OUT.partial without the marker is not
looplm's and is refused, never removed.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import IO

from .errors import UserError

SUFFIX = ".partial"
MARKER = ".looplm-partial"


def staging_path(out: str | Path) -> Path:
    """Where the output bound for `out` is built: OUT.partial beside it (`.` and `..` named by their paths)."""
    out = Path(out)
    if out.name in ("", ".."):
        out = Path(os.path.abspath(out))
    return out.with_name(out.name + SUFFIX)


def is_stale_staging(path: Path) -> bool:
    """Whether `path` is a staging folder looplm left (its marker present) that no command is writing."""
    if not (path / MARKER).is_file():
        return False
    lock = _try_lock(path / MARKER)
    if lock is None:
        return False
    lock.close()
    return True


def refuse_foreign(out: Path, flag: str, own: Callable[[Path], bool] | None = None, own_kind: str = "") -> bool:
    """Check --out before any work: True when it holds an earlier output of this command's own kind
    (`own(out)`), False when it is absent or an empty folder; UserError (one line naming what is there)
    when it is a file or a folder holding anything else. own_kind: what the command's own output is,
    in words, for the message (own None: the command takes only an absent or empty folder)."""
    if not out.exists() and not out.is_symlink():
        return False
    if not out.is_dir():
        raise UserError(f"{flag} {out}: exists and is not a folder; choose another {flag}")
    entries = sorted(p.name for p in out.iterdir())
    if not entries:
        return False
    if own is not None and own(out):
        return True
    shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
    raise UserError(f"{flag} {out}: not empty (holds {shown})" + (f" and not {own_kind}" if own_kind else "")
                    + f"; choose another {flag} or an empty folder (nothing in it was changed)")


def _try_lock(path: Path) -> IO[str] | None:
    """`path` opened and exclusively locked, or None when another process holds the lock. Where the
    platform has no flock every marker counts as unlocked (a stale folder is then taken over)."""
    handle = open(path, "a+", encoding="utf-8")
    try:
        import fcntl
    except ImportError:
        return handle
    try:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.close()
        return None
    return handle


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


class Staging:
    """OUT.partial for the duration of a command (see the module docstring), as a context manager:

        with Staging(out, "--out") as stage:
            write(stage.dir)            # OUT.partial until commit, OUT after
            stage.commit()

    Leaving the block by an exception before `commit` removes the staging folder, except for a
    KeyboardInterrupt once `keep_interrupted` is set (a resumable `data prepare`). resume: take over a
    stale staging folder's contents (data prepare continues its journal) instead of starting empty; a
    staging folder taken over is never removed by a failure (the earlier command's work stays to
    continue, and a refusal of its settings changes nothing).
    owner: False on the other processes of a multi-process run, which only read what rank 0 stages
    (they never create, rename or remove it). in_place: write into OUT itself (train --resume, whose
    run folder is already whole); commit and the clean-up are then no-ops."""

    def __init__(self, out: str | Path, flag: str, resume: bool = False, owner: bool = True,
                 in_place: bool = False) -> None:
        self.out, self.flag, self.resume, self.owner, self.in_place = Path(out), flag, resume, owner, in_place
        self.path = staging_path(self.out)
        self.committed = in_place
        self.resumed = False
        """Whether the staging folder was a stale one taken over (resume=True)."""
        self.keep_interrupted = False
        self._lock: IO[str] | None = None

    @property
    def dir(self) -> Path:
        """The folder to write now: OUT.partial before the commit, OUT from then on."""
        return self.out if self.committed else self.path

    def __enter__(self) -> Staging:
        if self.in_place or not self.owner:
            return self
        if self.path.exists() or self.path.is_symlink():
            if not self.path.is_dir() or not (self.path / MARKER).is_file():
                raise UserError(f"{self.flag} {self.out}: {self.path} exists and was not made by looplm; move it "
                                "away (looplm builds the output there before moving it into place)")
            self._lock = _try_lock(self.path / MARKER)
            if self._lock is None:
                raise UserError(f"{self.flag} {self.out}: another looplm command is writing it (in {self.path}); "
                                "wait for it, or choose another folder")
            if self.resume:
                self.resumed = True
                return self
            self._lock.close()
            shutil.rmtree(self.path)          # a stale start a kill left: nothing in it to continue
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.mkdir()
        self._lock = _try_lock(self.path / MARKER)
        return self

    def commit(self) -> None:
        """Move the finished staging folder into place as OUT (an empty OUT folder is replaced)."""
        if self.committed:
            return
        if self.owner:
            target = Path(os.path.abspath(self.out))
            cwd = Path.cwd()
            if target.is_dir() and not any(target.iterdir()) and (target == cwd or target in cwd.parents):
                # OUT is (or holds) the working folder, which must stay the same folder: its entries move in
                # one by one, the checkpoint last (a run is a run only once it is whole)
                self._move_entries(target, last="checkpoint")
            else:
                if target.is_dir() and not any(target.iterdir()):
                    target.rmdir()
                try:
                    os.rename(self.path, target)
                except OSError as err:
                    raise UserError(f"{self.flag} {self.out}: cannot move {self.path} into place ({err.strerror}); "
                                    f"something else was written to {self.out} meanwhile") from None
                (target / MARKER).unlink(missing_ok=True)
            _fsync_dir(target.parent)
            self._release()
        self.committed = True

    def merge(self) -> None:
        """Move each finished file into OUT, an earlier output of this command, one rename each: its
        other files stay (`export` into an earlier export that a user keeps beside other files)."""
        if self.committed:
            return
        self._move_entries(self.out)
        self._release()
        self.committed = True

    def _move_entries(self, target: Path, last: str | None = None) -> None:
        """The staging folder's entries renamed into `target` one by one (an entry of the same name there
        replaced), `last` after the others; then the emptied staging folder removed."""
        (self.path / MARKER).unlink(missing_ok=True)
        for entry in sorted(self.path.iterdir(), key=lambda p: (p.name == last, p.name)):
            dest = target / entry.name
            if dest.is_dir() and not dest.is_symlink():
                shutil.rmtree(dest)
            os.replace(entry, dest)
        self.path.rmdir()
        _fsync_dir(target)

    def discard(self) -> None:
        if not self.committed and self.owner:
            shutil.rmtree(self.path, ignore_errors=True)
        self._release()

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        if self.committed or self.in_place or not self.owner:
            self._release()
            return
        interrupted = kind is not None and issubclass(kind, KeyboardInterrupt) and self.keep_interrupted
        if interrupted or self.resumed:   # work to continue: an earlier command's, or this one's (Ctrl-C)
            self._release()
            return
        self.discard()
