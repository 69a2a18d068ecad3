"""What is not private under a path: for tests that check records and ledgers are written 0600 in
0700 directories (sage_tfx.private_files)."""
import os
import stat


def not_private(path) -> list[str]:
    """The entries at and under `path` (a file or a directory) whose mode is not 0600 (files)
    or 0700 (directories), each as 'path mode'."""
    path = os.fspath(path)
    entries = [path]
    for root, directories, files in os.walk(path):
        entries += [os.path.join(root, name) for name in directories + files]
    found = []
    for entry in entries:
        mode = os.lstat(entry).st_mode
        wanted = 0o700 if stat.S_ISDIR(mode) else 0o600
        if stat.S_IMODE(mode) != wanted:
            found.append(f"{entry} {oct(stat.S_IMODE(mode))}")
    return found
