"""The child side of `posttrain.rewards.sandbox`: set up the sandbox, then run the code in it.

The parent runs `python -I -S -X utf8 -c "import _sandbox_child..." KEY=VALUE...`, which
calls `main`. This file imports only the standard library (ctypes only where a syscall has
no Python wrapper): no site-packages are on the path. It becomes three processes:

    wrapper  the process the parent spawned. Enters new user (when not root), mount, net,
             pid, ipc and uts namespaces, builds a new root (system directories and the
             interpreter read-only, /tmp a small tmpfs and the working directory), chroots
             into it, then forks the init and waits for it.
    init     pid 1 of the new pid namespace: mounts a fresh /proc, forks the program, reaps
             orphans, writes the program's wait status to the control pipe and exits. Its
             exit makes the kernel SIGKILL everything left in the namespace.
    program  sets the rlimits, switches to the per-run uid, drops every capability, sets
             no_new_privs, installs the seccomp socket and namespace filter (fallback only), then runs the
             untrusted code in this same interpreter (`_sandbox_program._run`): `main.py`
             as `__main__`, or (tests mode) `solution.py` followed by the tests read from
             stdin, each outcome written to fd 3 behind a per-run nonce.

Without namespaces (the fallback) the same three processes run, minus the namespace steps.
Every failure before the untrusted code starts is written to the control pipe as
`setup-error <message>`; the parent turns it into `SandboxError`.

This file holds the setup; the program's last step, running the untrusted code, lives in
`_sandbox_program` (standard library only as well). It is imported at the top of this file,
from the directory the boot line puts on sys.path for this import alone: by the time the
program runs it (after the chroot and the switch to the per-run uid) that directory may be
out of reach.
"""

import os
import sys

# Imported here, while the boot line still has this directory on sys.path: the program runs
# it only after setup (chroot, per-run uid), when this directory may be out of reach.
from _sandbox_program import RESULT_FD, _run

# ---------------------------------------------------------------------------------------
# Setup: wrapper, init and program (as the parent's user).
# ---------------------------------------------------------------------------------------

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
MOUNT_OPTION_FLAGS = {
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": 0x400,
    "nodiratime": 0x800,
    "relatime": 0x200000,
}
SYS_MOUNT_SETATTR, AT_FDCWD, AT_RECURSIVE = 442, -100, 0x8000  # same number on every arch
MOUNT_ATTR_RDONLY, MOUNT_ATTR_NOSUID = 0x1, 0x2
PR_SET_PDEATHSIG, PR_SET_SECCOMP, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 22, 36, 38
SECCOMP_MODE_FILTER = 2
SETUP_FAILED = 125


class _Setup:
    """The parent's settings, from `KEY=VALUE` arguments (json would cost 8 ms to import)."""

    def __init__(self, args: list[str]) -> None:
        values: dict[str, list[str]] = {}
        for arg in args:
            key, _, value = arg.partition("=")
            values.setdefault(key, []).append(value)
        one = {k: v[-1] for k, v in values.items()}
        self.mode = one["mode"]
        self.workdir = one["workdir"]
        self.python = one["python"]
        self.parent = int(one["parent"])
        self.ctl = int(one["ctl"])
        self.res = int(one["res"])
        self.uid = int(one["uid"])  # -1: keep the caller's uid
        self.namespaces = one["namespaces"] == "1"
        self.userns = one["userns"] == "1"
        self.seccomp = one["seccomp"] == "1"
        self.block_sockets = one["block_sockets"] == "1"
        self.cpu_s = int(one["cpu_s"])
        self.memory_bytes = int(one["memory_bytes"])
        self.file_bytes = int(one["file_bytes"])
        self.nproc = int(one["nproc"])  # 0: no RLIMIT_NPROC (it would count the caller's processes)
        self.nofile = int(one["nofile"])
        self.interpreter = values.get("interpreter", [])  # dirs to bind into the new root


_LIBC = None


def _libc():
    global _LIBC
    if _LIBC is None:
        import ctypes

        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


def _check(ret: int, what: str) -> int:
    if ret < 0:
        import ctypes

        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")
    return ret


def _prctl(option: int, arg: int = 0) -> None:
    import ctypes

    _check(
        _libc().prctl(
            ctypes.c_int(option),
            ctypes.c_ulong(arg),
            ctypes.c_ulong(0),
            ctypes.c_ulong(0),
            ctypes.c_ulong(0),
        ),
        f"prctl({option})",
    )


def _unshare(flags: int) -> None:
    if hasattr(os, "unshare"):  # Python >= 3.12
        os.unshare(flags)
        return
    import ctypes

    _check(_libc().unshare(ctypes.c_int(flags)), "unshare")


