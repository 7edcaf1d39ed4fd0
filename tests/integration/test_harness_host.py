"""A node's harness host over real HTTP (`gyre.runtime.job.harness_host`, `gyre.runtime.controller.harness_hosts`;
docs/cluster.md,
"Harness hosts on every node").

A `HarnessHostThread` (its own loop and thread, as on a node's first rank) plays executions the controller's
`HarnessHosts` sends it, with real harness and evaluator processes (test_harness_episode's task and harness): a
finishing harness, one stalled past its harness budget (partial scoring) and a total failure leave the controller's
group exactly as the same episodes played beside it do (the execution's outcomes, the members, the rewards), the
harness's end reported once before the result; a cancel stops a running harness (CANCELLED); a spec the host cannot
play and a host stopped mid-execution are `HostLost`; the host takes the job's secret only.
"""

from __future__ import annotations

import asyncio
import socket
import time
from types import SimpleNamespace

import aiohttp
import pytest
from test_harness_episode import PROXY, ModeRunner, make_task, wait_for

from gyre.config import ExecutionLimits
from gyre.harness.episode import ProxyAccess, run_episode
from gyre.harness.sandbox import LocalSandbox
from gyre.runtime.controller.harness_hosts import HarnessHosts, HostLost, reachable
from gyre.runtime.job.harness_host import EXECUTIONS_PATH, HarnessHost, HarnessHostThread
from gyre.traj.outcomes import GroupOutcomes, Status
from gyre.traj.outcomes_state import group_outcomes_state

SECRET = "job-secret-for-the-test"
MODES = {"e-finish": "finish", "e-stall": "stall", "e-crash": "crash-evaluator", "e-slow": "slow"}


@pytest.fixture(scope="module")
def reachable_proxy():
    """A listening socket that stands for the proxy: the host checks it takes a connection (the harness here makes
    no model call)."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    yield ProxyAccess(anthropic_base_url=url, openai_base_url=url + "/v1", model="gyre")
    server.close()


@pytest.fixture
def host(tmp_path, reachable_proxy):
    from test_harness_episode import HARNESS

    script = tmp_path / "harness.py"
    script.write_text(HARNESS)
    task = make_task(tmp_path, harness_s=2.0, overall_s=6.0)
    limits = ExecutionLimits(harness_timeout_s=60, overall_timeout_s=120, grace_period_s=1.0)
    runner = ModeRunner(script, MODES)
    sandboxes = {side: LocalSandbox(root=tmp_path / side, isolate_user=False) for side in ("host", "here")}

    def factory():
        return HarnessHost(
            tasks=[task],
            make_runner=lambda task: runner,
            sandbox=sandboxes["host"],
            limits_of=lambda task: limits,
            secret=SECRET,
        )

    thread = HarnessHostThread(factory)
    url = thread.start()
    try:
        here, proxy = sandboxes["here"], reachable_proxy
        yield SimpleNamespace(url=url, thread=thread, task=task, limits=limits, runner=runner, here=here, proxy=proxy)
    finally:
        thread.stop()


def play(hosts, host, execution, *, task=None, access=None, group=None, cancel=None):
    """`hosts.play` on node 1 with the fixture's task and proxy, a group of its own and a fresh cancel event unless
    given; the harness's end ignored."""
    return hosts.play(
        1,
        task or host.task,
        execution=execution,
        key="k",
        access=access or host.proxy,
        group=group or GroupOutcomes(1, [execution]),
        cancel_event=cancel or asyncio.Event(),
        on_harness_end=lambda run: None,
    )


