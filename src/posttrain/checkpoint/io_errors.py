"""A failed write as the operating system said it: `io_error` finds the OSError (no space,
quota, read-only, permission, I/O) behind each writer's own report of it."""

from __future__ import annotations

import errno
import os
import re

_WRITE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EACCES, errno.EPERM, errno.EIO}
_RUST_IO_ERROR = re.compile(r"Os \{ code: (\d+)")


def io_error(err: BaseException) -> OSError | None:
    """The operating system's error behind a failed write (no space, quota, read-only, permission,
    I/O), or None when `err` is not one.

    Writers report a full disk each their own way: Python as OSError(ENOSPC), safetensors as
    `SafetensorError('... IoError(Os { code: 28, kind: StorageFull, ...')`, torch.save to a
    path as `RuntimeError('[enforce fail at inline_container.cc...] unexpected pos')`, with no
    cause at all, which is why we save through `save_torch`: its RuntimeError then comes while
    handling the file's OSError, found here in the exception's context.
    """
    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, OSError):
            code = seen.errno
        else:
            found = _RUST_IO_ERROR.search(str(seen)) if type(seen).__name__ == "SafetensorError" else None
            code = int(found.group(1)) if found else None
        if code in _WRITE_ERRORS:
            return OSError(code, os.strerror(code))
        seen = seen.__cause__ or seen.__context__
    return None
