"""`python -I tied_exec.py <starter pid> <command...>`: become `command`, tied to the thread that started this.

Linux: the kernel SIGKILLs the process when the thread that started it ends (PR_SET_PDEATHSIG, kept across exec),
so a server cannot outlive the process that owns it however that one ends (a Ray actor killed with SIGKILL
included). Run as a file with -I: nothing of the package is imported before the exec.
"""
import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> None:
    starter, command = int(argv[1]), argv[2:]
    prctl = getattr(ctypes.CDLL(None, use_errno=True), "prctl", None)
    if prctl is not None:  # Linux
        if prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != starter:  # the starter ended before the tie was made
            os._exit(128 + signal.SIGKILL)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv)
