"""The in-process guard that runs before a model-written program: an audit hook refusing process creation,
network use, ctypes, and writing, deleting or renaming files outside the program's directory.

It turns the ordinary accidents of model-written code into a clear "sandbox: ... is not allowed" failure.
It is not a security boundary: its state lives in the interpreter the program controls, so deliberate code
can undo it. Inside bubblewrap (see `isolation.py`) the operating system is the boundary; without it this
guard is all there is, and the benchmark refuses to run it unless the user accepts that.

It also proves that a program ran to its end: it reads the run's random nonce from standard input before the
program starts and prints it only after the program has returned, so an early exit cannot pass.
"""

from __future__ import annotations

# Runs first in the child: reads the run's nonce from standard input, installs the audit hook, executes the
# program file given as argv[1], and prints the nonce when the program has run to its end.
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
    # The harness writes this run's nonce on standard input; it is printed only after the program has run to its
    # end, so an early exit (sys.exit, os._exit, an atexit hook turning a failure into status 0) cannot pass.
    nonce = sys.stdin.readline().strip()
    quiet = os.open(os.devnull, os.O_RDONLY)
    os.dup2(quiet, 0)
    os.close(quiet)
    program = open(sys.argv[1], encoding="utf-8").read()
    sys.addaudithook(_hook)
    del sys.argv[1:]
    try:
        exec(compile(program, "solution.py", "exec"), {"__name__": "__main__"})
    except SystemExit as stop:
        # Exiting early skips the tests, whatever the status: that is not a pass.
        sys.stderr.write(f"SystemExit({stop.code!r}) before the tests completed\n")
        sys.stderr.flush()
        os._exit(3)
    os.write(1, ("\n" + nonce + "\n").encode())

_main()
"""
