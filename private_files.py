"""Files that hold records or a ledger: readable by their owner only, whatever the umask.

Blocks' rows (raw unit ids, which also reveal the block assignment a table's hash key protects),
granted Examples, oblivious samples, a stream's state (its noise key) and the ledger's SQLite
file are private: they are written 0600 in directories 0700. With the usual umask 022 a plain
`open` or `os.makedirs` would make them 0644 / 0755, readable by every user of the machine.

Everything that writes such data goes through this module:
* `private_directory(path)`: create (or restrict) a directory 0700 before anything is written
  into it. A writer we do not control (Beam, TFX, ML Metadata's SQLite) then writes inside a
  directory nobody else can enter, whatever modes its files get;
* `open_private(path)`: a file created 0600 (an existing one is restricted first);
* `restrict_tree(path)`: after such a writer, its files 0600 and its directories 0700, so a
  copy that keeps modes (cp -p, rsync -a, a tar) stays private.
A remote location (`gs://...`, any `scheme://`) has no POSIX modes: its access is the bucket's
(IAM), and these leave it alone.
"""
from __future__ import annotations

import os
import re
from typing import IO

PRIVATE_FILE_MODE = 0o600
PRIVATE_DIRECTORY_MODE = 0o700
_REMOTE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def private_directory(path: str | os.PathLike) -> str:
    """`path` made 0700, created if missing with every missing parent 0700 too (a directory
    made to hold private data); existing parents are left as they are."""
    path = os.fspath(path)
    if _REMOTE.match(path):
        return path
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        private_directory(parent)
    try:
        os.mkdir(path, PRIVATE_DIRECTORY_MODE)
    except FileExistsError:
        pass
    os.chmod(path, PRIVATE_DIRECTORY_MODE)
    return path


def open_private(path: str | os.PathLike, mode: str = "wb", exclusive: bool = False) -> IO:
    """`path` opened for writing (`mode` "wb", "w", "ab" or "a"), created 0600; with
    `exclusive`, FileExistsError if it exists. An existing file is restricted to 0600 before
    anything is written."""
    flags = os.O_WRONLY | os.O_CREAT
    flags |= os.O_EXCL if exclusive else (os.O_APPEND if mode.startswith("a") else os.O_TRUNC)
    descriptor = os.open(path, flags, PRIVATE_FILE_MODE)
    os.fchmod(descriptor, PRIVATE_FILE_MODE)
    return os.fdopen(descriptor, mode)


def restrict_tree(path: str | os.PathLike) -> None:
    """Make `path` private: a file 0600; a directory 0700 with everything under it (files
    0600, directories 0700). Symbolic links are left alone (they are not followed)."""
    path = os.fspath(path)
    if _REMOTE.match(path):
        return
    if not os.path.isdir(path) or os.path.islink(path):
        if os.path.isfile(path) and not os.path.islink(path):
            os.chmod(path, PRIVATE_FILE_MODE)
        return
    os.chmod(path, PRIVATE_DIRECTORY_MODE)
    for root, directories, files in os.walk(path):
        for name in directories:
            if not os.path.islink(os.path.join(root, name)):
                os.chmod(os.path.join(root, name), PRIVATE_DIRECTORY_MODE)
        for name in files:
            if not os.path.islink(os.path.join(root, name)):
                os.chmod(os.path.join(root, name), PRIVATE_FILE_MODE)
