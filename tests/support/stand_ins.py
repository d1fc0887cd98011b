"""Stand-ins for checks the flow runs in a child process (`in_child`): a test's lambda does not
pickle, so what replaces such a check is a module-level function the child can import."""


def no_hardware_check(recipe) -> None:
    """Lets a GPU-only recipe past the worker's hardware check."""


def runs_out_of_memory() -> None:
    """Dies as the kernel's out-of-memory killer ends a process."""
    import os
    import signal

    os.kill(os.getpid(), signal.SIGKILL)
