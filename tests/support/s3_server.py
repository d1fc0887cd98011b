"""A real S3 server for the tests: moto's server mode, a process on loopback, started as the
Prefect server is (tests/support/prefect_stack.py): a free port, wait until it answers, stop its
process group at the end.

It enforces credentials as S3 does: the server starts with `INITIAL_NO_AUTH_ACTION_COUNT=3`, and
those three calls make an IAM user allowed everything and its access key, which the session's
environment then holds (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_ENDPOINT_URL`); any
other key is refused with `InvalidAccessKeyId`. Tests that use it take the `s3_server` fixture
(import it from here) and make their own bucket.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

import pytest

from support.prefect_stack import free_port

REGION = "us-east-1"
# Variables that would point boto3 elsewhere than the test server, or at a user's own keys.
CLEARED = (
    "AWS_PROFILE",
    "AWS_SESSION_TOKEN",
    "AWS_ENDPOINT_URL_S3",
    "AWS_CONFIG_FILE",
    "AWS_SHARED_CREDENTIALS_FILE",
)
ADMIN_POLICY = (
    '{"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}'
)


@dataclass
class S3Server:
    endpoint: str
    key_id: str
    secret: str
    process: subprocess.Popen

    def client(self, key_id: str | None = None, secret: str | None = None):
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name=REGION,
            aws_access_key_id=key_id or self.key_id,
            aws_secret_access_key=secret or self.secret,
        )


def _wait_answering(endpoint: str, process: subprocess.Popen, log: Path, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, "moto_server exited:\n" + log.read_text()[-3000:]
        try:
            with urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=2):
                return
        except OSError:
            time.sleep(0.2)
    pytest.fail("moto_server did not answer:\n" + log.read_text()[-3000:])


def _stop(process: subprocess.Popen) -> None:
    with suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        with suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=5)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> Iterator[S3Server]:
    """moto's S3 server on loopback, with the session's environment pointed at it."""
    import boto3

    port, logs = free_port(), tmp_path_factory.mktemp("s3-server")
    log = logs / "moto.log"
    server = Path(sys.executable).with_name("moto_server")
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "3", "MOTO_PORT": str(port)}
    with log.open("w") as out:
        process = subprocess.Popen(
            [str(server), "-H", "127.0.0.1", "-p", str(port)],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: the teardown reaches it all
        )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        _wait_answering(endpoint, process, log)
        iam = boto3.client(
            "iam",
            endpoint_url=endpoint,
            region_name=REGION,
            aws_access_key_id="bootstrap",
            aws_secret_access_key="bootstrap",
        )
        iam.create_user(UserName="compressflow-tests")
        iam.put_user_policy(
            UserName="compressflow-tests", PolicyName="all", PolicyDocument=ADMIN_POLICY
        )
        key = iam.create_access_key(UserName="compressflow-tests")["AccessKey"]
        with pytest.MonkeyPatch.context() as patch:
            for name in CLEARED:
                patch.delenv(name, raising=False)
            patch.setenv("AWS_ENDPOINT_URL", endpoint)
            patch.setenv("AWS_ACCESS_KEY_ID", key["AccessKeyId"])
            patch.setenv("AWS_SECRET_ACCESS_KEY", key["SecretAccessKey"])
            patch.setenv("AWS_DEFAULT_REGION", REGION)
            yield S3Server(endpoint, key["AccessKeyId"], key["SecretAccessKey"], process)
    finally:
        _stop(process)
