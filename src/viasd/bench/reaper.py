"""The reaper: a small trusted process between the benchmark and a model-written program run without bubblewrap.

Killing a process group misses what the program started in a session of its own (`os.setsid`). On Linux
the reaper makes itself a child subreaper (`prctl(PR_SET_CHILD_SUBREAPER)`), so every orphaned descendant
of the program becomes its child instead of init's; when the program ends, or when the benchmark sends
SIGTERM at the time limit, it kills all of its children until none is left, then ends the way the program
ended (its exit status, or the same signal). Elsewhere it can only rely on the process group. It lives
outside the program's interpreter, but runs as the same user: deliberate code can still kill it first, which
is why model-written code needs bubblewrap (`isolation.py`) to be contained.
"""

from __future__ import annotations

# Run as `python -I -B -c REAPER PROGRAM ARGS...`.
REAPER = r"""
import os, signal, subprocess, sys

PR_SET_CHILD_SUBREAPER = 36

def subreaper():
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False

def children():
    me = str(os.getpid()).encode()
    found = []
    for name in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as handle:
                stat = handle.read()
        except OSError:
            continue
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 1 and fields[1] == me:
            found.append(int(name))
    return found

def reap_all():
    # Every pass kills every child, then collects one; a killed child's orphans are this process's children by then.
    while True:
        for pid in children():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return

class Stop(BaseException):
    pass

def stop(signum, frame):
    raise Stop

signal.signal(signal.SIGTERM, stop)
subreaper()
status = -signal.SIGKILL
try:
    program = subprocess.Popen(sys.argv[1:], close_fds=False)  # the program keeps the guard's report pipe
    status = program.wait()
except Stop:
    pass
except OSError as error:
    sys.stderr.write(f"cannot start the program: {error}\n")
    status = 126
signal.signal(signal.SIGTERM, signal.SIG_IGN)
reap_all()
if status < 0:
    signal.signal(-status, signal.SIG_DFL)
    os.kill(os.getpid(), -status)
    os._exit(128 - status)
os._exit(status)
"""
