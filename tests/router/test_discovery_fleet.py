"""DNS discovery against real gateways and real sim replicas on loopback addresses.

The whole of 127.0.0.0/8 is loopback on Linux, so sim replicas listen on 127.0.0.2, 127.0.0.3,
... at one shared port, as pods behind a headless Service do on their pod IPs.  The name
resolves either through the system resolver (`localhost`) or through a resolver function handed
to the gateway (the DNS answer is the one thing a test must choose), so the fleet gains and loses
real replicas that serve real requests.  Rounds are run by hand (`discover_all`) where the test
is about what one round does, and by the loop itself where it is about the loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import pytest
import zmq
import zmq.asyncio

from replicas.sim import SimReplica, SimSettings, start_replica
from router.app import DNS_DISCOVERY, KV_EVENTS, running_gateway
from router.app import Gateway as RunningGateway
from router.config import RouterConfig
from router.fleet.discovery import DnsDiscovery
from tests.router.conftest import FAST, fast_config, wait_until

NAME = "replicas.fleet.test"
MODEL = "sim-model"

StartSims = Callable[..., Awaitable[tuple[int, list[SimReplica]]]]
StartGateway = Callable[..., Awaitable[RunningGateway]]


class Answers:
    """The DNS answer a test wants: addresses, or an exception to raise (a failed lookup)."""

    def __init__(self, *addresses: str) -> None:
        self.value: Sequence[str] | BaseException = list(addresses)
        self.asked: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> Sequence[str]:
        self.asked.append((host, port))
        if isinstance(self.value, BaseException):
            raise self.value
        return list(self.value)


def _free_port(hosts: Sequence[str]) -> int:
    """A TCP port free on every one of `hosts` right now."""
    for _ in range(50):
        with socket.socket() as probe:
            probe.bind((hosts[0], 0))
            port = int(probe.getsockname()[1])
        try:
            for host in hosts[1:]:
                with socket.socket() as other:
                    other.bind((host, port))
        except OSError:
            continue
        return port
    raise AssertionError("no port free on all of " + ", ".join(hosts))


@pytest.fixture
async def start_sims() -> AsyncIterator[StartSims]:
    """`await start_sims(hosts, **settings)` → (port, sims): one sim replica per loopback
    address, all on the same port (a free one unless `port=` is given)."""
    async with contextlib.AsyncExitStack() as stack:

        async def start(hosts: Sequence[str], **settings: Any) -> tuple[int, list[SimReplica]]:
            port = settings.pop("port", None) or _free_port(hosts)
            sims = []
            for i, host in enumerate(hosts):
                base = SimSettings(host=host, port=port, model=MODEL, seed=i, time_scale=FAST)
                sim = await start_replica(base.replace(**settings))
                stack.push_async_callback(sim.stop)
                sims.append(sim)
            return port, sims

        yield start


@contextlib.asynccontextmanager
async def _kv_events_at(routes: dict[str, str]) -> AsyncIterator[None]:
    """Republish each source's KV-event messages, unchanged, at its destination.

    A sim replica binds its publisher only on a wildcard (`tcp://*:P`, vLLM's rule), and only one
    process can bind a wildcard port; pods each have their own IP.  So the sims publish on ipc://
    and this forwards each one to `tcp://<its loopback address>:P`, the endpoint the router must
    derive from the address DNS gave it."""
    ctx = zmq.asyncio.Context()

    async def forward(source: str, destination: str, ready: asyncio.Event) -> None:
        sub, pub = ctx.socket(zmq.SUB), ctx.socket(zmq.PUB)
        try:
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(source)
            pub.bind(destination)
            ready.set()
            while True:
                await pub.send_multipart(await sub.recv_multipart())
        finally:
            sub.close(linger=0)
            pub.close(linger=0)

    readies = [asyncio.Event() for _ in routes]
    tasks = [
        asyncio.create_task(forward(s, d, r))
        for (s, d), r in zip(routes.items(), readies, strict=True)
    ]
    try:
        await asyncio.wait_for(asyncio.gather(*(r.wait() for r in readies)), 5)
        yield
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        ctx.term()


@pytest.fixture
async def start_gateway() -> AsyncIterator[StartGateway]:
    async with contextlib.AsyncExitStack() as stack:

        async def start(config: RouterConfig, answers: Answers | None = None) -> RunningGateway:
            return await stack.enter_async_context(running_gateway(config, dns_resolver=answers))

        yield start


def _config(port: int, **overrides: Any) -> RouterConfig:
    # A long interval: the loop stays out of the way of tests that run rounds by hand.
    settings: dict[str, Any] = {
        "discover_dns": (f"{NAME}:{port}",),
        "discover_dns_interval_s": 60.0,
        "policy": "round_robin",
    }
    settings.update(overrides)
    return fast_config(settings.pop("replicas", ()), **settings)


async def _complete(http: aiohttp.ClientSession, gw: RunningGateway, **body: Any) -> str:
    """One completion through the gateway; the replica that served it."""
    payload = {"model": MODEL, "prompt": "hello", "max_tokens": 2, **body}
    async with http.post(gw.url + "/v1/completions", json=payload) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
        return resp.headers["x-fleet-replica"]


async def _metric(http: aiohttp.ClientSession, gw: RunningGateway, series: str) -> float | None:
    async with http.get(gw.url + "/metrics") as resp:
        for line in (await resp.text()).splitlines():
            if line.startswith(series + " "):
                return float(line.rsplit(" ", 1)[1])
    return None


def _discovery(gw: RunningGateway) -> DnsDiscovery:
    return gw.app[DNS_DISCOVERY]


async def test_localhost_is_discovered_through_the_system_resolver(
    start_sims: StartSims, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    port, _ = await start_sims(["127.0.0.1"])
    gw = await start_gateway(_config(port, discover_dns=(f"localhost:{port}",)))
    url = f"http://127.0.0.1:{port}"
    replica = gw.fleet.get(url)
    assert replica is not None and replica.source == "dns"
    assert replica.up  # probed before the gateway served: ready at once
    assert all(r.source == "dns" for r in gw.fleet)  # no embedded sims, nothing else
    async with http.get(gw.url + "/ready") as resp:
        assert resp.status == 200
    assert await _complete(http, gw) == url
    label = f'{{target="localhost:{port}"}}'
    assert await _metric(http, gw, "fleet_router_discovery_replicas" + label) == len(gw.fleet)
    assert await _metric(http, gw, "fleet_router_discovery_errors_total" + label) is None


async def test_the_fleet_gains_and_loses_real_replicas_with_the_dns_answer(
    start_sims: StartSims, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    # Slower sims (still 20x a GPU): the long stream below outlives two discovery rounds.
    port, sims = await start_sims(["127.0.0.2", "127.0.0.3", "127.0.0.4"], time_scale=0.05)
    r2, r3, r4 = (s.url for s in sims)
    answers = Answers("127.0.0.2")
    gw = await start_gateway(_config(port), answers)
    discovery = _discovery(gw)
    assert answers.asked[0] == (NAME, port)
    assert [r.replica_id for r in gw.fleet] == [r2]
    assert {await _complete(http, gw) for _ in range(4)} == {r2}

    # Two more pods become ready: both join, probed in the same round, and take traffic.
    answers.value = ["127.0.0.4", "127.0.0.3", "127.0.0.2"]
    await discovery.discover_all()
    assert {r.replica_id for r in gw.fleet} == {r2, r3, r4}
    assert all(r.up and r.source == "dns" for r in gw.fleet)
    assert {await _complete(http, gw) for _ in range(9)} == {r2, r3, r4}

    # The replica serving a long stream leaves the answer: it stays for one round (grace 2),
    # then goes, while the stream already sent to it finishes normally.
    stream = await http.post(
        gw.url + "/v1/completions",
        json={
            "model": MODEL,
            "prompt": "long",
            "stream": True,
            "max_tokens": 1000,
            "ignore_eos": True,
        },
    )
    gone = stream.headers["x-fleet-replica"]
    first = await stream.content.readany()
    assert first.startswith(b"data: ")
    gone_sim = next(s for s in sims if s.url == gone)
    assert gone_sim.engine.stats().num_running == 1  # still generating
    answers.value = [s.settings.host for s in sims if s is not gone_sim]
    await discovery.discover_all()
    assert gw.fleet.get(gone) is not None
    await discovery.discover_all()
    assert gw.fleet.get(gone) is None
    assert {r.replica_id for r in gw.fleet} == {r2, r3, r4} - {gone}
    rest = await stream.read()
    stream.release()
    assert (first + rest).endswith(b"data: [DONE]\n\n")
    assert (first + rest).count(b"data: ") >= 1001
    # The removed replica gets nothing more; the others share the traffic.
    prompts_before = gone_sim.engine.stats().prompt_tokens
    assert {await _complete(http, gw) for _ in range(8)} == {r2, r3, r4} - {gone}
    assert gone_sim.engine.stats().prompt_tokens == prompts_before
    label = f'{{target="{NAME}:{port}"}}'
    assert await _metric(http, gw, "fleet_router_discovery_replicas" + label) == 2


async def test_a_failed_resolution_removes_nothing(
    start_sims: StartSims, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    port, sims = await start_sims(["127.0.0.2", "127.0.0.3"])
    answers = Answers("127.0.0.2", "127.0.0.3")
    gw = await start_gateway(_config(port, discover_dns_grace_rounds=1), answers)
    discovery = _discovery(gw)
    before = {r.replica_id for r in gw.fleet}
    assert before == {s.url for s in sims}
    answers.value = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    for _ in range(3):
        await discovery.discover_all()
    answers.value = ["127.0.0.2", "not-an-address"]  # a garbled answer is a failure too
    await discovery.discover_all()
    assert {r.replica_id for r in gw.fleet} == before
    assert {await _complete(http, gw) for _ in range(6)} == before
    label = f'{{target="{NAME}:{port}"}}'
    assert await _metric(http, gw, "fleet_router_discovery_errors_total" + label) == 4
    assert await _metric(http, gw, "fleet_router_discovery_replicas" + label) == 2
    # With grace 1 the first real answer without a replica removes it.
    answers.value = ["127.0.0.3"]
    await discovery.discover_all()
    assert {r.replica_id for r in gw.fleet} == {sims[1].url}


async def test_a_resolver_slower_than_the_interval_is_a_failed_round(
    start_sims: StartSims, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    port, (sim,) = await start_sims(["127.0.0.2"])
    answers = Answers("127.0.0.2")
    gw = await start_gateway(_config(port, discover_dns_interval_s=0.2), answers)
    await wait_until(lambda: _discovery(gw).rounds >= 2)  # the loop runs by itself

    async def stalled(host: str, port: int) -> list[str]:
        await asyncio.sleep(30)
        return []

    slow = DnsDiscovery(gw.fleet, _discovery(gw).targets, metrics=gw.state.metrics,
                        interval_s=0.05, grace_rounds=1, resolver=stalled)  # fmt: skip
    await slow.discover_all()  # returns after the interval, not after 30 s
    assert gw.fleet.get(sim.url) is not None
    label = f'{{target="{NAME}:{port}"}}'
    assert await _metric(http, gw, "fleet_router_discovery_errors_total" + label) == 1


async def test_the_loop_follows_dns_by_itself(
    start_sims: StartSims, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    port, sims = await start_sims(["127.0.0.2", "127.0.0.3"])
    answers = Answers("127.0.0.2")
    gw = await start_gateway(_config(port, discover_dns_interval_s=0.05), answers)
    answers.value = ["127.0.0.2", "127.0.0.3"]
    await wait_until(lambda: (r := gw.fleet.get(sims[1].url)) is not None and r.up)
    assert await _complete(http, gw, prompt="x") in {s.url for s in sims}
    answers.value = ["127.0.0.3"]
    await wait_until(lambda: gw.fleet.get(sims[0].url) is None)
    assert {await _complete(http, gw) for _ in range(4)} == {sims[1].url}


async def test_dns_is_the_source_of_truth_next_to_static_and_admin_replicas(
    start_sims: StartSims, start_gateway: StartGateway, http: aiohttp.ClientSession
) -> None:
    port, sims = await start_sims(["127.0.0.2", "127.0.0.3"])
    static = sims[0].url
    answers = Answers("127.0.0.2", "127.0.0.3")
    config = _config(port, replicas=(f"static={static}",), admin_token="t")
    gw = await start_gateway(config, answers)
    discovery = _discovery(gw)
    # The static replica's URL resolves too: it is not registered twice.
    assert {(r.replica_id, r.source) for r in gw.fleet} == {
        ("static", "static"),
        (sims[1].url, "dns"),
    }
    assert discovery.replicas(discovery.targets[0]) == (sims[1].url,)
    # An admin removal of a discovered replica holds until the next round: DNS still names it.
    auth = {"Authorization": "Bearer t"}
    async with http.delete(gw.url + "/admin/replicas", params={"id": sims[1].url},
                           headers=auth) as resp:  # fmt: skip
        assert resp.status == 200
    assert gw.fleet.get(sims[1].url) is None
    await discovery.discover_all()
    replica = gw.fleet.get(sims[1].url)
    assert replica is not None and replica.up and replica.source == "dns"
    # DNS never removes what it did not add.
    answers.value = []
    await discovery.discover_all()
    await discovery.discover_all()
    assert [r.replica_id for r in gw.fleet] == ["static"]


async def test_discovered_replicas_join_exact_mode_on_their_kv_events_port(
    start_sims: StartSims,
    start_gateway: StartGateway,
    http: aiohttp.ClientSession,
    tmp_path: Path,
) -> None:
    hosts = ["127.0.0.2", "127.0.0.3"]
    kv_port = _free_port(hosts)
    port, sims = await start_sims(hosts[:1], kv_events_endpoint=f"ipc://{tmp_path}/kv-0")
    _, more = await start_sims(hosts[1:], port=port, kv_events_endpoint=f"ipc://{tmp_path}/kv-1")
    sims += more
    routes = {f"ipc://{tmp_path}/kv-{i}": f"tcp://{h}:{kv_port}" for i, h in enumerate(hosts)}
    answers = Answers(*hosts)
    config = _config(port, policy="kv_aware", tokenizer="sim", block_units=16,
                     discover_dns_kv_events_port=kv_port)  # fmt: skip
    async with _kv_events_at(routes):
        gw = await start_gateway(config, answers)
        consumer = gw.app[KV_EVENTS]
        assert {(s.replica_id, s.endpoint, s.model) for s in consumer.sources} == {
            (sims[0].url, f"tcp://127.0.0.2:{kv_port}", MODEL),
            (sims[1].url, f"tcp://127.0.0.3:{kv_port}", MODEL),
        }
        await asyncio.sleep(0.3)  # ZMQ subscriptions join asynchronously: let them connect
        served = await _complete(http, gw, prompt="a shared system prompt " * 20, max_tokens=4)
        other = next(s.url for s in sims if s.url != served)
        await wait_until(lambda: consumer.stats[served].batches > 0)
        # The events came from the replica that served, through the address DNS gave for it.
        assert consumer.stats[other].batches == 0
        index = gw.state.core.prefix_index
        assert index is not None and index.holds(served) > 0 and index.holds(other) == 0
        # Gone from DNS → no longer consumed, and forgotten by the index.
        answers.value = [urlsplit(other).hostname or ""]
        await _discovery(gw).discover_all()
        await _discovery(gw).discover_all()
        assert [s.replica_id for s in consumer.sources] == [other]
        assert index.holds(served) == 0
