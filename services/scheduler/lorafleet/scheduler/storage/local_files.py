"""The local backend's objects as files: key to path, atomic write-once commits, listing.

Objects are files under `root_dir` at their key's path. A PUT streams its body into a temporary
file beside the target (named with the reserved `.lftmp-` prefix, which no key may use), fsyncs
it and links it to the target's name (renames, for the scheduler's own `put_bytes`), so a
reader sees a whole object, never a part, and a crash mid-upload leaves at most a temporary file
that the store's `start()` sweeps away (`Files.prepare`).

Everything here blocks: the store runs it through `in_thread`, the server through
`asyncio.to_thread`.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import hashlib
import os
import stat
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import BinaryIO, Final, ParamSpec, TypeVar

from lorafleet.core.errors import InvalidArgument, StorageError
from lorafleet.scheduler.storage.base import (
    RESERVED_SEGMENT_PREFIX,
    ObjectInfo,
    ObjectNotFound,
    validate_key,
)

_P = ParamSpec("_P")
_T = TypeVar("_T")

# Read and write in blocks of this size: big enough that the thread hop per block is cheap,
# small enough that a multi-GB upload never sits in memory.
IO_BLOCK_BYTES: Final = 1024 * 1024


def is_object(path: Path) -> bool:
    """Whether `path` (from `Files.path_for`) is a stored object."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False


def open_object(path: Path) -> tuple[BinaryIO, int]:
    # O_NOFOLLOW: `Files.path_for` already refused symlinks; this closes the gap in which one
    # could be swapped in for the last component.
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise IsADirectoryError(str(path))
        return os.fdopen(fd, "rb"), info.st_size
    except BaseException:
        os.close(fd)
        raise


class Files:
    """Objects as files under one root: key -> path, atomic writes, listing, deletion.

    Blocking; callers run these methods in threads.
    """

    def __init__(self, root: Path) -> None:
        # Resolved once, so that every object path is compared with the real location.
        self._root = Path(os.path.realpath(root))

    def path_for(self, key: str) -> Path:
        """The file for `key` (a validated key); refuses paths that run through a symlink."""
        path = self._root.joinpath(*key.split("/"))
        # realpath resolves the existing part of the path; anything different from the literal
        # path means a symlink on the way, which could lead outside the root.
        if os.path.realpath(path) != str(path):
            raise StorageError(f"key {key!r} runs through a symlink; refused", retryable=False)
        return path

    def write(self, key: str, data: bytes) -> None:
        """The scheduler's own write (`put_bytes`): replaces, as it is trusted to."""
        writer = AtomicWriter(self.path_for(key))
        try:
            for start in range(0, len(data), IO_BLOCK_BYTES):
                writer.write(data[start : start + IO_BLOCK_BYTES])
            writer.commit(replace=True)
        finally:
            writer.abort()

    def read(self, key: str) -> bytes:
        try:
            file, _ = open_object(self.path_for(key))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise ObjectNotFound(key) from None
        with file:
            return file.read()

    def read_range(self, key: str, start: int, length: int) -> bytes:
        try:
            file, _ = open_object(self.path_for(key))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            raise ObjectNotFound(key) from None
        with file:
            file.seek(start)
            return file.read(length)

    def verify(self, key: str, size_bytes: int, sha256: str) -> bool:
        try:
            file, size = open_object(self.path_for(key))
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return False
        except StorageError:
            # Through a symlink: not an object this store wrote.
            return False
        with file:
            if size != size_bytes:
                return False
            digest = hashlib.sha256()
            read = 0
            while block := file.read(IO_BLOCK_BYTES):
                read += len(block)
                digest.update(block)
        return read == size_bytes and digest.hexdigest() == sha256

    def delete(self, keys: Sequence[str]) -> None:
        for key in dict.fromkeys(keys):
            path = self.path_for(key)
            try:
                path.unlink()
            except (FileNotFoundError, NotADirectoryError):
                continue
            except IsADirectoryError:
                # `key` is only a folder of other keys: there is no object to delete.
                continue
            self._prune_empty_parents(path.parent)

    def list(self, prefix: str) -> builtins.list[ObjectInfo]:
        # Start at the deepest folder that holds every match, then filter by plain string
        # prefix, as S3 does ("jobs/a" matches "jobs/ab/x").
        folder = prefix.rpartition("/")[0]
        found: builtins.list[ObjectInfo] = []
        stack = [(self._root.joinpath(*folder.split("/")) if folder else self._root, folder)]
        while stack:
            directory, rel = stack.pop()
            try:
                entries = os.scandir(directory)
            except (FileNotFoundError, NotADirectoryError):
                continue
            with entries:
                for entry in entries:
                    if entry.name.startswith(RESERVED_SEGMENT_PREFIX):
                        continue
                    key = f"{rel}/{entry.name}" if rel else entry.name
                    # Symlinks are neither followed nor listed: they are not objects we wrote.
                    if entry.is_dir(follow_symlinks=False):
                        if (key + "/").startswith(prefix) or prefix.startswith(key + "/"):
                            stack.append((Path(entry.path), key))
                    elif entry.is_file(follow_symlinks=False) and key.startswith(prefix):
                        try:
                            validate_key(key)
                            size = entry.stat(follow_symlinks=False).st_size
                        except (InvalidArgument, FileNotFoundError):
                            # A file no key could name, or one deleted while listing.
                            continue
                        found.append(ObjectInfo(key=key, size_bytes=size))
        found.sort(key=lambda info: info.key)
        return found

    def prepare(self) -> int:
        """Create the root and remove partial uploads a crash left behind; returns how many."""
        self._root.mkdir(parents=True, exist_ok=True)
        removed = 0
        for directory, subdirs, files in os.walk(self._root):
            subdirs[:] = [d for d in subdirs if not d.startswith(RESERVED_SEGMENT_PREFIX)]
            for name in files:
                if name.startswith(RESERVED_SEGMENT_PREFIX):
                    Path(directory, name).unlink(missing_ok=True)
                    removed += 1
        return removed

    def _prune_empty_parents(self, directory: Path) -> None:
        # S3 has no folders; without this, every finished job would leave empty ones behind.
        while directory != self._root:
            try:
                directory.rmdir()
            except OSError:
                return
            directory = directory.parent


