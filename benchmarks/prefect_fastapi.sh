#!/usr/bin/env bash
# Which fastapi releases the pinned Prefect's server works with: for each version given, a scratch
# venv holds Prefect (pyproject.toml's pin) with that fastapi forced in, a `prefect server` starts on
# loopback, and the calls that broke before run against it (health, work-pool create,
# `deployment ls`, an artifact written and read back). Prints one block per version.
#   bash benchmarks/prefect_fastapi.sh 0.150.0 0.151.0 0.165.0
set -u
cd "$(dirname "$0")/.."
prefect=$(grep -o '"prefect==[^"]*"' pyproject.toml | tr -d '"')
venv=$(mktemp -d)/venv port=4299
.venv/bin/python -m uv venv -q "$venv" --python .venv/bin/python
.venv/bin/python -m uv pip install -q --python "$venv/bin/python" "$prefect"
for version in "$@"; do
  .venv/bin/python -m uv pip install -q --python "$venv/bin/python" "fastapi==$version"
  home=$(mktemp -d)
  export PREFECT_HOME=$home PREFECT_API_URL=http://127.0.0.1:$port/api PREFECT_SERVER_ANALYTICS_ENABLED=false
  "$venv/bin/prefect" server start --host 127.0.0.1 --port $port > "$home/server.log" 2>&1 &
  server=$!
  for _ in $(seq 1 90); do curl -sf "$PREFECT_API_URL/health" > /dev/null && break; sleep 1; done
  echo "$prefect, fastapi $version: health $(curl -s "$PREFECT_API_URL/health" || echo none)"
  "$venv/bin/prefect" work-pool create probe --type process > /dev/null 2>&1 && echo "  work-pool create: ok" || echo "  work-pool create: FAILED"
  "$venv/bin/prefect" deployment ls > /dev/null 2>&1 && echo "  deployment ls: ok" || echo "  deployment ls: FAILED (422)"
  "$venv/bin/python" - 2>/dev/null <<'PY' || echo "  artifact read back: FAILED (422)"
from prefect import flow
from prefect.artifacts import Artifact, create_markdown_artifact

@flow
def probe():
    create_markdown_artifact("x", key="probe")

probe()
assert Artifact.get("probe") is not None
print("  artifact read back: ok")
PY
  kill -INT $server; sleep 3; kill -9 $server 2> /dev/null
done
