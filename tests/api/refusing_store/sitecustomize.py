"""Test-only: the file system's refusals of a write, for a test server started with this folder on
PYTHONPATH (``tests/api/test_lifecycle_sweep.py``).

A disk that is really full or read-only can be made only with a mount, which needs root. So while
the file named by ``ENGRAM_TEST_REFUSE_FLAG`` exists, ``os.replace`` onto, and ``os.unlink`` of, a
path under ``ENGRAM_TEST_REFUSED_ROOT`` raise the ``OSError`` the kernel would: the flag holds the
errno's name (``ENOSPC``, ``EROFS``) and, optionally, a size in bytes: then only a file bigger than
that is refused (a disk with a little room left). Those two calls are how the file store publishes
and deletes every object (``service/storage/local.py``); everything else runs for real.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

_FLAG = os.environ.get("ENGRAM_TEST_REFUSE_FLAG")
_ROOT = os.environ.get("ENGRAM_TEST_REFUSED_ROOT")


def _refusal(path: str | os.PathLike[str], size: int) -> OSError | None:
    if not _FLAG or not _ROOT or not os.path.exists(_FLAG):
        return None
    if not os.path.realpath(os.fspath(path)).startswith(os.path.realpath(_ROOT) + os.sep):
        return None
    name, _, smallest = Path(_FLAG).read_text().strip().partition(" ")
    if smallest and size <= int(smallest):
        return None
    code = getattr(errno, name)
    return OSError(code, os.strerror(code), os.fspath(path))


if _FLAG and _ROOT:
    _replace, _unlink = os.replace, os.unlink

    def _refusing_replace(src, dst, *args, **kwargs):  # type: ignore[no-untyped-def]
        refused = _refusal(dst, os.path.getsize(src) if os.path.isfile(src) else 0)
        if refused is not None:
            raise refused
        return _replace(src, dst, *args, **kwargs)

    def _refusing_unlink(path, *args, **kwargs):  # type: ignore[no-untyped-def]
        refused = _refusal(path, 0) if os.path.isfile(path) else None
        if refused is not None and refused.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise refused  # a full disk still deletes; a read-only one does not
        return _unlink(path, *args, **kwargs)

    os.replace, os.unlink = _refusing_replace, _refusing_unlink
