"""`tessera bench fleet --scenario autoscale|faults`: the controller's
decisions fed synthetic scrapes (the operator's decide() on the
observation observe.py would build; pods listed only after serving and the
start-up delay; scale-down unlists before SIGTERM), how a request's end is
classified, and two small fleets end to end: scale from zero with 0-3
pods, and a node failure killing one of two processes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import yaml

from tessera_operator.autoscale import PoolObservation, ScalerState, ScalingPolicy, decide
from tessera_operator.crd_engine import autoscaling_schema
from tessera_tools.bench import fleet as fleet_bench
from tessera_tools.bench.fleet.scaling_policies import scaling_policy
from tessera_tools.bench.fleet.autoscaler import Autoscaler
from tessera_tools.bench.fleet.elastic_pool import ElasticPod, ElasticPool, PoolTimings
from tessera_tools.bench.fleet.faults_run import killed_processes
from tessera_tools.bench.fleet.node_failure import routable_and_routed
from tessera_tools.bench.fleet.pods_file import PodsFile, file_stamp
from tessera_tools.bench.fleet.scenario_replay import _Recorder

FAST_PROFILE = {"format_version": 1, "base_s": 0.004, "per_prefill_token_s": 4e-5, "per_decode_seq_s": 5e-4,
                "per_context_token_s": 0.0, "per_kv_byte_s": 0.0}
DELAY, GRACE = 10.0, 0.6
GATEWAYS = ["http://gw0/metrics", "http://gw1/metrics"]


# -- fakes: a pod process and the scrapes ------------------------------------------------
class FakePod:
    """What the pool drives; remembers what the pods file listed when it got its SIGTERM."""

    def __init__(self, name: str, pods_file: PodsFile) -> None:
        self.address = f"{name}:9000"
        self.metrics_url = f"http://{name}/metrics"
        self.is_serving = False
        self.code: int | None = None
        self.listed_at_sigterm: list[str] | None = None
        self._pods_file = pods_file

    def serving(self) -> bool:
        return self.is_serving

    def request_stop(self) -> None:
        self.listed_at_sigterm = _listed(self._pods_file)

    def exit_code(self) -> int | None:
        return self.code

    def close(self) -> None:
        self.code = 0


def _listed(pods_file: PodsFile) -> list[str]:
    """What a gateway would read from the file."""
    return yaml.safe_load(pods_file.path.read_text())["mixed"]


def pod_text(waiting=0.0, running=0.0, kv=0.0, ttft_sum=0.0, ttft_count=0.0, in_flight_s=None) -> str:
    text = (f"tessera_num_requests_waiting {waiting}\ntessera_num_requests_running {running}\n"
            f"tessera_kv_cache_usage_perc {kv}\ntessera_time_to_first_token_seconds_sum {ttft_sum}\n"
            f"tessera_time_to_first_token_seconds_count {ttft_count}\n")
    if in_flight_s is not None:
        text += ("# TYPE tessera_request_in_flight_seconds counter\n"
                 f"tessera_request_in_flight_seconds_total {in_flight_s}\n")
    return text


def gateway_text(queued: int, prefills_unplaced: int = 0) -> str:
    return (f'tessera_gateway_queue_length{{priority_class="interactive"}} {queued}\n'
            'tessera_gateway_queue_length{priority_class="batch"} 0\n'
            f'tessera_gateway_prefills_unplaced_total {prefills_unplaced}\n')


class Harness:
    def __init__(self, tmp_path, policy: ScalingPolicy, role: str = "mixed") -> None:
        self.launched: dict[str, FakePod] = {}
        self.pages: dict[str, str] = {url: gateway_text(0) for url in GATEWAYS}
        self.pods_file = PodsFile(tmp_path / "pods.yaml")
        self.pool = ElasticPool(self._launch, self.pods_file, PoolTimings(DELAY, GRACE), role=role)
        self.now = 0.0
        """The scrapes' clock."""
        self.autoscaler = Autoscaler(policy, self.pool, self._fetch, GATEWAYS, clock=lambda: self.now)

    def _launch(self, name: str) -> FakePod:
        self.launched[name] = FakePod(name, self.pods_file)
        return self.launched[name]

    def _fetch(self, url: str) -> str:
        if url not in self.pages:
            raise OSError("connection refused")
        return self.pages[url]

    def bring_up(self, count: int, now: float = -DELAY) -> list[FakePod]:
        """`count` pods ready at `now` + DELAY."""
        self.pool.scale_to(count, now)
        for pod in self.launched.values():
            pod.is_serving = True
        self.pool.step(now + DELAY)
        self.autoscaler.replicas = count
        return list(self.launched.values())

    def scrape(self, pod: FakePod, text: str) -> None:
        self.pages[pod.metrics_url] = text


