"""A locustfile for locust users: the load tester's workloads as streamed OpenAI requests.

    locust -f loadtest/locustfile.py --headless -u 8 -r 8 -t 60s --host http://127.0.0.1:8080

Besides locust's own entry per request (time to the response headers), each streamed request
fires custom events, so locust's statistics show (``Type`` / ``Name``):

* ``TTFT`` / endpoint — send → first content chunk (ms), response length = output tokens;
* ``TPOT`` / endpoint — (E2E - TTFT) / (output tokens - 1) (ms), when more than one token;
* ``E2E``  / endpoint — send → end of the stream (ms), response length = output tokens;
* ``STREAM`` / cause — failures inside a 200 stream (error event, no ``[DONE]``).

Configuration through the environment: ``FLEET_LOADTEST_WORKLOAD`` (default ``shared-prefix``),
``FLEET_LOADTEST_PARAMS`` (``key=value,key=value`` workload parameters),
``FLEET_LOADTEST_SEED`` (0) and ``FLEET_LOADTEST_MODEL`` (default: the first of ``/v1/models``).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
from locust import HttpUser, events, task

try:
    from loadtest.workloads import RequestSpec, Session, make_workload
except ImportError:  # `locust -f loadtest/locustfile.py` puts only loadtest/ on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from loadtest.workloads import RequestSpec, Session, make_workload

from loadtest.client import RequestRecord, StreamAccumulator, build_payload

__all__ = ["StreamingUser"]


def _params(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"FLEET_LOADTEST_PARAMS: expected key=value, got {item!r}")
        out[key.strip()] = value.strip()
    return out


_WORKLOAD = make_workload(
    os.environ.get("FLEET_LOADTEST_WORKLOAD", "shared-prefix"),
    _params(os.environ.get("FLEET_LOADTEST_PARAMS", "")),
    seed=int(os.environ.get("FLEET_LOADTEST_SEED", "0")),
)
# One seeded session stream shared by all users (gevent: one thread, no lock needed).
_SESSIONS: Iterator[Session] = _WORKLOAD.sessions()


class StreamingUser(HttpUser):
    """Takes the next session of the workload and sends its turns, streamed, one by one."""

    model: str = os.environ.get("FLEET_LOADTEST_MODEL", "")

    def on_start(self) -> None:
        if not type(self).model:
            with self.client.get("/v1/models", name="/v1/models", catch_response=True) as resp:
                data = resp.json().get("data") if resp.status_code == 200 else None
                if not data:
                    resp.failure("no model listed; set FLEET_LOADTEST_MODEL")
                    return
                type(self).model = str(data[0]["id"])
                resp.success()

    @task
    def session(self) -> None:
        session = next(_SESSIONS, None)
        if session is None or not type(self).model:
            time.sleep(0.1)
            return
        answers: list[str] = []
        for index, turn in enumerate(session.turns):
            if index and turn.think_time_s:
                time.sleep(turn.think_time_s)  # gevent-patched: yields to other users
            record = self._send(session.request(index, answers))
            if record is None or not record.ok:
                return
            answers.append(record.text)

    def _send(self, spec: RequestSpec) -> RequestRecord | None:
        path = "/v1/chat/completions" if spec.messages is not None else "/v1/completions"
        body = orjson.dumps(build_payload(spec, type(self).model))
        record = RequestRecord(spec=spec, send_s=time.perf_counter())
        stream = StreamAccumulator(record)
        with self.client.post(
            path,
            data=body,
            headers={"Content-Type": "application/json"},
            stream=True,
            catch_response=True,
            name=path,
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}")
                return None
            for line in resp.iter_lines():
                if not stream.feed(line, time.perf_counter()):
                    break
            stream.finish(time.perf_counter())
            if record.error is not None:
                resp.failure(record.error)
                self._fire("STREAM", record.error, 0.0, 0, RuntimeError(record.error_detail))
                return record
            resp.success()
        self._report(path, record)
        return record

    def _report(self, name: str, record: RequestRecord) -> None:
        tokens = record.output_tokens
        if (ttft := record.ttft_s) is not None:
            self._fire("TTFT", name, ttft * 1000, tokens)
        if (tpot := record.tpot_s) is not None:
            self._fire("TPOT", name, tpot * 1000, tokens)
        if (e2e := record.e2e_s) is not None:
            self._fire("E2E", name, e2e * 1000, tokens)

    def _fire(
        self,
        kind: str,
        name: str,
        ms: float,
        length: int,
        exception: BaseException | None = None,
    ) -> None:
        context: dict[str, Any] = {}
        events.request.fire(  # type: ignore[no-untyped-call]
            request_type=kind,
            name=name,
            response_time=ms,
            response_length=length,
            exception=exception,
            context=context,
        )
