"""Benchmark: how long `compressflow validate` takes to refuse a bad input, as a user runs it.

Each case is a params.yaml run as `python -m compressflow.flows.cli validate params.yaml` in a
fresh process (its start, Prefect's import and the forkserver's, if any, included), three times;
the median wall time and the first line it printed are listed beside the valid input's. The
inputs, made once under the work folder from the tiny Llama (`demo.assets.build_tiny_llama`):

    valid                 the tiny model, W4A16, python_docs: every check passes
    config not JSON       config.json cut off mid-object
    truncated shard       model.safetensors cut to half its size
    template syntax       tokenizer_config.json's chat_template with an unclosed {{ ... }
    auto_map              config.json names its own code (auto_map), trust_remote_code unset
    pickle-only weights   pytorch_model.bin (torch.save of the same weights), no safetensors
    unknown preset        recipe: W4A61
    missing placeholder   a recipe using $damp without recipe_args
    output in source      save_directory inside the model's folder
    binary dataset        dataset_name: a .txt file of binary bytes

    python -m benchmarks.refusal_time [--repeats 3] [--workdir DIR] [--pythonpath DIR]

`--pythonpath` runs another checkout's code with this virtualenv (e.g. the code before a change:
`git worktree add /tmp/before HEAD`, then link its flows, tasks, blocks and demo folders into
/tmp/before/compressflow, as the editable install maps them). The floor, measured in every round
beside the cases, is a process that only starts and imports what validate imports (about 1.5 s
here on a quiet machine): no refusal can be faster. Target: every bad input refused (exit 2)
within TARGET_ABOVE_FLOOR of the floor, so about 2 s; exits 1 when one is not.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# A refusal's own cost, above a process that only imports: the checks and the message.
TARGET_ABOVE_FLOOR = 0.5
TEMPLATE_SYNTAX = "{% for m in messages %}{{ m['content'] }{% endfor %}"
PLACEHOLDER_RECIPE = (
    "quant_stage:\n  quant_modifiers:\n    GPTQModifier: "
    "{targets: Linear, scheme: W4A16, dampening_frac: $damp}\n"
)


def build_model(folder: Path) -> Path:
    """The tiny Llama, built in a process of its own (torch stays out of this one)."""
    code = "import sys; from compressflow.demo.assets import build_tiny_llama as b; b(sys.argv[1])"
    subprocess.run([sys.executable, "-c", code, str(folder)], check=True)
    return folder


def variant(base: Path, root: Path, name: str, change) -> Path:
    folder = root / name
    if not folder.exists():
        shutil.copytree(base, folder)
        change(folder)
    return folder


def edit_json(file: Path, **changes) -> None:
    data = json.loads(file.read_text())
    data.update(changes)
    file.write_text(json.dumps(data, indent=2))


def to_pickle(folder: Path) -> None:
    code = (
        "import sys, torch; from safetensors.torch import load_file; "
        "torch.save(load_file(sys.argv[1] + '/model.safetensors'), "
        "sys.argv[1] + '/pytorch_model.bin')"
    )
    subprocess.run([sys.executable, "-c", code, str(folder)], check=True)
    (folder / "model.safetensors").unlink()


def truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def cases(work: Path) -> dict[str, dict]:
    """Each case's parameters; the folders they name are made once under `work`."""
    base = build_model(work / "tiny-llama")
    models = work / "models"
    models.mkdir(exist_ok=True)

    def params(model: Path = base, **groups) -> dict:
        return {
            "model": {"model_id": str(model)},
            "dataset": {"dataset_name": "python_docs", "text_samples": 8, "max_seq_len": 64},
            "recipe": {"preset": "W4A16"},
            "output": {"save_directory": str(work / "out")},
            **groups,
        }

    binary = work / "binary.txt"
    binary.write_bytes(bytes(range(256)) * 64)
    return {
        "valid": params(),
        "config not JSON": params(
            variant(
                base,
                models,
                "config-not-json",
                lambda f: (f / "config.json").write_text((f / "config.json").read_text()[:80]),
            )
        ),
        "truncated shard": params(
            variant(base, models, "truncated", lambda f: truncate(f / "model.safetensors"))
        ),
        "template syntax": params(
            variant(
                base,
                models,
                "template",
                lambda f: edit_json(f / "tokenizer_config.json", chat_template=TEMPLATE_SYNTAX),
            )
        ),
        "auto_map": params(
            variant(
                base,
                models,
                "auto-map",
                lambda f: edit_json(
                    f / "config.json", auto_map={"AutoModelForCausalLM": "modeling.Custom"}
                ),
            )
        ),
        "pickle-only weights": params(variant(base, models, "pickle", to_pickle)),
        "unknown preset": params(recipe={"recipe": "W4A61"}),
        "missing placeholder": params(recipe={"recipe": PLACEHOLDER_RECIPE}),
        "output in source": params(output={"save_directory": str(base / "compressed")}),
        "binary dataset": params(dataset={"dataset_name": str(binary), "text_samples": 8}),
    }