def _mount(
    source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None
) -> None:
    import ctypes

    def c(s: str | None):
        return None if s is None else os.fsencode(s)

    _check(
        _libc().mount(c(source), c(target), c(fstype), ctypes.c_ulong(flags), c(data)),
        f"mount {target}",
    )


def _mount_setattr(path: str, flags: int, attr_set: int, attr_clr: int) -> None:
    import ctypes

    attr = (ctypes.c_uint64 * 4)(attr_set, attr_clr, 0, 0)
    _check(
        _libc().syscall(
            ctypes.c_long(SYS_MOUNT_SETATTR),
            ctypes.c_int(AT_FDCWD),
            os.fsencode(path),
            ctypes.c_uint(flags),
            ctypes.byref(attr),
            ctypes.c_size_t(ctypes.sizeof(attr)),
        ),
        f"mount_setattr {path}",
    )


def _report(ctl: int, line: str) -> None:
    try:
        os.write(ctl, (line.replace("\n", " ") + "\n").encode())
    except OSError:
        pass


def _die_with_parent(parent: int | None) -> None:
    """SIGKILL this process when its parent dies, so nothing outlives a killed sandbox.

    `parent` closes the race with a parent that died before the prctl; None where it cannot
    be checked (the parent of a pid namespace's init is outside it: getppid() is 0).
    """
    import signal

    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent is not None and os.getppid() != parent:
        os._exit(SETUP_FAILED)


def _mountpoints(under: str) -> list[tuple[str, int]]:
    """(mount point, MS_* flags to keep) for every mount at or below `under`, parents first."""
    mounts = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")  # octal escapes: \040 etc.
            if point == under or point.startswith(under.rstrip("/") + "/"):
                flags = 0
                for option in fields[5].split(","):
                    flags |= MOUNT_OPTION_FLAGS.get(option, 0)
                mounts.append((point, flags))
    return mounts


def _make_readonly(root: str) -> None:
    """Every mount at or below `root` read-only and nosuid (this mount namespace only)."""
    try:
        _mount_setattr(root, AT_RECURSIVE, MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID, 0)
        return
    except OSError as exc:
        if exc.errno != 38:  # ENOSYS: a kernel older than 5.12
            raise
    _remount_readonly(root)


def _remount_readonly(root: str) -> None:
    """`_make_readonly` for old kernels: one remount per mount, keeping its other flags."""
    for point, flags in _mountpoints(root):
        _mount(None, point, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | flags)


_SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
_DEVICES = ("null", "zero", "full", "random", "urandom")
_DEVICE_LINKS = {
    "fd": "/proc/self/fd",
    "stdin": "/proc/self/fd/0",
    "stdout": "/proc/self/fd/1",
    "stderr": "/proc/self/fd/2",
    "shm": "/tmp",
}


