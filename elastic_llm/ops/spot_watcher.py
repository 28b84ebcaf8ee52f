"""``elastic-llm spot-watcher``: drain this machine's Ray node when EC2 schedules a spot interruption.

Owns: polling the instance metadata service (IMDSv2) of this machine for a spot interruption
notice, and, on one, asking Ray once to drain this machine's Ray node for preemption with the
notice's deadline (:func:`elastic_llm.runtime.drains.request_drain`); then it exits 0, its work
done. Parsing a notice (:func:`parse_notice`) and picking the local node among the cluster's
(:func:`pick_node`) are pure; the HTTP client (:class:`MetadataClient`) and the loop
(:func:`watch`) do the I/O, with the drain call and the clock passed in.

Never moves stages, removes nodes, stops Ray or decides anything about the run: the elastic
controller sees the drain and moves the stages away, and the cloud takes the instance. Never
talks to any host but the metadata URL it was given (no proxies, no redirects) and the Ray
cluster's GCS. Never waits without a deadline: every metadata request has a timeout, and a drain
request that Ray does not answer in time is given up and asked again at the next poll.

Notices: ``GET {metadata_url}/latest/meta-data/spot/instance-action`` answers 404 until an
interruption is scheduled, then ``{"action": "terminate" | "stop" | "hibernate", "time":
"2026-11-23T08:22:00Z"}`` (UTC); every action gets the same drain. IMDSv2 asks for a session token
first (``PUT /latest/api/token``); the token is fetched again before its TTL runs out and after a 401.

Failures: a metadata service that cannot be reached at start (not on EC2), a Ray cluster that
cannot be reached, a node that has not registered with it within 30 s, or several nodes on this
machine exit with code 2 and a message saying what to pass. Later metadata errors, malformed
notices and refused drains are logged (one line on stderr, ``[spot-watcher]``) and retried at the
next poll.
"""

from __future__ import annotations

import argparse
import http.client
import json
import logging
import math
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime, timezone
from urllib.parse import urlsplit

EXIT_USAGE = 2
TOKEN_PATH = "/latest/api/token"
NOTICE_PATH = "/latest/meta-data/spot/instance-action"
TOKEN_TTL_S = 21600  # what the token is asked for (IMDSv2 allows 1 s to 6 h)
TOKEN_MARGIN_S = 60.0  # fetch a new token this long before the old one expires
REQUEST_S = 2.0  # timeout of each metadata request (IMDS answers locally, in milliseconds)
GCS_S = 10.0  # timeout of listing the cluster's nodes (connecting has Ray's own, ~30 s)
NODE_WAIT_S = 30.0  # at start, how long a node not (yet) registered with the GCS is waited for
DRAIN_S = 30.0  # longest wait for Ray to answer a drain request before asking again
MAX_BODY = 64 * 1024  # a notice is ~60 bytes

Drain = Callable[[str, float, str], None]  # (node_id, deadline_s, message); raises if refused


_log = logging.getLogger("elastic_llm.ops.spot_watcher")


def log(line: str) -> None:
    """One line of the watcher's log (a node's log is read while the watcher runs: the handler flushes each line)."""
    (_log.error if line.startswith("error: ") else _log.info)(line.removeprefix("error: "))


class NoticeError(ValueError):
    """The metadata service answered a notice this watcher cannot read; the message says why."""


class MetadataError(RuntimeError):
    """The metadata service could not be asked, or answered something unexpected."""


class NodeResolutionError(RuntimeError):
    """The Ray node to drain cannot be found; the message says what to pass."""


class NodeNotFound(NodeResolutionError):
    """No alive node is the one asked for (or on this machine); it may still be registering."""


@dataclass(frozen=True)
class SpotNotice:
    """A scheduled spot interruption: ``action`` (terminate, stop or hibernate) at ``deadline``,
    a ``time.time()`` instant."""

    action: str
    deadline: float

    def seconds_left(self, now: float) -> float:
        """Seconds from ``now`` to the deadline, 0 once it has passed."""
        return max(0.0, self.deadline - now)

    def describe(self) -> str:
        at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.deadline))
        return f"EC2 spot interruption: {self.action} at {at}"


