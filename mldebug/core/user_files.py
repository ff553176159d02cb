"""Where mldebug keeps files of its own, and how it writes any file, so that nothing it
did not create is ever lost.

The rules every writer in the package follows (docs/security.md lists each file):
- a file the user names (a `--report`) is only appended to, one `write()` a record
  (`append_line`), never truncated or rewritten;
- a file mldebug owns (a built kernel, an attach connection file, a recorded run's
  database when it replaces an earlier one) is written under a temporary name in the same
  folder and renamed over the old one (`replace_atomically`): a reader, a killed process
  or a second process writing at the same moment sees the old file or the new one, whole;
- files that hold something only the user may read (a prompt's key) are created 0600
  inside a folder only the user can open (`private_dir`);
- a descriptor mldebug did not open is never reopened for writing by path (a shell's
  `> train.log` opened without O_APPEND: a second open would write at its own offset, and
  "w" would truncate it); see remote_prompt.announce.
"""
from __future__ import annotations

import os
import stat
import tempfile


def private(d: str) -> bool:
    """Whether D is (now) a folder of this user's that no one else may write to: a library
    found there is loaded into this process and a key kept there guards a prompt, so
    another user must not be able to put one there or read one (a shared /tmp)."""
    try:
        os.makedirs(d, mode=0o700, exist_ok=True)
        st = os.lstat(d)
    except OSError:
        return False
    return (stat.S_ISDIR(st.st_mode) and not st.st_mode & 0o022 and os.access(d, os.W_OK)
            and (not hasattr(os, "getuid") or st.st_uid == os.getuid()))


def cache_dir() -> str:
    """$MLDEBUG_CACHE_DIR, else $XDG_CACHE_HOME/mldebug or ~/.cache/mldebug, else
    /tmp/mldebug-UID: the first that is private (`private`); else a new private folder
    for this process only."""
    d = os.environ.get("MLDEBUG_CACHE_DIR")
    if not d:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"),
                                                                 ".cache")
        d = os.path.join(base, "mldebug")
    user = os.getuid() if hasattr(os, "getuid") else 0
    for where in (d, os.path.join(tempfile.gettempdir(), f"mldebug-{user}")):
        if private(where):
            return where
    return tempfile.mkdtemp(prefix="mldebug-")


def private_dir(name: str) -> str:
    """cache_dir()/NAME, made 0700; raises OSError when it cannot be made private."""
    d = os.path.join(cache_dir(), name)
    if not private(d):
        raise OSError(f"{d} is not a folder only you can open")
    os.chmod(d, 0o700)           # (makedirs' mode is masked by the umask)
    return d


def replace_atomically(path: str, data: bytes, mode: int = 0o644) -> None:
    """Write DATA to PATH: a temporary file in PATH's folder, made MODE before anything is
    written to it, flushed to disk, then renamed over PATH."""
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".mldebug-", dir=folder)   # 0600 from the start
    try:
        if mode != 0o600:
            os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise


def append_line(path: str, text: str, mode: int = 0o644) -> None:
    """Append TEXT (one record, newline-terminated) to PATH in one write() on a descriptor
    opened O_APPEND: records of several processes sharing the file never interleave, and
    what the file held stays as it was."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, mode)
    try:
        os.write(fd, text.encode("utf-8"))
    finally:
        os.close(fd)