class KeyConflict(StorageError):
    """`a` and `a/b` cannot both be files: the key collides with another key's folder."""

    def __init__(self, message: str) -> None:
        super().__init__(message, retryable=False)


class ObjectExists(StorageError):
    """The key already holds an object, and the write was create-only (write-once)."""

    def __init__(self) -> None:
        super().__init__("an object already exists at this key", retryable=False)


class AtomicWriter:
    """Writes one object into a temporary file beside it, then links or renames it into place.

    `abort()` is always safe to call and a no-op after `commit()`; it waits for a commit running
    in another thread rather than racing it.
    """

    def __init__(self, path: Path) -> None:
        self._path = path
        self._lock = threading.Lock()
        self._done = False
        try:
            fd, temp = self._make_temporary(path.parent)
        except (FileExistsError, NotADirectoryError) as exc:
            raise KeyConflict(f"{path.name!r}: a parent folder is an existing object") from exc
        except PermissionError as exc:
            raise StorageError(f"cannot write {path}: {exc}", retryable=False) from exc
        except OSError as exc:
            raise StorageError(f"cannot write {path}: {exc}", retryable=True) from exc
        self._temp = Path(temp)
        self._file = os.fdopen(fd, "wb")

    @staticmethod
    def _make_temporary(directory: Path) -> tuple[int, str]:
        for _ in range(4):
            directory.mkdir(parents=True, exist_ok=True)
            try:
                return tempfile.mkstemp(prefix=RESERVED_SEGMENT_PREFIX, dir=directory)
            except FileNotFoundError:
                # A delete pruned the folder between mkdir and mkstemp: make it again.
                continue
        raise OSError(f"{directory} keeps disappearing")

    def write(self, data: bytes) -> None:
        try:
            self._file.write(data)
        except OSError as exc:
            raise StorageError(f"cannot write {self._path}: {exc}", retryable=True) from exc

    def commit(self, *, replace: bool) -> None:
        """Make the object visible. `replace=False` (write-once): raises `ObjectExists` if the
        key holds an object, atomically, whoever else is committing the same key meanwhile."""
        with self._lock:
            try:
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()
                if replace:
                    os.replace(self._temp, self._path)
                else:
                    # link(2) fails with EEXIST if the name exists: the check and the write are
                    # one step, so of two racing uploads exactly one creates the object.
                    os.link(self._temp, self._path)
            except FileExistsError as exc:
                if not replace and is_object(self._path):
                    raise ObjectExists() from exc
                raise KeyConflict(f"{self._path.name!r} is a folder of other objects") from exc
            except IsADirectoryError as exc:
                raise KeyConflict(f"{self._path.name!r} is a folder of other objects") from exc
            except OSError as exc:
                raise StorageError(f"cannot write {self._path}: {exc}", retryable=True) from exc
            self._done = True
            if not replace:
                # The object has its name; the temporary one goes (a crash here leaves a second
                # name for the same bytes, which `start()` sweeps).
                with contextlib.suppress(OSError):
                    self._temp.unlink()
            # The rename is durable only once the folder's entry is on disk.
            _fsync_directory(self._path.parent)

    def abort(self) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
            self._file.close()
            self._temp.unlink(missing_ok=True)


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


async def in_thread(
    operation: str, key: str, fn: Callable[_P, _T], *args: _P.args, **kwargs: _P.kwargs
) -> _T:
    """Run blocking file work off the event loop, turning OS errors into `StorageError`."""
    try:
        return await asyncio.to_thread(fn, *args, **kwargs)
    except StorageError:
        raise
    except PermissionError as exc:
        raise StorageError(f"{operation} {key!r}: {exc}", retryable=False) from exc
    except OSError as exc:
        # Disk full, I/O errors: may clear up; the caller decides.
        raise StorageError(f"{operation} {key!r}: {exc}", retryable=True) from exc