@pytest.mark.slow  # real harness and evaluator processes, a 6 s overall budget for the excluded one: ~10 s
def test_executions_played_on_a_host_leave_the_group_as_played_beside_it(host):
    names = ["e-finish", "e-stall", "e-crash"]
    remote, local = GroupOutcomes(3, names), GroupOutcomes(3, names)
    ends: list[str] = []

    async def main():
        hosts = HarnessHosts({1: host.url}, secret=SECRET)
        try:
            played = [
                hosts.play(
                    1,
                    host.task,
                    execution=name,
                    key=f"k-{name}",
                    access=host.proxy,
                    group=remote,
                    cancel_event=asyncio.Event(),
                    on_harness_end=lambda run, n=name: ends.append(n),
                )
                for name in names
            ]
            beside = [
                run_episode(
                    host.task,
                    execution_id=name,
                    api_key="k",
                    runner=host.runner,
                    sandbox=host.here,
                    proxy=PROXY,
                    limits=host.limits,
                    group=local,
                )
                for name in names
            ]
            return await asyncio.gather(*played, *beside)
        finally:
            await hosts.close()

    results = asyncio.run(asyncio.wait_for(main(), 120))
    remote_results, local_results = results[:3], results[3:]
    assert [r.status for r in remote_results] == [r.status for r in local_results]
    assert [r.reward for r in remote_results] == [1.0, 0.5, None] == [r.reward for r in local_results]
    assert remote_results[2].status is Status.EXCLUDED
    assert sorted(ends) == sorted(names)  # each harness's end, once
    assert remote.ready and remote.rewards() == local.rewards() and remote.members == local.members
    timed = ("deadline", "closed_at", "log")
    mine, theirs = (group_outcomes_state(g)["executions"] for g in (remote, local))
    for a, b in zip(mine, theirs, strict=True):
        assert {k: v for k, v in a.items() if k not in timed} == {k: v for k, v in b.items() if k not in timed}
        last = [[(e["score"], e["validity"]) for e in side["log"]][-1:] for side in (a, b)]
        assert last[0] == last[1]  # the same designated evaluation (a retry's timing may differ)
        assert abs(a["deadline"] - b["deadline"]) < 5.0  # the same budget on the controller's clock


def test_a_cancel_stops_the_harness_on_the_host_and_refusals_are_host_lost(host, tmp_path):
    group = GroupOutcomes(1, ["e-slow"])

    async def main():
        hosts = HarnessHosts({1: host.url}, secret=SECRET)
        try:
            cancel = asyncio.Event()
            playing = asyncio.ensure_future(play(hosts, host, "e-slow", group=group, cancel=cancel))
            await wait_for(lambda: (tmp_path / "host" / "e-slow" / "workspace" / "started").exists(), "the start")
            cancel.set()
            cancelled_at = time.monotonic()
            result = await asyncio.wait_for(playing, 30)
            stop_s = time.monotonic() - cancelled_at

            class Other:
                id = "no-such-task"

            with pytest.raises(HostLost, match="no such task"):
                await play(hosts, host, "e-x", task=Other())
            async with aiohttp.ClientSession() as http:  # the job's secret only
                for headers, status in (({}, 401), ({"Authorization": "Bearer nope"}, 403)):
                    async with http.get(host.url + EXECUTIONS_PATH.format(execution="e"), headers=headers) as answer:
                        assert answer.status == status
            return result, stop_s
        finally:
            await hosts.close()

    result, stop_s = asyncio.run(asyncio.wait_for(main(), 120))
    assert result.status is Status.CANCELLED and stop_s < 10.0
    assert group.execution("e-slow").status is Status.CANCELLED


def test_a_host_that_stops_mid_execution_is_host_lost(host, tmp_path):

    async def main():
        hosts = HarnessHosts({1: host.url}, secret=SECRET)
        try:
            playing = asyncio.ensure_future(play(hosts, host, "e-slow"))
            await wait_for(lambda: (tmp_path / "host" / "e-slow" / "workspace" / "started").exists(), "the start")
            await asyncio.to_thread(host.thread.stop)
            with pytest.raises(HostLost):
                await asyncio.wait_for(playing, 60)
        finally:
            await hosts.close()

    asyncio.run(asyncio.wait_for(main(), 120))


def test_placement_goes_to_the_node_with_the_fewest_running_the_controllers_first():
    async def main():
        hosts = HarnessHosts({1: "http://127.0.0.1:9", 2: "http://127.0.0.1:9"}, secret=SECRET)
        try:
            placed = [hosts.place() for _ in range(5)]
            hosts.ended(1)
            placed.append(hosts.place())
            return placed
        finally:
            await hosts.close()

    assert asyncio.run(main()) == [0, 1, 2, 0, 1, 1]


def test_a_proxy_bound_to_every_interface_is_reached_at_the_controllers_address():
    assert reachable("http://0.0.0.0:8700/v1", "10.0.0.5") == "http://10.0.0.5:8700/v1"
    assert reachable("http://[::]:8700", "fe80::1") == "http://[fe80::1]:8700"
    assert reachable("http://127.0.0.1:8700", "10.0.0.5") == "http://127.0.0.1:8700"


def test_a_proxy_the_node_cannot_reach_is_refused_naming_the_fix(host):
    async def main():
        hosts = HarnessHosts({1: host.url}, secret=SECRET, ranks={1: 3})
        try:
            await play(hosts, host, "e-finish", access=PROXY)  # port 9 of the loopback: nothing listens
        finally:
            await hosts.close()

    with pytest.raises(HostLost, match=r"rank 3, .*cannot be reached from this node.*proxy.host=0.0.0.0"):
        asyncio.run(asyncio.wait_for(main(), 60))