def policy(**overrides) -> ScalingPolicy:
    fields = {"signal": "queue", "target": 4.0, "min_replicas": 0, "max_replicas": 8, "down_window_s": 30.0}
    return ScalingPolicy(**{**fields, **overrides})


# -- the controller ---------------------------------------------------------------------
@pytest.mark.parametrize("role, lifted", [("prefill", True), ("decode", False)])
def test_prompts_prefilled_on_decode_pods_lift_only_a_prefill_pool_from_zero(tmp_path, role, lifted):
    h = Harness(tmp_path, policy(signal="concurrency", target=1.0), role=role)
    h.pages[GATEWAYS[0]] = gateway_text(0, prefills_unplaced=7)
    assert h.autoscaler.tick(0.0).reason == "ScaledToZero", "the counter's first look is no rise"
    h.pages[GATEWAYS[0]] = gateway_text(0, prefills_unplaced=9)
    decision = h.autoscaler.tick(5.0)
    assert (decision.reason == "ScaleFromZero") is lifted and len(h.launched) == int(lifted)
    assert h.autoscaler.ticks[-1]["prefills_unplaced"] == (2 if lifted else 0)


def test_queued_requests_lift_the_pool_from_zero_and_the_pod_is_listed_after_serving_and_the_delay(tmp_path):
    h = Harness(tmp_path, policy())
    assert h.autoscaler.tick(0.0).reason == "ScaledToZero" and not h.launched
    h.pages[GATEWAYS[0]], h.pages[GATEWAYS[1]] = gateway_text(2), gateway_text(1)
    decision = h.autoscaler.tick(5.0)
    assert (decision.reason, decision.replicas) == ("ScaleFromZero", 1)
    assert "3 request(s) queued" in decision.message  # both gateways' queues, every priority class
    (pod,) = h.launched.values()
    assert h.autoscaler.tick(6.0).reason == "WaitingForReadyPods" and len(h.launched) == 1  # no second pod
    h.pool.step(5.0 + DELAY)
    assert _listed(h.pods_file) == []  # the delay has passed, but it does not serve yet
    pod.is_serving = True
    h.pool.step(5.0 + DELAY - 0.01)
    assert _listed(h.pods_file) == []  # it serves, but the delay has not passed
    h.pool.step(5.0 + DELAY)
    assert _listed(h.pods_file) == [pod.address]
    assert [e["event"] for e in h.pool.events] == ["started", "listed"]


def test_every_decision_is_the_operators_decide_on_the_observation_observe_py_builds(tmp_path):
    """Two ready pods on the ttft signal, scraped thrice: the signal is the
    interval mean (histogram differences since the previous scrape), a pod
    that does not answer is left out, starting pods are pending."""
    p = policy(signal="ttft", target=1.0, min_replicas=1, up_window_s=0.0)
    h = Harness(tmp_path, p)
    a, b = h.bring_up(2)
    mirror = ScalerState()
    scrapes = [  # (a's page, b's page, gateway queue, expected observation)
        (pod_text(running=3, ttft_sum=10, ttft_count=10), pod_text(running=1, ttft_sum=2, ttft_count=4), 0,
         PoolObservation(2, 2, 0, signal=12 / 14, busy=True)),
        (pod_text(running=3, ttft_sum=40, ttft_count=20), pod_text(running=2, ttft_sum=12, ttft_count=8), 1,
         PoolObservation(2, 2, 0, signal=40 / 14, busy=True, gateway_queued=1)),
    ]
    for i, (text_a, text_b, queued, expected) in enumerate(scrapes):
        h.scrape(a, text_a)
        h.scrape(b, text_b)
        h.pages[GATEWAYS[0]] = gateway_text(queued)
        now = 5.0 * i
        decision = h.autoscaler.tick(now)
        assert decision == decide(p, expected, mirror, now)
    assert decision.reason == "ScaleUp" and decision.replicas == 6  # ceil(2 x 2.86)
    assert len(h.launched) == 6 and _listed(h.pods_file) == sorted([a.address, b.address])
    # The new pods are pending; b stops answering: left out of the signal and the ready count.
    del h.pages[b.metrics_url]
    h.scrape(a, pod_text(running=1, ttft_sum=41, ttft_count=21))
    obs = h.autoscaler.observe()
    assert (obs.replicas, obs.ready, obs.pending, obs.signal, obs.busy) == (6, 2, 4, pytest.approx(1.0), True)


