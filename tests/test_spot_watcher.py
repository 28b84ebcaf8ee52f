"""The spot watcher without Ray: the notice parser, the IMDSv2 client and the poll loop against a
real HTTP server on 127.0.0.1 that plays EC2's metadata service (:class:`FakeIMDS`, also used by
the end-to-end drain test in ``test_elastic_cluster.py``), and the CLI's startup errors."""

import json
import socket
import threading
import time
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from elastic_llm import cli
from .conftest import wait_until
from elastic_llm.ops.spot_watcher import (
    NOTICE_PATH,
    TOKEN_PATH,
    MetadataClient,
    MetadataError,
    NodeNotFound,
    NodeResolutionError,
    NoticeError,
    bounded,
    parse_notice,
    pick_node,
    resolve_node,
    watch,
)

pytestmark = pytest.mark.timeout(30)


class FakeIMDS:
    """EC2's instance metadata service (IMDSv2) on 127.0.0.1, in a thread: ``PUT /latest/api/token``
    hands out the current token; ``GET .../spot/instance-action`` wants it (401 otherwise) and
    answers 404 until :meth:`interrupt`. ``requests`` lists (method, path, status) answered."""

    def __init__(self) -> None:
        self.token = "token-0"
        self.body: str | None = None  # the notice, once interrupted
        self.fail_next = 0  # answer this many of the next notice requests with 500
        self.requests: list[tuple[str, str, int]] = []
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def _handler(self) -> type:
        imds = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _answer(self, status: int, body: str = "") -> None:
                with imds.lock:
                    imds.requests.append((self.command, self.path, status))
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", "text/plain")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PUT(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path != TOKEN_PATH:
                    return self._answer(404)
                if not self.headers.get("X-aws-ec2-metadata-token-ttl-seconds", "").isdigit():
                    return self._answer(400, "missing or invalid X-aws-ec2-metadata-token-ttl-seconds")
                with imds.lock:
                    token = imds.token
                self._answer(200, token)

            def do_GET(self) -> None:
                with imds.lock:
                    token, body = imds.token, imds.body
                if self.headers.get("X-aws-ec2-metadata-token") != token:
                    return self._answer(401)
                if self.path != NOTICE_PATH or body is None:
                    return self._answer(404)
                with imds.lock:
                    failing = imds.fail_next > 0
                    imds.fail_next -= failing
                if failing:
                    return self._answer(500, "internal error")
                self._answer(200, body)

        return Handler

    def interrupt(self, seconds_ahead: float = 120.0, action: str = "terminate") -> float:
        """Schedule an interruption ``seconds_ahead`` from now (EC2 writes whole seconds, UTC);
        returns its deadline as a ``time.time()`` instant."""
        deadline = float(int(time.time() + seconds_ahead))
        at = datetime.fromtimestamp(deadline, timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
        self.serve(json.dumps({"action": action, "time": at}))
        return deadline

    def serve(self, body: str | None) -> None:
        """Answer the notice requests with ``body`` (None: 404 again)."""
        with self.lock:
            self.body = body

    def rotate_token(self) -> None:
        with self.lock:
            self.token = f"token-{int(self.token.split('-')[1]) + 1}"

    def count(self, method: str, status: int | None = None) -> int:
        with self.lock:
            return sum(1 for m, _, s in self.requests if m == method and status in (None, s))

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def __enter__(self) -> "FakeIMDS":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@pytest.fixture
def imds():
    with FakeIMDS() as server:
        yield server


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (connections are refused at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -- the notice, pure ------------------------------------------------------------------------------


def test_a_notice_is_read_with_its_deadline_as_a_time_time_instant():
    notice = parse_notice(b'{"action": "terminate", "time": "2026-11-23T08:22:00Z"}')
    deadline = datetime(2026, 11, 23, 8, 22, tzinfo=timezone.utc).timestamp()
    assert notice.action == "terminate" and notice.deadline == deadline
    assert notice.seconds_left(deadline - 90.5) == 90.5
    assert notice.seconds_left(deadline + 3) == 0.0  # too late: no negative deadline
    assert notice.describe() == "EC2 spot interruption: terminate at 2026-11-23T08:22:00Z"
    assert parse_notice('{"action": "hibernate", "time": "2026-11-23T08:22:00"}').deadline == deadline  # no zone: UTC


@pytest.mark.parametrize(
    "body, why",
    [
        ("<html>busy</html>", "spot notice is not JSON"),
        ('["terminate"]', "not a JSON object"),
        ('{"time": "2026-11-23T08:22:00Z"}', "no 'action'"),
        ('{"action": "stop"}', "no 'time'"),
        ('{"action": "stop", "time": 1700000000}', "no 'time'"),
        ('{"action": "stop", "time": "in two minutes"}', "'time'='in two minutes' is not an ISO 8601 time"),
    ],
)
def test_a_malformed_notice_is_refused_saying_what_is_wrong(body, why):
    with pytest.raises(NoticeError, match=why):
        parse_notice(body)


def test_the_node_is_the_one_asked_for_or_the_one_on_this_machines_ip():
    alive = {"aa": "10.0.0.1", "bb": "10.0.0.2", "cc": "10.0.0.2"}
    assert pick_node(alive, None, "10.0.0.1") == "aa"
    assert pick_node(alive, "bb", "10.0.0.1") == "bb"
    with pytest.raises(NodeNotFound, match=r"--node-id=dd is not an alive node of the Ray cluster \(3 alive\)"):
        pick_node(alive, "dd", "10.0.0.1")
    with pytest.raises(NodeNotFound, match=r"no alive Ray node .* IP 10.0.0.9 .*pass --node-id"):
        pick_node(alive, None, "10.0.0.9")
    with pytest.raises(NodeResolutionError, match=r"2 alive Ray nodes run on this machine's IP 10.0.0.2 \(bb, cc\): pass --node-id"):
        pick_node(alive, None, "10.0.0.2")


def test_a_node_still_registering_is_waited_for_then_given_up():
    now, listed = [0.0], []

    def later(alive):  # the node registers at the third listing
        listed.append(1)
        return alive if len(listed) >= 3 else {}

    def sleep(s):
        now[0] += s

    assert resolve_node(None, lambda: later({"aa": "10.0.0.1"}), lambda: "10.0.0.1", sleep=sleep, clock=lambda: now[0]) == "aa"
    assert len(listed) == 3 and now[0] == 2.0
    with pytest.raises(NodeNotFound, match=r"--node-id=bb is not an alive node .*\(waited 30 s\)"):
        resolve_node("bb", lambda: {"aa": "10.0.0.1"}, lambda: "unused", wait_s=30, sleep=sleep, clock=lambda: now[0])
    with pytest.raises(NodeResolutionError, match="2 alive Ray nodes"):  # several: no wait helps
        resolve_node(None, lambda: {"aa": "10.0.0.1", "bb": "10.0.0.1"}, lambda: "10.0.0.1", sleep=lambda s: pytest.fail("waited"))


# -- the IMDSv2 client against a real HTTP server ---------------------------------------------------


def test_the_client_sees_no_notice_while_404_then_the_notice(imds):
    client = MetadataClient(imds.url)
    assert client.instance_action() is None
    assert client.instance_action() is None
    deadline = imds.interrupt(120, action="stop")
    notice = client.instance_action()
    assert notice is not None and notice.action == "stop" and notice.deadline == deadline
    assert imds.count("PUT") == 1  # one token for all three polls
    assert imds.count("GET", 401) == 0


def test_a_401_fetches_a_new_token_and_asks_again(imds):
    client = MetadataClient(imds.url)
    assert client.instance_action() is None
    imds.rotate_token()  # the old token is refused from now on
    imds.interrupt(60)
    assert client.instance_action() is not None
    assert imds.count("PUT") == 2 and imds.count("GET", 401) == 1
    assert client.instance_action() is not None and imds.count("PUT") == 2  # the new token is kept


def test_the_token_is_fetched_again_a_minute_before_its_ttl_runs_out(imds):
    now = [1000.0]
    client = MetadataClient(imds.url, token_ttl_s=300, clock=lambda: now[0])
    client.instance_action()
    now[0] += 239  # still valid for 61 s
    client.instance_action()
    assert imds.count("PUT") == 1
    now[0] += 2  # 59 s left: too close
    client.instance_action()
    assert imds.count("PUT") == 2 and imds.count("GET", 401) == 0


def test_an_unexpected_answer_or_no_service_is_a_metadata_error(imds):
    imds.interrupt(60)
    imds.fail_next = 1
    with pytest.raises(MetadataError, match="answered 500"):
        MetadataClient(imds.url).instance_action()
    url = f"http://127.0.0.1:{closed_port()}"
    with pytest.raises(MetadataError, match=f"PUT {url}/latest/api/token failed"):
        MetadataClient(url).token()


# -- the loop, with the drain passed in ----------------------------------------------------------------


class Recorder:
    """A drain function that records its calls and refuses the first ``refusals`` of them."""

    def __init__(self, refusals: int = 0) -> None:
        self.calls: list[tuple[str, float, str, float]] = []
        self.refusals = refusals

    def __call__(self, node_id: str, deadline_s: float, message: str) -> None:
        self.calls.append((node_id, deadline_s, message, time.time()))
        if len(self.calls) <= self.refusals:
            raise RuntimeError("Ray refused to drain node: test")


def run_watch(client, drain, interval_s=0.05):
    result = {}
    thread = threading.Thread(target=lambda: result.update(rc=watch(client, "ab" * 28, interval_s, drain)), daemon=True)
    thread.start()
    return thread, result


def test_a_notice_drains_the_node_with_its_deadline_then_the_watcher_exits_0(imds, capsys):
    drain = Recorder()
    thread, result = run_watch(MetadataClient(imds.url), drain)
    wait_until(lambda: imds.count("GET", 404) >= 3, 10, "three polls")
    assert drain.calls == [] and imds.count("GET", 404) >= 3  # polling, nothing yet
    imds.fail_next = 1  # a transient error after the notice appears: logged, polled again
    deadline = imds.interrupt(90)
    thread.join(10)
    assert not thread.is_alive() and result["rc"] == 0
    [(node, deadline_s, message, at)] = drain.calls
    assert node == "ab" * 28
    assert abs(at + deadline_s - deadline) < 1.0
    assert message.startswith("EC2 spot interruption: terminate at ")
    err = capsys.readouterr().err
    assert "[spot-watcher]" in err and "answered 500" in err and "Ray accepted the drain" in err


def test_a_refused_drain_is_asked_again_at_the_next_poll(imds, capsys):
    drain = Recorder(refusals=1)
    imds.interrupt(90)
    thread, result = run_watch(MetadataClient(imds.url), drain)
    thread.join(10)
    assert not thread.is_alive() and result["rc"] == 0
    assert len(drain.calls) == 2
    assert "was not accepted (Ray refused to drain node: test)" in capsys.readouterr().err


def test_a_drain_ray_does_not_answer_is_given_up_in_time():
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="did not answer within 0.2 s"):
        bounded(lambda *a: time.sleep(60), 0.2)("n", 1.0, "m")  # the stuck call is left to its daemon thread
    assert time.monotonic() - started < 30  # given up, not waited for (60 s)
    with pytest.raises(RuntimeError, match="refused"):
        bounded(Recorder(refusals=1), 5)("n", 1.0, "m")


# -- the command line's startup checks ---------------------------------------------------------------------


def test_no_metadata_service_at_start_exits_2_naming_the_url_and_the_fix(capsys):
    url = f"http://127.0.0.1:{closed_port()}"
    assert cli.main(["spot-watcher", "--metadata-url", url, "--interval-s", "1"]) == 2
    err = capsys.readouterr().err
    assert f"cannot reach the instance metadata service at {url}" in err
    assert "run on an EC2 instance or pass --metadata-url" in err


@pytest.mark.parametrize("interval", ["0", "-1", "nan"])
def test_a_poll_interval_that_is_not_positive_is_refused(interval, capsys):
    assert cli.main(["spot-watcher", "--interval-s", interval]) == 2
    assert f"--interval-s={interval} must be > 0" in capsys.readouterr().err


def test_a_metadata_url_that_is_not_http_is_refused(capsys):
    assert cli.main(["spot-watcher", "--metadata-url", "169.254.169.254"]) == 2
    assert "--metadata-url='169.254.169.254' must be an http URL" in capsys.readouterr().err