def _build_root(new: str, interpreter: list[str]) -> None:
    """A root with only what code needs, on a tmpfs mounted at `new`: the system
    directories and the interpreter read-only, a few devices, /proc, and /tmp."""
    _mount("tmpfs", new, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
    bound: list[str] = []
    for path in (*_SYSTEM_DIRS, *interpreter):
        if any(path.startswith(b + "/") for b in bound) or not os.path.lexists(path):
            continue
        if os.path.islink(path) and os.path.dirname(path) == "/":  # merged /usr: /bin -> usr/bin
            os.symlink(os.readlink(path), new + path)
            continue
        os.makedirs(new + path, exist_ok=True)
        _mount(path, new + path, None, MS_BIND | MS_REC)
        bound.append(path)
    os.mkdir(new + "/dev")
    for name in _DEVICES:
        open(f"{new}/dev/{name}", "w").close()
        _mount(f"/dev/{name}", f"{new}/dev/{name}", None, MS_BIND)
    for name, target in _DEVICE_LINKS.items():
        os.symlink(target, f"{new}/dev/{name}")
    os.mkdir(new + "/proc")
    os.mkdir(new + "/tmp")
    _make_readonly(new)


def _enter_namespaces(setup: _Setup) -> None:
    """New namespaces, and a new root in which /tmp (the working directory, a tmpfs of
    `file_bytes` plus room for the code) is the only writable place."""
    flags = CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    uid, gid = os.getuid(), os.getgid()
    if setup.userns:
        flags |= CLONE_NEWUSER
    _unshare(flags)
    if setup.userns:  # map only ourselves: the code keeps the caller's uid, minus every cap
        for name, text in (
            ("setgroups", "deny"),
            ("uid_map", f"{uid} {uid} 1"),
            ("gid_map", f"{gid} {gid} 1"),
        ):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    name = "solution.py" if setup.mode == "tests" else "main.py"
    with open(os.path.join(setup.workdir, name), "rb") as f:
        source = f.read()
    _build_root(setup.workdir, setup.interpreter)
    owner = setup.uid if setup.uid >= 0 else uid
    size = setup.file_bytes + (1 << 20)  # room for the code beside one file of the largest size
    _mount(
        "tmpfs",
        setup.workdir + "/tmp",
        "tmpfs",
        MS_NOSUID | MS_NODEV,
        f"size={size},mode=0700,uid={owner},gid={owner}",
    )
    os.chroot(setup.workdir)
    os.chdir("/tmp")
    with open(name, "wb") as f:
        f.write(source)
    setup.workdir = "/tmp"


def _seccomp_block_sockets() -> None:
    """Kernel-enforced fallback: socket() fails unless the family is AF_UNIX, and no new
    namespace can be made (unshare() at all, clone() with CLONE_NEWUSER: a user namespace
    would give the code every capability inside it, which the namespace plan refuses too).

    Inherited by every child and across exec. Foreign syscall ABIs (x32, int 0x80) and
    io_uring, which can open sockets without socket(), are refused as well. clone3() keeps its
    flags in memory a filter cannot read, so it fails with ENOSYS: libc then falls back to clone().
    """
    import ctypes
    import struct

    machine = os.uname().machine
    if machine not in ("x86_64", "aarch64"):
        raise OSError(95, f"no seccomp filter for {machine}")
    arch, nr_socket, nr_unshare, nr_clone = {"x86_64": (0xC000003E, 41, 272, 56),
                                             "aarch64": (0xC00000B7, 198, 97, 220)}[machine]
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    allow, deny, enosys = 0x7FFF0000, 0x00050000 | 1, 0x00050000 | 38  # SECCOMP_RET_ERRNO | EPERM, ENOSYS
    clone_newuser = 0x10000000
    program = [
        (ld, 0, 0, 4),  # arch
        (jeq, 1, 0, arch),
        (ret, 0, 0, deny),
        (ld, 0, 0, 0),  # syscall number
        (jge, 0, 1, 0x40000000),  # x32 ABI
        (ret, 0, 0, deny),
        (jeq, 0, 1, 425),  # io_uring_setup
        (ret, 0, 0, deny),
        (jeq, 0, 1, nr_unshare),
        (ret, 0, 0, deny),
        (jeq, 0, 1, 435),  # clone3
        (ret, 0, 0, enosys),
        (jeq, 0, 4, nr_clone),
        (ld, 0, 0, 16),  # args[0]: clone's flags (low 32 bits)
        (jset, 0, 1, clone_newuser),
        (ret, 0, 0, deny),
        (ret, 0, 0, allow),
        (jeq, 0, 3, nr_socket),
        (ld, 0, 0, 16),  # args[0]: the address family
        (jeq, 1, 0, 1),  # AF_UNIX
        (ret, 0, 0, deny),
        (ret, 0, 0, allow),
    ]
    filters = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in program))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(len(program), ctypes.addressof(filters))
    _check(
        _libc().prctl(
            ctypes.c_int(PR_SET_SECCOMP),
            ctypes.c_ulong(SECCOMP_MODE_FILTER),
            ctypes.byref(fprog),
            ctypes.c_ulong(0),
            ctypes.c_ulong(0),
        ),
        "seccomp",
    )


def _drop_capabilities() -> None:
    """Clear every capability (those a user namespace grants, where nothing else does)."""
    import ctypes

    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this thread
    data = (ctypes.c_uint32 * 6)()
    _check(_libc().capset(ctypes.byref(header), ctypes.byref(data)), "capset")