def test_concurrency_counts_the_gateways_queue_as_the_operator_does_and_defaults_to_the_crds_target(tmp_path):
    args = _parse(["--scenario", "autoscale", "--scale-signal", "concurrency"])
    p = scaling_policy(args)
    assert (p.signal, p.target) == ("concurrency", 8.0)  # the CRD's targetConcurrencyPerReplica default
    crd_signals = autoscaling_schema()["properties"]["mixed"]["properties"]["signal"]["enum"]
    assert set(fleet_bench.SCALE_SIGNALS) == set(crd_signals)
    h = Harness(tmp_path, p)
    a, b = h.bring_up(2)
    h.scrape(a, pod_text(waiting=1, running=6))  # almost nothing waits: the queue signal would say 0.5
    h.scrape(b, pod_text(running=7))
    h.pages[GATEWAYS[0]], h.pages[GATEWAYS[1]] = gateway_text(12), gateway_text(6)
    obs = h.autoscaler.observe()
    assert obs.signal == pytest.approx((7 + 7 + 18) / 2) and obs.gateway_queued == 18
    decision = h.autoscaler.tick(0.0)
    assert (decision.reason, decision.replicas) == ("ScaleUp", 4)  # ceil(2 x 16 / 8)


def test_concurrency_is_each_pods_mean_between_two_scrapes(tmp_path):
    """Pod a's counter grew by 40 request-seconds in the 5 s between two ticks (a mean of 8) though
    its gauges read 1 at the second; pod b has no previous scrape: its gauges (3) stand in."""
    h = Harness(tmp_path, policy(signal="concurrency", target=4.0, min_replicas=1))
    a, b = h.bring_up(2)
    h.scrape(a, pod_text(running=5, in_flight_s=100.0))
    h.autoscaler.observe()
    h.now += 5.0
    h.scrape(a, pod_text(running=1, in_flight_s=140.0))
    h.scrape(b, pod_text(running=2, waiting=1, in_flight_s=7.0))
    assert h.autoscaler.observe().signal == pytest.approx((8 + 3) / 2)


def test_scale_up_is_limited_by_the_step_and_the_maximum(tmp_path):
    h = Harness(tmp_path, policy(max_replicas=5))
    a, b = h.bring_up(2)
    h.scrape(a, pod_text(waiting=12))
    h.scrape(b, pod_text(waiting=12))
    decision = h.autoscaler.tick(0.0)
    assert (decision.reason, decision.replicas) == ("ScaleUp", 5)  # ceil(2 x 12/4) = 6, at most 5
    assert len(h.launched) == 5 and len(h.pool.in_state("starting")) == 3


