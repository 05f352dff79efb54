"""The in-process guard that runs before a model-written program: an audit hook refusing process creation,
network use, ctypes, and writing, deleting or renaming files outside the program's directory.

It turns the ordinary accidents of model-written code into a clear "sandbox: ... is not allowed" failure.
It is not a security boundary: its state lives in the interpreter the program controls, so deliberate code
can undo it. Inside bubblewrap (see `isolation.py`) the operating system is the boundary; without it this
guard is all there is, and the benchmark refuses to run it unless the user accepts that.

It also reports that a program ran to its end: only once the program has returned does it write DONE on the
report pipe, a descriptor of its own that the harness reads, never the program's output. There is no secret
in the interpreter for the program to find (its frames, tracebacks, `inspect.stack()`, the collector's objects,
its files and environment hold nothing that passes when printed), and an early exit, in any way, leaves the
report empty. The report is not a boundary either: code written against this harness can write on that pipe
itself, as it can return an object equal to everything; the check is against accidents and output that
merely looks like a pass.
"""

from __future__ import annotations

DONE = b"ran to its end\n"  # what the guard writes on the report pipe once the program has returned

# Runs first in the child: installs the audit hook, executes the program file given as argv[1], and writes DONE on
# the report pipe, the descriptor given as argv[2], when the program has run to its end.
GUARD = r"""
import os, sys
_ROOT = os.path.realpath(os.getcwd())
_BLOCKED = ("os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty", "os.kill",
            "os.killpg", "subprocess.Popen", "pty.spawn", "socket.connect",
            "socket.bind", "socket.sendto", "ctypes.dlopen", "ctypes.dlsym", "shutil.rmtree", "os.chroot",
            "os.setuid", "os.setgid", "resource.setrlimit", "sys.addaudithook")
_PATHS = ("os.remove", "os.rmdir", "os.rename", "os.chmod", "os.chown", "os.truncate", "os.mkdir",
          "os.symlink", "os.link", "os.utime")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

def _inside(path):
    if isinstance(path, int):
        return True
    try:
        real = os.path.realpath(os.fsdecode(path))
    except Exception:
        return False
    return real == _ROOT or real.startswith(_ROOT + os.sep)

def _hook(event, args):
    if event in _BLOCKED:
        raise PermissionError(f"sandbox: {event} is not allowed")
    if event == "open":
        path, mode, flags = args
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (
            isinstance(flags, int) and flags & _WRITE_FLAGS)
        if writing and path is not None and not _inside(path):
            raise PermissionError(f"sandbox: writing {path!r} outside the sandbox is not allowed")
    elif event in _PATHS:
        paths = [a for a in args[:2] if isinstance(a, (str, bytes, os.PathLike))]
        if not all(_inside(p) for p in paths):
            raise PermissionError(f"sandbox: {event} outside the sandbox is not allowed")

def _main():
    # The report is written only after the program has run to its end, so an early exit (sys.exit, os._exit, an
    # atexit hook turning a failure into status 0) leaves it empty.
    program = open(sys.argv[1], encoding="utf-8").read()
    report = int(sys.argv[2])
    sys.addaudithook(_hook)
    del sys.argv[1:]
    try:
        exec(compile(program, "solution.py", "exec"), {"__name__": "__main__"})
    except SystemExit as stop:
        # Exiting early skips the tests, whatever the status: that is not a pass.
        sys.stderr.write(f"SystemExit({stop.code!r}) before the tests completed\n")
        sys.stderr.flush()
        os._exit(3)
    os.write(report, __DONE__)
    os.close(report)

_main()
""".replace("__DONE__", repr(DONE))