def _program(setup: _Setup, ctl: int) -> None:
    """Limits, then privileges, then run the code in this same interpreter (`_run`, from
    `_sandbox_program`); never returns.

    Reusing the wrapper's interpreter (fork, no exec) saves a second Python startup; the
    code gets a fresh `__main__` and nothing here is secret.
    """
    import resource
    import signal

    try:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the init ignores it
        if not setup.namespaces:  # its own group: the parent kills it, the init the rest
            os.setpgid(0, 0)
        os.chdir(setup.workdir)
        if setup.res >= 0:
            os.dup2(setup.res, RESULT_FD)
        keep = sorted({0, 1, 2, ctl} | ({RESULT_FD} if setup.res >= 0 else set()))
        for low, high in zip(keep, keep[1:] + [1 << 20]):
            os.closerange(low + 1, high)
        limits = [
            (resource.RLIMIT_CPU, setup.cpu_s, setup.cpu_s + 1),
            (resource.RLIMIT_AS, setup.memory_bytes, setup.memory_bytes),
            (resource.RLIMIT_FSIZE, setup.file_bytes, setup.file_bytes),
            (resource.RLIMIT_NOFILE, setup.nofile, setup.nofile),
            (resource.RLIMIT_CORE, 0, 0),
        ]
        if setup.nproc:
            limits.append((resource.RLIMIT_NPROC, setup.nproc, setup.nproc))
        for which, soft, hard in limits:
            resource.setrlimit(which, (soft, hard))
        stdlib = [path for path in sys.path if os.path.isdir(path)]
        if setup.uid >= 0:
            os.setgroups([])
            os.setgid(setup.uid)
            os.setuid(setup.uid)
            for path in stdlib:  # a Python under /root cannot serve another uid's imports
                try:
                    os.listdir(path)
                except OSError as exc:
                    message = f"uid {setup.uid} cannot read the standard library: {exc}"
                    raise OSError(message) from exc
        _drop_capabilities()
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        if setup.seccomp:
            _seccomp_block_sockets()
    except BaseException as exc:
        _report(ctl, f"setup-error program: {exc}")
        os._exit(SETUP_FAILED)
    os.close(ctl)
    sys.dont_write_bytecode = True
    _run(setup.mode, setup.block_sockets)
    # Leave by SystemExit, so the interpreter ends as for any script: atexit handlers,
    # non-daemon threads joined, buffers flushed. Nothing up the stack catches it.
    sys.exit(0)


def _descendants(ancestor: int) -> list[int]:
    """Every live process below `ancestor`, from /proc."""
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rpartition(")")[2].split()
            except OSError:
                continue
            if fields[0] not in "ZX":
                children.setdefault(int(fields[1]), []).append(int(name))
    found, queue = [], list(children.get(ancestor, []))
    while queue:
        pid = queue.pop()
        found.append(pid)
        queue.extend(children.get(pid, []))
    return found


def _kill_descendants() -> None:
    """Without a pid namespace: kill what the program left, setsid or not. The init is a
    child subreaper, so every orphan below the program is re-parented to it."""
    import signal

    for _ in range(200):
        pids = _descendants(os.getpid())
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break


def _init(setup: _Setup, ctl: int, wrapper: int) -> None:
    """Pid 1 of the sandbox (or, without namespaces, its subreaper): start the program,
    reap, report its status, and leave nothing behind."""
    import signal

    try:
        _die_with_parent(None if setup.namespaces else wrapper)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if setup.namespaces:
            try:
                _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
            except OSError:
                pass  # some container runtimes forbid it; /proc then stays empty
        else:
            _prctl(PR_SET_CHILD_SUBREAPER, 1)
        program = os.fork()
    except BaseException as exc:
        _report(ctl, f"setup-error init: {exc}")
        os._exit(SETUP_FAILED)
    if program == 0:
        _program(setup, ctl)
    _report(ctl, f"started {program}")
    if setup.res >= 0:
        os.close(setup.res)
    status = None
    while status is None:
        try:
            pid, wait_status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if pid == program:
            status = wait_status
    if not setup.namespaces:
        _kill_descendants()  # with namespaces the kernel does it when this process exits
    if status is not None:
        _report(ctl, f"status {status}")
    os._exit(0)


def _wrapper(setup: _Setup) -> None:
    import fcntl

    try:
        _die_with_parent(setup.parent)
        # Out of the way of RESULT_FD, which the program's dup2 takes over.
        ctl, setup.ctl = setup.ctl, fcntl.fcntl(setup.ctl, fcntl.F_DUPFD_CLOEXEC, 10)
        os.close(ctl)
        if setup.res >= 0:
            res, setup.res = setup.res, fcntl.fcntl(setup.res, fcntl.F_DUPFD, 10)
            os.close(res)
        os.umask(0o022)
        if setup.namespaces:
            _enter_namespaces(setup)
        wrapper = os.getpid()
        init = os.fork()
    except BaseException as exc:
        _report(setup.ctl, f"setup-error wrapper: {exc}")
        os._exit(SETUP_FAILED)
    if init == 0:
        _init(setup, setup.ctl, wrapper)
    _report(setup.ctl, f"init {init}")
    if setup.res >= 0:
        os.close(setup.res)
    os.waitpid(init, 0)
    os._exit(0)


def main(argv: list[str]) -> None:
    _wrapper(_Setup(argv[1:]))


if __name__ == "__main__":
    main(sys.argv)
