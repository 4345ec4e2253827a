"""The program's last step in `posttrain.rewards.sandbox`: run the untrusted code.

`_sandbox_child._program` calls `_run` once setup is done: in the program process, in the
interpreter the wrapper started, after it has chrooted into the new root (namespace plan),
set the rlimits, switched to the per-run uid, dropped every capability, set no_new_privs and
installed the seccomp filter (fallback plan). `_run` runs `main.py` as `__main__` (script
mode; fd 3 is not open), or `solution.py` followed by the tests read from stdin (tests
mode), writing one line per outcome to fd 3 (`RESULT_FD`, the result pipe), each tagged
with a nonce drawn per run: see `_run_tests` for the records.

Like `_sandbox_child`, this file imports only the standard library: the child interpreter
runs with `-I -S`, so no site-packages are on the path. `_sandbox_child` imports it at its
top, while the directory holding both files is still on sys.path (the boot line in
`sandbox.py` removes it again right after). By the time `_run` is called that directory
may be out of reach (outside the new root, or unreadable to the per-run uid), so nothing
may be imported from it lazily; the imports made here at run time are standard library
modules, which stay reachable (the new root binds the interpreter, and `_program` checks
that the per-run uid can read them).
"""

import os
import sys

RESULT_FD = 3


def _block_python_sockets() -> None:
    """The weakest network fallback: make socket creation in this interpreter raise.

    Code can get around it (ctypes, a subprocess that is not Python); it is used only where
    neither a network namespace nor seccomp is available.
    """
    import _socket
    import socket

    def refuse(*args, **kwargs):
        raise PermissionError("network access is disabled in the sandbox")

    for module in (socket, _socket):
        for name in (
            "socket",
            "SocketType",
            "create_connection",
            "create_server",
            "fromfd",
            "socketpair",
            "getaddrinfo",
            "gethostbyname",
            "gethostbyname_ex",
        ):
            if hasattr(module, name):
                setattr(module, name, refuse)


def _fresh_module(name: str, filename: str):
    import builtins

    module = type(sys)(name)
    module.__file__ = filename
    module.__builtins__ = builtins
    sys.modules[name] = module
    return module


def _run_script() -> None:
    """Run `main.py` as `__main__`, with tracebacks that show only the user's frames."""
    sys.argv[:] = ["main.py"]
    with open("main.py", "rb") as f:
        source = f.read()
    try:
        code = compile(source, "main.py", "exec")
    except SyntaxError as exc:
        sys.excepthook(type(exc), exc, None)
        sys.exit(1)
    module = _fresh_module("__main__", "main.py")
    try:
        exec(code, module.__dict__)
    except SystemExit:
        raise
    except BaseException as exc:
        exc.__traceback__ = exc.__traceback__.tb_next  # drop this frame
        sys.excepthook(type(exc), exc, exc.__traceback__)
        sys.exit(1)


def _describe(exc: BaseException) -> str:
    """`Type: message` on one line, short, never raising (the exception is untrusted)."""
    try:
        message = str(exc)
        text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    except BaseException:
        text = "exception (unprintable)"
    return text.replace("\r", " ").replace("\n", " ")[:300]


def _run_tests() -> None:
    """Run `solution.py`, then each test from stdin; write one record per test to fd 3.

    Records are `<nonce> start`, `<nonce> code <error>`, `<nonce> <i> pass`,
    `<nonce> <i> fail <error>` and `<nonce> done`. The nonce is drawn here and announced by
    the first line on fd 3, both before any untrusted code runs, so the untrusted code
    writing to fd 3 or stdout cannot forge a record without first digging the nonce out of
    this frame (see docs/sandbox.md, threat model).
    Every name used after the untrusted code starts is bound here first, so rebinding
    builtins or module attributes cannot change what this function does.
    """
    import builtins
    import marshal

    write, compile_, exec_, describe = os.write, compile, exec, _describe
    settrace, setprofile, base_exception = sys.settrace, sys.setprofile, BaseException
    nonce = os.urandom(16).hex()

    def report(record: str) -> None:
        write(RESULT_FD, f"{nonce} {record}\n".encode())

    report("start")
    sources = marshal.loads(sys.stdin.buffer.read())
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    tests = [(i, compile_(src, f"<test {i}>", "exec")) for i, src in enumerate(sources)]
    del sources
    pristine_builtins = dict(builtins.__dict__)
    module = _fresh_module("solution", "solution.py")
    try:
        with open("solution.py", "rb") as f:
            exec_(compile_(f.read(), "solution.py", "exec"), module.__dict__)
    except base_exception as exc:
        report(f"code {describe(exc)}")
    # The tests see the solution's names, but never its replacements for builtins.
    namespace = {k: v for k, v in module.__dict__.items() if k not in pristine_builtins}
    namespace["__builtins__"] = pristine_builtins
    for i, code in tests:
        settrace(None)
        setprofile(None)
        try:
            exec_(code, namespace)
        except base_exception as exc:
            report(f"{i} fail {describe(exc)}")
        else:
            report(f"{i} pass")
    report("done")


def _run(mode: str, block_sockets: bool) -> None:
    """Run the untrusted code: the tests harness in "tests" mode, else `main.py`."""
    import builtins

    # -S skips `site`, which is what normally defines exit() and quit().
    builtins.exit = builtins.quit = sys.exit
    if block_sockets:
        _block_python_sockets()
    if mode == "tests":
        _run_tests()
    else:
        _run_script()
