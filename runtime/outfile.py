"""Writing an output file without clobbering: checks before the work, a unique temporary file
beside the output, and an exclusive publish at the end.

`k4 quantize` and `k4 synth` write through `partial_output(out, force)`: the data goes to a
temporary file that no other name can collide with (created O_EXCL by tempfile.mkstemp in the
output's folder); at the end it becomes `out` by a hard link, which fails when `out` appeared in
the meantime (so of two runs to one output, the second is refused), or, with force, by
os.replace. The temporary file is removed on any error, Ctrl-C or SIGTERM.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import stat
import tempfile
import threading
from pathlib import Path
from typing import Iterator

from .errors import UsageError


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived while an output was being written (a KeyboardInterrupt, so every cleanup
    that runs for Ctrl-C runs for it)."""


def check_output(out: Path, force: bool) -> None:
    """Refuse an output path before any work: a missing folder, a folder, something other than a
    regular file (a device, a pipe: even with force), or an existing file without force.
    Raises UsageError."""
    if not out.parent.is_dir():
        raise UsageError(f"{out.parent} is not a folder; create it first or choose another output path")
    if out.is_dir():
        raise UsageError(f"{out} is a folder; give a file name for the output")
    if out.exists() or out.is_symlink():
        if not out.is_file():
            raise UsageError(f"{out} exists and is not a regular file (a device, a pipe or a dangling link); choose another output path")
        if not force:
            raise UsageError(f"{out} already exists; pass --force to overwrite it")


def _publish(tmp: Path, out: Path, force: bool) -> None:
    if force:
        if out.exists() and not stat.S_ISREG(out.stat().st_mode):
            raise UsageError(f"{out} is not a regular file; choose another output path")
        os.replace(tmp, out)
        return
    try:
        os.link(tmp, out)
    except FileExistsError:
        raise UsageError(f"{out} appeared while it was being written (another run?); pass --force to overwrite it") from None
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EMLINK):
            raise
        try:  # a file system without hard links: claim the name exclusively, then move onto it
            os.close(os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
        except FileExistsError:
            raise UsageError(f"{out} appeared while it was being written (another run?); pass --force to overwrite it") from None
        os.replace(tmp, out)
        return
    tmp.unlink()


@contextlib.contextmanager
def _sigterm_as_interrupt() -> Iterator[None]:
    """In the main thread, SIGTERM raises Terminated inside the block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def partial_output(out: Path, force: bool) -> Iterator[Path]:
    """Yield a fresh temporary path beside `out` to write; on normal exit it becomes `out`
    (exclusively unless force), on any exception, Ctrl-C or SIGTERM it is removed.

    Raises UsageError (see check_output; `out` created meanwhile without force) and OSError.
    """
    check_output(out, force)
    fd, name = tempfile.mkstemp(prefix=f".{out.name}.", suffix=".k4-partial", dir=out.parent)
    os.close(fd)
    tmp = Path(name)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)  # mkstemp's 0600 would pass to the output
    try:
        with _sigterm_as_interrupt():
            yield tmp
            _publish(tmp, out, force)
    finally:
        tmp.unlink(missing_ok=True)