def test_scale_down_unlists_the_newest_pod_then_sigterms_it_and_counts_it_until_it_exits(tmp_path):
    h = Harness(tmp_path, policy(min_replicas=1, down_window_s=30.0))
    pods = h.bring_up(3)
    for pod in pods:
        h.scrape(pod, pod_text(running=1))  # busy, nothing waiting: the queue signal says 0
    assert h.autoscaler.tick(0.0).reason == "DownStabilizing"
    decision = h.autoscaler.tick(30.0)
    assert (decision.reason, decision.replicas) == ("ScaleDown", 2)
    (leaving,) = h.pool.in_state("terminating")
    assert leaving is h.pool.pods[-1]  # listed at the same time as the others, started last
    assert leaving.handle.address not in _listed(h.pods_file)
    assert leaving.handle.listed_at_sigterm is None  # unlisted, not yet signalled
    h.pool.step(30.0 + GRACE - 0.01)
    assert leaving.handle.listed_at_sigterm is None
    h.pool.step(30.0 + GRACE)
    assert leaving.handle.listed_at_sigterm == _listed(h.pods_file)  # SIGTERM came after the file had dropped it
    assert leaving.handle.address not in leaving.handle.listed_at_sigterm
    assert h.pool.counts() == {"starting": 0, "ready": 2, "terminating": 1}
    assert h.pool.pod_seconds(0.0, 40.0) == pytest.approx(3 * 40.0)  # draining still costs
    leaving.handle.code = 0
    h.pool.step(35.0)
    assert leaving.state == "exited" and h.pool.pod_seconds(0.0, 40.0) == pytest.approx(2 * 40.0 + 35.0)
    assert [e["event"] for e in h.pool.events if e["pod"] == leaving.name][-3:] == ["unlisted", "sigterm", "exited"]


def test_surplus_goes_starting_pods_first_and_they_stop_at_once(tmp_path):
    h = Harness(tmp_path, policy())
    h.bring_up(2)
    h.pool.scale_to(4, 100.0)
    starting = h.pool.in_state("starting")
    h.pool.scale_to(2, 101.0)
    assert all(p.state == "terminating" and p.stop_sent_at == 101.0 for p in starting)
    assert len(h.pool.in_state("ready")) == 2


def test_a_pod_that_dies_listed_is_unlisted_and_replaced_at_the_next_tick(tmp_path):
    h = Harness(tmp_path, policy(min_replicas=2))
    a, b = h.bring_up(2)
    for pod in (a, b):
        h.scrape(pod, pod_text(waiting=4))
    a.code = -9
    h.pool.step(1.0)
    assert _listed(h.pods_file) == [b.address]
    h.autoscaler.tick(2.0)
    assert len(h.launched) == 3 and len(h.pool.active) == 2


def test_pod_seconds_run_from_process_start_to_exit_within_the_window():
    pod = ElasticPod("p", FakePod("p", None), started_at=5.0)
    assert pod.seconds_within(0.0, 20.0) == 15.0  # the start-up counts
    pod.exited_at = 12.0
    assert pod.seconds_within(0.0, 20.0) == 7.0 and pod.seconds_within(8.0, 10.0) == 2.0
    assert pod.seconds_within(13.0, 20.0) == 0.0


def test_the_pods_file_changes_stamp_on_every_write_even_on_a_coarse_clock(tmp_path, monkeypatch):
    """The gateways see a change by (mtime, size). Many file systems keep
    mtime to a clock tick of some milliseconds: on such a clock (10 ms here)
    back-to-back writes of the same size must still differ."""
    from tessera_tools.bench.fleet import pods_file as module

    def coarse(path):
        mtime_ns, size = file_stamp(path)
        return mtime_ns // 10_000_000, size

    monkeypatch.setattr(module, "file_stamp", coarse)
    pods_file = PodsFile(tmp_path / "pods.yaml")
    stamps = []
    for i in range(5):
        pods_file.set([f"127.0.0.1:{10000 + i}"])
        stamps.append(coarse(pods_file.path))
    assert len(set(stamps)) == len(stamps)
    assert _listed(pods_file) == ["127.0.0.1:10004"]


# -- faults -----------------------------------------------------------------------------
def test_a_tenth_of_the_processes_die_rounded_up_and_some_survive():
    assert len(killed_processes(16, seed=0)) == 2 and len(killed_processes(2, seed=0)) == 1
    assert killed_processes(16, seed=3) == killed_processes(16, seed=3)
    with pytest.raises(ValueError, match="leaves none"):
        killed_processes(1, seed=0)


