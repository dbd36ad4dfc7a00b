"""Test-only: lets tests/conftest.py ask a hung subprocess where it is. With NANO_RLHF_STACKS set, SIGUSR1 writes
this process's Python stacks (every thread) to $NANO_RLHF_STACKS/<pid>.txt; the process goes on."""
import os

if os.environ.get("NANO_RLHF_STACKS"):
    import faulthandler
    import signal

    _file = open(os.path.join(os.environ["NANO_RLHF_STACKS"], f"{os.getpid()}.txt"), "w")
    faulthandler.register(signal.SIGUSR1, file=_file, all_threads=True)
