"""One writer per upload prefix: a lease object, taken with a conditional write before the first
byte, renewed while the upload runs and deleted after the manifest.

`<prefix>/.compressflow-lease.json` holds the run key, host, pid, when it was taken, how long it
lasts unrenewed (`ttl_seconds`) and `owned`: every object name the holder may leave in the prefix
(the files it uploads, and those of the output it replaces). It is created with `If-None-Match:
*`, so of two runs exactly one gets it; the other waits (see `compressflow.store.objects`).

Unlike the local output lock (`flock`, which the kernel drops when its process dies), a lease in
a store outlives a killed holder; so a holder renews it every third of its ttl from a thread, and
a lease whose last write is older than its ttl, by the store's own clock, is stale: the next run
takes it over with `If-Match` on the stale lease's etag (one taker wins) and inherits its `owned`
names, which is how the objects a killed upload left are still known as compressflow's. A run
that fails marks its lease released (stale at once) rather than deleting it, for the same
reason; only a run that wrote its manifest deletes it. A holder whose renewal finds the lease
taken over (its process stalled past the ttl) stops before its next object and never writes the
manifest.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from datetime import datetime, timezone

from compressflow.errors import PublishError
from compressflow.limits import MAX_JSON_BYTES
from compressflow.logs import run_logger
from compressflow.store.object_clients import RESERVED, Conflict, ObjectStore

LEASE = RESERVED + "lease.json"
LEASE_SECONDS = 120.0


def describe(holder: dict) -> str:
    """Who holds a lease, for a log line or a refusal (no credentials are in a lease)."""
    return (
        f"pid {holder.get('pid', '?')} on {holder.get('host', '?')} (run key "
        f"{str(holder.get('run_key', '?'))[:12]}, since {holder.get('taken_at', '?')})"
    )


def _parse(data: bytes) -> dict:
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return {}
    return body if isinstance(body, dict) else {}


class Lease:
    """A lease this run holds; `take` makes one."""

    def __init__(self, store: ObjectStore, etag: str, body: dict, previous: dict | None):
        self.store, self.etag, self.body = store, etag, body
        self.previous = previous  # the stale lease taken over, or None
        self.lost = False
        self._guard, self._stop = threading.Lock(), threading.Event()
        self._beat = threading.Thread(target=self._heartbeat, daemon=True, name="lease")
        self._beat.start()

    @classmethod
    def take(cls, store: ObjectStore, run_key: str, ttl: float = LEASE_SECONDS) -> Lease | dict:
        """The lease, or the body of the live lease another run holds."""
        body = {
            "run_key": run_key,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "taken_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "ttl_seconds": ttl,
            "owned": [],
        }
        data = json.dumps(body).encode()
        try:
            return cls(store, store.write(LEASE, data, if_absent=True), body, None)
        except Conflict:
            pass
        current = store.read(LEASE, MAX_JSON_BYTES)
        if current is None:  # released meanwhile: the caller tries again
            return {"host": "?", "pid": "?", "run_key": "(just released)"}
        held = _parse(current.data)
        ttl_held = held.get("ttl_seconds")
        ttl_held = ttl_held if isinstance(ttl_held, (int, float)) else LEASE_SECONDS
        if current.age_seconds <= ttl_held and held.get("released") is not True:
            return held
        try:
            etag = store.write(LEASE, data, if_match=current.etag)
        except Conflict:  # another run took it over first
            return held
        run_logger(__name__).info(
            "Took over the stale upload lease of %s (%.0f s old)",
            describe(held),
            current.age_seconds,
        )
        return cls(store, etag, body, held)

    def inherited(self) -> set[str]:
        """What the stale lease taken over said its holder might have left in the prefix."""
        owned = (self.previous or {}).get("owned")
        return (
            {name for name in owned if isinstance(name, str)} if isinstance(owned, list) else set()
        )

    def claim(self, owned: set[str]) -> None:
        """Record, before writing them, every name this run may leave in the prefix."""
        self.body["owned"] = sorted(owned)
        self.renew()

    def renew(self) -> None:
        """Write the lease again (if still ours); a PublishError once another run took it."""
        with self._guard:
            if not self.lost:
                try:
                    self.etag = self.store.write(
                        LEASE, json.dumps(self.body).encode(), if_match=self.etag
                    )
                except Conflict:
                    self.lost = True
        self.check()

    def check(self) -> None:
        if self.lost:
            raise PublishError(
                "output.upload_uri",
                f"{self.store.location.uri}: this run's upload lease was taken over by another "
                f"run: this process went {self.body['ttl_seconds']:.0f} s without renewing it "
                "(stalled or suspended), so it stopped before publishing",
                "rerun: the files already uploaded and intact are not sent again",
            )

    def release(self, published: bool) -> None:
        """Delete the lease once the manifest says what the prefix holds; after a failure, mark
        it released instead, so the next run takes it over at once and inherits `owned`."""
        self._stop.set()
        self._beat.join()
        with self._guard:
            if self.lost:
                return
            try:
                if published:
                    self.store.delete(LEASE, if_match=self.etag)
                else:
                    data = json.dumps({**self.body, "released": True}).encode()
                    self.store.write(LEASE, data, if_match=self.etag)
            except Conflict:
                run_logger(__name__).warning(
                    "The upload lease of %s was no longer this run's", self.store.location.uri
                )

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.body["ttl_seconds"] / 3):
            try:
                self.renew()
            except PublishError:
                return
            except Exception as exc:  # a transient store error: the next beat tries again
                run_logger(__name__).warning("Could not renew the upload lease: %s", exc)


def leased(store: ObjectStore) -> set[str]:
    """Every name the lease in the prefix (live, released or stale) says its run may leave
    there: a cut upload's objects are compressflow's, not foreign."""
    current = store.read(LEASE, MAX_JSON_BYTES)
    owned = _parse(current.data).get("owned") if current else None
    return {name for name in owned if isinstance(name, str)} if isinstance(owned, list) else set()