def parse_notice(body: str | bytes) -> SpotNotice:
    """The notice in the body of a 200 answer of ``spot/instance-action``. Pure.
    Raises :class:`NoticeError` naming what is wrong. A time without a zone is read as UTC
    (EC2 writes UTC); the action is not checked against the known three, as any of them means
    the instance goes away."""
    text = body.decode("utf-8", "replace") if isinstance(body, bytes) else body
    shown = text if len(text) <= 200 else text[:200] + "..."
    try:
        doc = json.loads(text)
    except ValueError as e:
        raise NoticeError(f"spot notice is not JSON ({e}): {shown!r}") from None
    if not isinstance(doc, dict):
        raise NoticeError(f"spot notice is not a JSON object: {shown!r}")
    action, when = doc.get("action"), doc.get("time")
    if not isinstance(action, str) or not action:
        raise NoticeError(f"spot notice has no 'action' (terminate, stop or hibernate): {shown!r}")
    if not isinstance(when, str):
        raise NoticeError(f"spot notice has no 'time' (like 2026-11-23T08:22:00Z): {shown!r}")
    try:
        at = datetime.fromisoformat(when)
    except ValueError:
        raise NoticeError(f"spot notice 'time'={when!r} is not an ISO 8601 time like 2026-11-23T08:22:00Z") from None
    if at.tzinfo is None:
        at = at.replace(tzinfo=timezone.utc)
    return SpotNotice(action=action, deadline=at.timestamp())


