"""The one job contract: parsing, both directions of the worker argv, and events."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reshard_svc.errors import UsageError
from reshard_svc.jobs.argv import from_argv, to_argv
from reshard_svc.jobs.events import EventReporter, latest_events, read_events
from reshard_svc.jobs.spec import (
    CHECKSUMS,
    FORMATS,
    STRATEGIES,
    ConvertSpec,
    parse_dtype,
    parse_size,
)

names = st.from_regex(r"[a-z_][a-z0-9_]{0,5}", fullmatch=True)
sizes = st.sampled_from(["1", "64KiB", "512MiB", "1GiB", "1Gi", "2.5GB", "1e9", "3T"])
specs = st.builds(
    ConvertSpec,
    source=st.from_regex(r"(s3://b/|/)[a-z0-9 ._-]{1,20}", fullmatch=True),
    target=st.from_regex(r"(s3://b/|/)[a-z0-9 ._-]{1,20}", fullmatch=True),
    mesh=st.none() | st.dictionaries(names, st.integers(1, 16), min_size=1, max_size=3),
    rules=st.none()
    | st.dictionaries(
        st.sampled_from(["*", "*.w*", "layers.*.x"]),
        st.sampled_from(["S(0)", "R", "S(1),R", "SS(0,2)"]),
        min_size=1,
    ),
    format=st.sampled_from(FORMATS),
    dtype=st.none() | st.sampled_from(["bf16", "fp16", "fp32", "fp64"]),
    strategy=st.sampled_from(STRATEGIES),
    checksum=st.sampled_from(CHECKSUMS),
    max_memory=st.none() | sizes,
    max_shard_size=st.none() | sizes,
    nodes=st.integers(1, 64),
    workers_per_node=st.integers(1, 8),
)


@settings(max_examples=200, deadline=None)
@given(specs)
def test_argv_and_json_round_trip(spec):
    spec = spec.checked()
    assert from_argv(to_argv(spec), spec.nodes, spec.workers_per_node) == spec
    assert ConvertSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"max_memory": "0"}, "max_memory"),
        ({"max_memory": "1 lots"}, "max_memory"),
        ({"max_memory": "-5GiB"}, "max_memory"),
        ({"dtype": "int8"}, "dtype"),
        ({"dtype": "float8_e4m3fn"}, "dtype"),
        ({"mesh": {"tp": 0}}, "mesh"),
        ({"mesh": "tp=2,tp=2"}, "mesh"),
        ({"mesh": "4"}, "name every dim"),
        ({"workers": True}, "workers"),
        ({"workers": 3, "nodes": 2}, "multiple"),
        ({"workers": 4, "nodes": 2, "workers_per_node": 1}, "workers=4"),
        ({"nodes": 0}, "nodes"),
        ({"rules": {"*": "Q(0)"}}, "rule"),
        ({"rules": ["S(0)"]}, "rules"),
        ({"strategy": "fast"}, "strategy"),
        ({"surprise": 1}, "surprise"),
        ({"source": ""}, "source"),
    ],
)
def test_bad_values_name_the_field(body, words):
    with pytest.raises(UsageError, match=words):
        ConvertSpec.from_json({"source": "/a", "target": "/b", **body})


def test_sizes_and_dtypes():
    assert parse_size("1Gi") == parse_size("1GiB") == 1 << 30
    assert parse_size("1e9") == 10**9 and parse_size(4096) == 4096
    assert parse_dtype("torch.bfloat16") == "bf16" and parse_dtype("half") == "fp16"
    spec = ConvertSpec.from_json({"source": "/a", "target": "/b", "workers": 8, "nodes": 2})
    assert (spec.nodes, spec.workers_per_node, spec.workers) == (2, 4, 8)


def test_reader_skips_a_half_written_last_line(tmp_path):
    path = tmp_path / "p.jsonl"
    good = {
        "event": "progress",
        "bytes_done": 5,
        "bytes_total": 9,
        "tensors_done": 1,
        "tensors_total": 2,
    }
    path.write_text(json.dumps(good) + "\n" + '{"event": "done", "strat')
    events = read_events(path)
    assert events == [good]
    assert latest_events(events) == (good, None)
    assert read_events(tmp_path / "missing") == []


class Flaky(BaseHTTPRequestHandler):
    """Answers 503 to the first two posts, then records events."""

    seen: list[dict] = []
    calls = 0

    def do_POST(self):  # noqa: N802
        type(self).calls += 1
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if type(self).calls <= 2:
            self.send_response(503)
        else:
            type(self).seen.append((self.headers["Authorization"], body))
            self.send_response(204)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_reporter_retries_then_delivers_in_order(tmp_path):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Flaky)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_port}/v1/jobs/j/events"
    rep = EventReporter(str(tmp_path / "p.jsonl"), url, "tok", final_timeout_s=20)
    for i in range(5):
        rep.send(
            {
                "event": "progress",
                "bytes_done": i,
                "bytes_total": 4,
                "tensors_done": 0,
                "tensors_total": 1,
            }
        )
    rep.send({"event": "error", "error": "boom"})
    rep.close()
    httpd.shutdown()
    kinds = [b["event"] for _, b in Flaky.seen]
    assert kinds[-1] == "error" and all(a == "Bearer tok" for a, _ in Flaky.seen)
    assert [b["bytes_done"] for _, b in Flaky.seen if b["event"] == "progress"][-1:] == [4]
    assert len(read_events(tmp_path / "p.jsonl")) == 6  # the file gets every event


def test_a_lost_server_never_blocks_the_worker_for_long():
    rep = EventReporter(None, "http://127.0.0.1:9/unreachable", "tok", final_timeout_s=1)
    started = time.monotonic()
    rep.send(
        {
            "event": "done",
            "strategy": "exchange",
            "seconds": 1.0,
            "bytes_read": 1,
            "bytes_written": 1,
            "bytes_exchanged": 0,
            "tensors": 1,
        }
    )
    rep.close()
    assert time.monotonic() - started < 15
    assert rep.posted == 0 and rep.dropped == 1


def test_close_bounds_a_final_event_that_was_already_retrying():
    """close() during a final event's back-off still gives up at its deadline (the retry
    loop had started before close and once knew no deadline: close returned after its
    join timed out, with the event neither posted nor counted)."""
    rep = EventReporter(None, "http://127.0.0.1:9/unreachable", "tok", final_timeout_s=0.5)
    rep.send({"event": "error", "error": "boom"})
    time.sleep(1.5)  # several refused tries and back-offs before close
    started = time.monotonic()
    rep.close()
    assert rep.posted == 0 and rep.dropped == 1
    assert rep._thread is not None and not rep._thread.is_alive()
    assert time.monotonic() - started < 5.5  # the join's own limit is 5.5 s


def test_the_library_imports_nothing_from_the_server_or_the_client():
    """The job contract lives in ``reshard_svc``; the server and clients depend on it, never
    the other way round (a worker image needs only the library)."""
    import ast
    from pathlib import Path

    import reshard_svc

    root = Path(reshard_svc.__file__).parent
    bad = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names = [node.module]
            bad += [
                f"{path.relative_to(root)}: {n}"
                for n in names
                if n.split(".")[0] in ("reshard_server", "reshard_client")
            ]
    assert not bad, bad