def test_the_watch_reads_routable_pods_and_the_killed_pods_routing_decisions():
    text = ('tessera_gateway_pods_routable{role="mixed"} 14.0\ntessera_gateway_pods_routable{role="decode"} 3.0\n'
            'tessera_gateway_routing_decisions_total{kind="route",pod="a:1",role="mixed"} 5.0\n'
            'tessera_gateway_routing_decisions_total{kind="retry",pod="a:1",role="mixed"} 2.0\n'
            'tessera_gateway_routing_decisions_total{kind="route",pod="b:1",role="mixed"} 9.0\n')
    assert routable_and_routed(text, {"a:1"}) == (14.0, 7.0)
    assert routable_and_routed(text, {"c:1"}) == (14.0, 0.0)


def _ending(events, http_error=None, client_error=None) -> str:
    recorder = _Recorder(0.0, 10)
    if http_error:
        recorder.server_error = True
        recorder.fail(0.1, http_error)
    for i, event in enumerate(events):
        recorder.on_event(0.1 * (i + 1), event)
    if client_error:
        recorder.fail(1.0, client_error)
    return recorder.ending(recorder.outcome())


def test_how_a_request_ended():
    token = {"choices": [{"text": "x", "finish_reason": None}]}
    error = {"error": {"message": "the engine pod failed mid-stream"}}
    assert _ending([token, token, "[DONE]"]) == "ok"
    assert _ending([token, error]) == "failed_after_streaming"
    assert _ending([error]) == "failed_before_streaming"
    assert _ending([], http_error="HTTP 503: no pod") == "failed_before_streaming"
    assert _ending([token]) == "lost"  # the stream closed without [DONE] or an error
    assert _ending([token], client_error="ServerTimeoutError: timeout") == "lost"


# -- end to end -------------------------------------------------------------------------
@pytest.fixture
def fast_profile(tmp_path):
    path = tmp_path / "fast-profile.json"
    path.write_text(json.dumps(FAST_PROFILE))
    return path


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    fleet_bench.add_parser(parser.add_subparsers(dest="bench"))
    return parser.parse_args(["fleet", *argv])


def _small(tiny_llama, fast_profile, tmp_path, *extra: str) -> argparse.Namespace:
    return _parse(["--model", str(tiny_llama), "--profile", str(fast_profile), "--gateways", "1", "--duration", "10",
                   "--kv-blocks", "48", "--tenants-per-pod", "2", "--system-prompt-len", "100,200",
                   "--user-len", "10,30", "--think-time", "0.5", "--slo", "ttft=5000,itl=1000", "--no-progress",
                   "--output", str(tmp_path / "report.json"), "--logs", str(tmp_path / "logs"), *extra])


def _run_report(args: argparse.Namespace) -> dict:
    """Runs the scenario `args` describe (it must exit 0) and returns its JSON report."""
    assert args.bench_func(args) == 0
    return json.loads(Path(args.output).read_text())


FLEET_KEYS = {"slo_attainment", "slo_over_time", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms",
              "pod_minutes", "timeline", "pod_events", "decisions", "endings", "pod_process_rss_mb"}