def run_once(params_file: Path, env: dict[str, str]) -> tuple[float, int, str]:
    """(wall seconds, exit status, first line printed) of one `compressflow validate`.

    In a process group of its own, waited for (untimed) until its last process is gone: a
    forkserver outlives the validate that started it by the seconds its interpreter takes to
    tear torch down, which the next case would otherwise pay.
    """
    started = time.perf_counter()
    process = subprocess.Popen(
        [sys.executable, "-m", "compressflow.flows.cli", "validate", str(params_file)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=params_file.parent,
        start_new_session=True,
    )
    stdout, stderr = process.communicate()
    seconds = time.perf_counter() - started
    for _ in range(600):  # at most a minute
        try:
            os.killpg(process.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    lines = (stderr if process.returncode else stdout).strip().splitlines()
    return seconds, process.returncode, lines[0] if lines else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "refusals")
    parser.add_argument("--pythonpath", default="", help="another checkout's code, for a baseline")
    parser.add_argument("--only", nargs="*", help="these cases (and the valid one)")
    options = parser.parse_args()

    work = options.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(work / "hf"),
        "CLEARML_OFFLINE_MODE": "1",
        "PREFECT_HOME": str(work / "prefect"),
        "COMPRESSFLOW_CACHE_DIR": str(work / "cache"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    if options.pythonpath:
        env["PYTHONPATH"] = options.pythonpath
    inputs = cases(work)
    if options.only:
        inputs = {k: v for k, v in inputs.items() if k == "valid" or k in options.only}
    files = {}
    for name, params in inputs.items():
        files[name] = work / "params" / (name.replace(" ", "-") + ".yaml")
        files[name].parent.mkdir(exist_ok=True)
        files[name].write_text(json.dumps(params, indent=2))

    # Interleaved: each round runs the floor and every case once, so they see the same load.
    times: dict[str, list[float]] = {name: [] for name in ["floor", *files]}
    results: dict[str, tuple[int, str]] = {}
    for _ in range(options.repeats):
        times["floor"].append(floor_seconds(env))
        for name, file in files.items():
            seconds, status, line = run_once(file, env)
            times[name].append(seconds)
            results[name] = (status, line)

    code = env.get("PYTHONPATH") or str(REPO)
    floor = statistics.median(times["floor"])
    print(f"compressflow validate, median of {options.repeats} fresh processes; code: {code}")
    print(f"load average after: {os.getloadavg()[0]:.2f} on {os.cpu_count()} CPUs")
    print(f"{'case':<22}{'seconds':>9}{'- floor':>9}  exit  first line")
    print(f"{'floor':<22}{floor:>9.2f}{'':>9}        start a process, import what validate does")
    missed = []
    for name in files:
        seconds = statistics.median(times[name])
        status, line = results[name]
        print(f"{name:<22}{seconds:>9.2f}{seconds - floor:>9.2f}  {status:>4}  {line[:150]}")
        if name != "valid" and (status != 2 or seconds - floor > TARGET_ABOVE_FLOOR):
            missed.append(name)
    if missed:
        print(
            f"missed (not refused, or over {TARGET_ABOVE_FLOOR} s above the floor): "
            f"{', '.join(missed)}"
        )
    return 1 if missed else 0


def floor_seconds(env: dict[str, str]) -> float:
    """The least a refusal can take: a process that starts and imports what validate imports
    (Prefect, pydantic, the flow's modules) and does nothing else."""
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", "import compressflow.flows.validate"], env=env, check=True
    )
    return time.perf_counter() - started


if __name__ == "__main__":
    sys.exit(main())
