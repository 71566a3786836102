"""Which compiled packages may be loaded. Loading one runs its native code in the engine's process
(AOTInductor dlopens the library inside), so a package is trusted only when this user's own build
wrote it into a folder nobody else can write to:

- the folder belongs to this user and neither its group nor others may write to it, and every
  folder above it belongs to this user or root and is not writable by others (unless sticky, as
  /tmp is: there nobody may rename another user's entries), so nobody else can put a file there,
  swap one, or move the folder away and put another in its place;
- the build records the package's sha256 beside it (`<package>.sha256`, in `sha256sum`'s format)
  as it installs it, and a package loads only while its bytes match that record. A package with
  no record, or one that does not match, was not written by this user's build as it stands.

Checking the bytes first and loading them after is safe only because of the folder's rule: no
other user can change the file in between.
"""
from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

DIGEST_SUFFIX = ".sha256"


def digest_path(package: Path) -> Path:
    return package.with_name(package.name + DIGEST_SUFFIX)


def folder_problem(folder: Path) -> str | None:
    """Why packages in `folder` (which exists) must not be loaded, or None when they may be."""
    uid = os.geteuid()
    real = folder.resolve()
    info = real.stat()
    if info.st_uid != uid:
        return f"{real} belongs to uid {info.st_uid}, not to this user (uid {uid})"
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (f"{real} is writable by its group or others (mode {stat.S_IMODE(info.st_mode):o}); "
                f"`chmod go-w {real}` or set $PAGEDCHAT_COMPILED_DIR to a folder of your own")
    for above in real.parents:
        info = above.stat()
        if info.st_uid not in (uid, 0):
            return f"{above}, which holds {real}, belongs to uid {info.st_uid}, not to this user or root"
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not info.st_mode & stat.S_ISVTX:
            return (f"{above}, which holds {real}, is writable by its group or others without the sticky bit "
                    f"(mode {stat.S_IMODE(info.st_mode):o}): they could replace the folder")
    return None


def sha256_of(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()  # reading and hashing release the GIL


def install(staging: Path, package: Path) -> None:
    """Record the sha256 of the finished package `staging` as `package`'s, then rename it into
    place (a reader never sees half a package; one that sees the record before the package finds
    a mismatch and rebuilds)."""
    record = digest_path(package)
    written = record.with_name(f"{record.name}.{os.getpid()}.tmp")
    written.write_text(f"{sha256_of(staging)}  {package.name}\n")
    written.replace(record)
    staging.replace(package)


def digest_problem(package: Path) -> str | None:
    """Why `package` is not the one this user's build recorded, or None when it is."""
    record = digest_path(package)
    uid = os.geteuid()
    for path in (package, record):
        try:
            info = path.lstat()
        except FileNotFoundError:
            return "no recorded digest (a build of this version writes one)" if path == record else "missing"
        if not stat.S_ISREG(info.st_mode) or info.st_uid != uid:
            return f"{path.name} is not a plain file of this user's"
    recorded = record.read_text().split()
    if not recorded or recorded[0] != sha256_of(package):
        return "its sha256 differs from the digest its build recorded"
    return None