@pytest.mark.slow
def test_autoscale_from_zero_end_to_end(tiny_llama, fast_profile, tmp_path):
    # The pool reaches zero only after a whole down window of ticks that saw no request running
    # (each tick's chance of catching one depends on the host's speed): a 2 s window, not 3, as
    # a 3 s one was missed in 2 of about 10 runs on a loaded 2-core host.
    args = _small(tiny_llama, fast_profile, tmp_path, "--scenario", "autoscale", "--scale-signal", "queue",
                  "--min-replicas", "0", "--max-replicas", "3", "--rate", "4", "--output-len", "4,8",
                  "--startup-delay", "1", "--scale-interval", "1", "--scale-down-window", "2",
                  "--plots", str(tmp_path / "plots"))
    report = _run_report(args)
    auto, static = report["runs"]["autoscaled"], report["runs"]["static"]
    for run in (auto, static):
        assert FLEET_KEYS <= set(run), FLEET_KEYS - set(run)
        assert run["requests"] == report["trace"]["requests"], run["endings"]
        bins = run["slo_over_time"]
        assert sum(b["requests"] for b in bins) == run["requests"]
        assert sum(b["met"] for b in bins) / run["requests"] == pytest.approx(run["slo_attainment"])
    assert static["failed"] == 0, static["endings"]
    # The queue signal drops a busy pool with an empty queue to zero: a request routed to its last pod as
    # that pod left waits for the next one (ResponseStream._replan) and fails no more than the others.
    assert auto["failed"] == 0, auto["endings"]
    zero = report["scale_from_zero"]
    assert zero["scaled_from_zero"] and zero["first_request_ok"] and zero["failed_requests"] == 0
    assert zero["first_pod_listed_t"] >= zero["scale_from_zero_t"] + 1.0  # the start-up delay
    events = [e["event"] for e in auto["pod_events"]]
    assert "listed" in events and events.index("unlisted") > events.index("listed")
    assert events.index("sigterm") > events.index("unlisted") and "exited" in events
    assert auto["timeline"][0]["asked"] == 0 and max(t["ready"] for t in auto["timeline"]) >= 1
    c = report["comparison"]
    assert c["static_pod_minutes"] == pytest.approx(3 * static["window_s"] / 60, rel=0.01)
    assert 0 < c["pod_minutes_ratio"] < 1 and isinstance(c["acceptance"]["met"], bool)
    assert report["order"] == ["autoscaled", "static"] and "prefill and decode pools" in report["limits"][0]
    assert (tmp_path / "plots" / "autoscale_timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_faults_end_to_end(tiny_llama, fast_profile, tmp_path):
    args = _small(tiny_llama, fast_profile, tmp_path, "--scenario", "faults", "--pods", "4", "--pods-per-process",
                  "2", "--rate", "6", "--output-len", "30,60")
    report = _run_report(args)
    endings, failure = report["endings"], report["failure"]
    assert report["processes"] == 2 and len(report["killed_processes"]) == 1 and len(failure["killed_pods"]) == 2
    assert failure["kill_at_s"] == pytest.approx(6.0, abs=0.5)  # the spike's start
    assert endings["lost"]["count"] == 0 and endings["failed_before_streaming"]["count"] == 0, endings
    assert sum(e["count"] for e in endings.values()) == report["requests"]
    assert failure["every_gateway_stopped"] and failure["routing_stopped_after_s"] < 5
    (gateway,) = failure["gateways"]
    assert gateway["routable_before"] - gateway["routable_after"] == 2
    last = failure["last_routing_decision_after_s"]
    assert last is None or last <= failure["routing_stopped_after_s"]


def test_the_scenarios_workload_is_a_flag(tiny_llama, fast_profile):
    from tessera_tools.bench.fleet.scenario_setup import plan_scenario

    common = ["--model", str(tiny_llama), "--profile", str(fast_profile), "--duration", "10", "--rate", "4"]
    shared = plan_scenario(_parse(["--scenario", "autoscale", *common]), 2)
    fresh = plan_scenario(_parse(["--scenario", "autoscale", "--scenario-workload", "no-reuse", *common]), 2)
    assert (shared.workload, fresh.workload) == ("shared-prefix", "no-reuse")
    assert [r.arrival_s for r in shared.requests] == [r.arrival_s for r in fresh.requests]

    # Sized for a prefill and a decode pool: the slower pool's rate, not two mixed pods'.
    from tessera_tools.bench.fleet.sweep import PDPools
    split = plan_scenario(_parse(["--scenario", "autoscale", *common[:-2], "--load", "0.5"]), 4, PDPools(3, 1))
    capacity = split.plan.capacity
    assert split.plan.as_dict()["sized_for"] == {"prefill": 3, "decode": 1}
    assert split.plan.steady_rate == pytest.approx(0.5 * min(3 / capacity.prefill_pod_seconds_per_request,
                                                             1 / capacity.decode_pod_seconds_per_request))
    with pytest.raises(ValueError, match="are not 5"):
        plan_scenario(_parse(["--scenario", "autoscale", *common]), 5, PDPools(3, 1))

    def first_blocks(scenario):
        return [tuple(r.prompt_token_ids[:16]) for r in scenario.requests]
    assert len(set(first_blocks(fresh))) == len(fresh.requests) > len(set(first_blocks(shared)))