def check_metadata_url(url: str) -> str:
    """``url`` without a trailing slash, or ValueError if it is not ``http(s)://host[:port]``."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path.strip("/") or parts.query:
        raise ValueError(f"--metadata-url={url!r} must be an http URL of the metadata service, like http://169.254.169.254")
    return url.rstrip("/")


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        return None  # the 3xx becomes an HTTPError: never follow the service elsewhere


class MetadataClient:
    """IMDSv2 client of one metadata service: the session token, and the spot notice.

    Talks only to ``url`` (environment proxies and redirects are ignored); every request times
    out after ``timeout_s``. ``clock`` (monotonic seconds) decides when the token is too old."""

    def __init__(self, url: str, timeout_s: float = REQUEST_S, token_ttl_s: int = TOKEN_TTL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.url = check_metadata_url(url)
        self.timeout_s = timeout_s
        self.token_ttl_s = token_ttl_s
        self.clock = clock
        self._token: str | None = None
        self._token_until = 0.0
        self._http = urllib.request.build_opener(urllib.request.ProxyHandler({}), _NoRedirects())

    def _send(self, req: urllib.request.Request) -> tuple[int, bytes]:
        """(status, body) of a 2xx answer; HTTPError for the others; MetadataError if unreachable."""
        try:
            with self._http.open(req, timeout=self.timeout_s) as resp:
                return resp.status, resp.read(MAX_BODY)
        except urllib.error.HTTPError:
            raise
        except (urllib.error.URLError, OSError, http.client.HTTPException) as e:  # refused, unreachable, timed out, garbled
            why = getattr(e, "reason", e)
            raise MetadataError(f"{req.get_method()} {req.full_url} failed: {why}") from None

    def token(self) -> str:
        """The session token, fetched again when none is held or it expires within a minute."""
        if self._token is not None and self.clock() < self._token_until:
            return self._token
        req = urllib.request.Request(self.url + TOKEN_PATH, data=b"", method="PUT", headers={"X-aws-ec2-metadata-token-ttl-seconds": str(self.token_ttl_s)})
        asked = self.clock()
        try:
            _, body = self._send(req)
        except urllib.error.HTTPError as e:
            raise MetadataError(f"PUT {req.full_url} answered {e.code} {e.reason}") from None
        token = body.decode("ascii", "replace").strip()
        if not token:
            raise MetadataError(f"PUT {req.full_url} answered an empty token")
        self._token, self._token_until = token, asked + max(0.0, self.token_ttl_s - TOKEN_MARGIN_S)
        return token

    def instance_action(self) -> SpotNotice | None:
        """The scheduled interruption, None while there is none (404). A 401 (the token expired
        or was revoked) fetches a new token and asks once more. Raises MetadataError or
        NoticeError."""
        for attempt in range(2):
            req = urllib.request.Request(self.url + NOTICE_PATH, headers={"X-aws-ec2-metadata-token": self.token()})
            try:
                _, body = self._send(req)
            except urllib.error.HTTPError as e:
                if e.code == 404:
                    return None
                if e.code == 401 and attempt == 0:
                    self._token = None
                    continue
                raise MetadataError(f"GET {req.full_url} answered {e.code} {e.reason}") from None
            return parse_notice(body)
        raise AssertionError("unreachable")  # pragma: no cover


def watch(client: MetadataClient, node_id: str, interval_s: float, drain: Drain, now: Callable[[], float] = time.time, sleep: Callable[[float], None] = time.sleep) -> int:
    """Poll every ``interval_s`` until a notice is seen and ``drain(node_id, deadline_s,
    message)`` returns (Ray accepted the drain); returns 0. Metadata errors, malformed notices
    and refused drains are logged and tried again at the next poll."""
    while True:
        try:
            notice = client.instance_action()
        except (MetadataError, NoticeError) as e:
            log(f"{e}; polling again in {interval_s:g} s")
            notice = None
        if notice is not None:
            deadline_s = notice.seconds_left(now())
            message = notice.describe()
            log(f"{message}: asking Ray to drain node {node_id} for preemption, {deadline_s:.0f} s before the deadline")
            try:
                drain(node_id, deadline_s, message)
            except Exception as e:  # refused, GCS unreachable, no answer in time: ask again
                log(f"the drain of node {node_id} was not accepted ({e}); asking again in {interval_s:g} s")
            else:
                log(f"Ray accepted the drain of node {node_id}: the controller moves its stages away; exiting")
                return 0
        sleep(interval_s)


def pick_node(alive: Mapping[str, str], node_id: str | None, ip: str) -> str:
    """``node_id`` if it is in ``alive`` ({node id: its NodeManagerAddress}), else (no
    ``node_id``) the one node of ``alive`` on ``ip``. Pure. Raises :class:`NodeNotFound` when there
    is none (yet), NodeResolutionError when several are on ``ip``: then only --node-id can say which."""
    if node_id is not None:
        if node_id not in alive:
            raise NodeNotFound(f"--node-id={node_id} is not an alive node of the Ray cluster ({len(alive)} alive): give a hex id `ray list nodes` shows")
        return node_id
    here = sorted(node for node, address in alive.items() if address == ip)
    if len(here) == 1:
        return here[0]
    if not here:
        where = ", ".join(sorted(set(alive.values()))) or "none"
        raise NodeNotFound(
            f"no alive Ray node of the cluster runs on this machine's IP {ip} (nodes are on: {where}): "
            "start the watcher after `ray start` on this machine, or pass --node-id"
        )
    raise NodeResolutionError(f"{len(here)} alive Ray nodes run on this machine's IP {ip} ({', '.join(here)}): pass --node-id to say which one to drain")


def resolve_node(
    node_id: str | None,
    list_alive: Callable[[], Mapping[str, str]],
    local_ip: Callable[[], str],
    wait_s: float = NODE_WAIT_S,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
) -> str:
    """:func:`pick_node` over the cluster's alive nodes, listed again every second for up to
    ``wait_s`` while the node is not there: a watcher started right after ``ray start`` may ask
    before the node has registered."""
    give_up = clock() + wait_s
    ip = local_ip() if node_id is None else ""
    while True:
        try:
            return pick_node(list_alive(), node_id, ip)
        except NodeNotFound as e:
            if clock() >= give_up:
                raise NodeNotFound(f"{e} (waited {wait_s:g} s)") from None
            sleep(1.0)


def gcs_address(address: str) -> str:
    """``host:port`` of the cluster's GCS, ``auto`` resolved as ``ray drain-node`` does
    (RAY_ADDRESS, then the cluster ``ray start`` recorded on this machine)."""
    from ray._private import services

    try:
        return services.canonicalize_bootstrap_address_or_die(address)
    except (ConnectionError, ValueError) as e:
        raise NodeResolutionError(f"cannot find the Ray cluster for --address={address} ({e}): pass --address HOST:PORT of its GCS") from None


def alive_nodes(gcs: str) -> dict[str, str]:
    """{node id hex: NodeManagerAddress} of the alive nodes, from the GCS (no Ray driver)."""
    import ray
    from ray.core.generated import gcs_pb2

    try:
        client = ray._raylet.GcsClient(address=gcs)
        infos = client.get_all_node_info(timeout=GCS_S)
    except Exception as e:  # RpcError and friends: Ray's exception types move between versions
        raise NodeResolutionError(f"cannot reach the Ray cluster's GCS at {gcs} ({e}): pass --address HOST:PORT of the cluster") from None
    return {nid.hex(): info.node_manager_address for nid, info in infos.items() if info.state == gcs_pb2.GcsNodeInfo.ALIVE}


def bounded(drain: Drain, timeout_s: float) -> Drain:
    """``drain`` that raises TimeoutError when it has not returned after ``timeout_s`` (Ray's
    drain call has no timeout of its own; the stuck call is left to its daemon thread)."""

    def call(node_id: str, deadline_s: float, message: str) -> None:
        done: dict[str, BaseException | None] = {}

        def run() -> None:
            try:
                drain(node_id, deadline_s, message)
                done["error"] = None
            except BaseException as e:  # handed to the caller
                done["error"] = e

        worker = threading.Thread(target=run, name="spot-watcher-drain", daemon=True)
        worker.start()
        worker.join(timeout_s)
        if "error" not in done:
            raise TimeoutError(f"Ray did not answer within {timeout_s:g} s")
        if done["error"] is not None:
            raise done["error"]

    return call


def main(args: argparse.Namespace) -> int:
    """``elastic-llm spot-watcher``: check the flags, the metadata service and the node, then
    :func:`watch`. Returns 0 once Ray accepted the drain, 2 on a startup error."""
    interval_s = args.interval_s
    if not (math.isfinite(interval_s) and interval_s > 0):
        log(f"error: --interval-s={interval_s:g} must be > 0: the seconds between polls, e.g. 5 (EC2 gives 2 minutes' notice)")
        return EXIT_USAGE
    try:
        client = MetadataClient(args.metadata_url)
    except ValueError as e:
        log(f"error: {e}")
        return EXIT_USAGE
    try:
        client.token()
    except MetadataError as e:
        log(
            f"error: cannot reach the instance metadata service at {client.url} ({e}): "
            "run on an EC2 instance or pass --metadata-url (in a container on EC2, set the instance's metadata hop limit to 2)"
        )
        return EXIT_USAGE
    from elastic_llm.runtime.session import local_ip

    try:
        gcs = gcs_address(args.address)
        node_id = resolve_node(args.node_id, lambda: alive_nodes(gcs), lambda: local_ip(gcs))
    except NodeResolutionError as e:
        log(f"error: {e}")
        return EXIT_USAGE

    from elastic_llm.runtime.drains import request_drain

    def drain(node: str, deadline_s: float, message: str) -> None:
        request_drain(node, deadline_s, message, address=gcs)

    log(f"watching node {node_id} of the Ray cluster at {gcs}: polling {client.url}{NOTICE_PATH} every {interval_s:g} s")
    return watch(client, node_id, interval_s, bounded(drain, DRAIN_S))
