"""Priority classes under saturation: long "blocker" requests fill both pods'
running sets and waiting slots, lows and then highs queue in the gateway's
fair queue behind them, and the sheddable class is refused (429) meanwhile.
When the blockers end, the high class overtakes the low one.

The blockers hold every slot until both classes are queued: without them,
how many lows the pods took while the highs' requests were still reaching
the gateway depended on the host's load (0 to 20 seen on two busy cores)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from engine_pod.server.process import EnginePodProcess
from gateway.process import GatewayProcess
from tests.gateway.observe import metric_sum
from tests.gateway.conftest import MODEL_NAME, POD_ARGS, gateway_config

# Two sequences at a time per pod, one more waiting in each (max_waiting_per_pod).
MAX_MODEL_LEN = 1024
SATURATING_POD_ARGS = POD_ARGS + ["--max-num-seqs", "2", "--scheduling-policy", "priority",
                                  "--max-model-len", str(MAX_MODEL_LEN)]
POD_SLOTS = 2 * (2 + 1)
CLASSES = [
    {"name": "high", "priority": 0, "weight": 8},
    {"name": "low", "priority": 10, "weight": 1},
    {"name": "batch", "priority": 20, "weight": 1, "sheddable": True},
]
# The high class is the minority, as interactive traffic usually is.
NUM_LOW, NUM_HIGH, NUM_SHEDDABLE = 24, 16, 8
NUM_CONNECTIONS = POD_SLOTS + NUM_LOW + NUM_HIGH + NUM_SHEDDABLE + 1  # + 1: the metrics reads
QUEUES_FORM_S = 60.0


async def _request(http: httpx.AsyncClient, base_url: str, pclass: str, i: int, max_tokens: int = 16) -> dict:
    body = {"model": MODEL_NAME, "prompt": f"{pclass} request number {i}", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "priority_class": pclass}
    async with http.stream("POST", base_url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"class": pclass, "status": r.status_code, "body": json.loads(await r.aread())}
        first_at = None
        async for line in r.aiter_lines():
            if line.startswith("data: {") and first_at is None:
                first_at = time.monotonic()
        return {"class": pclass, "status": 200, "first_at": first_at}


async def _queue_lengths(http: httpx.AsyncClient, metrics_url: str) -> dict[str, float]:
    text = (await http.get(metrics_url)).text
    lengths = {c["name"]: 0.0 for c in CLASSES}
    for line in text.splitlines():
        for name in lengths:
            if line.startswith(f'tessera_gateway_queue_length{{priority_class="{name}"}}'):
                lengths[name] = float(line.rsplit(" ", 1)[1])
    return lengths


async def _wait_queued(http: httpx.AsyncClient, metrics_url: str, at_least: dict[str, int]) -> dict[str, float]:
    deadline = time.monotonic() + QUEUES_FORM_S
    while True:
        lengths = await _queue_lengths(http, metrics_url)
        if all(lengths[name] >= n for name, n in at_least.items()):
            return lengths
        assert time.monotonic() < deadline, f"the queue never reached {at_least}: {lengths}"
        await asyncio.sleep(0.05)


def test_high_class_overtakes_low_and_sheddable_is_refused_first(tiny_llama, tmp_path):
    with EnginePodProcess(tiny_llama, SATURATING_POD_ARGS, log_path=tmp_path / "a.log") as a, \
         EnginePodProcess(tiny_llama, SATURATING_POD_ARGS, log_path=tmp_path / "b.log") as b:
        a.wait_serving()
        b.wait_serving()
        config = gateway_config(tiny_llama, [(a, "mixed"), (b, "mixed")], priority_classes=CLASSES,
                                default_priority_class="low",
                                admission={"max_waiting_per_pod": 1, "queue_timeout_s": 120})
        config["model"]["max_model_len"] = MAX_MODEL_LEN
        with GatewayProcess(config, tmp_path, log_path=tmp_path / "gateway.log") as gw:
            gw.wait_ready(num_pods=2)

            async def run():
                limits = httpx.Limits(max_connections=NUM_CONNECTIONS, max_keepalive_connections=NUM_CONNECTIONS)
                async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as http:
                    blockers = [asyncio.create_task(_request(http, gw.base_url, "low", i, MAX_MODEL_LEN - 32))
                                for i in range(POD_SLOTS)]
                    await _wait_queued(http, gw.metrics_url, {})  # the gateway answers
                    await asyncio.sleep(0.5)  # the blockers reach the pods
                    tasks = [asyncio.create_task(_request(http, gw.base_url, "low", i)) for i in range(NUM_LOW)]
                    # Lows the pods took (one went to a pod with room) start ahead of any high.
                    lows_queued = (await _wait_queued(http, gw.metrics_url, {"low": NUM_LOW - POD_SLOTS}))["low"]
                    tasks += [asyncio.create_task(_request(http, gw.base_url, "high", i)) for i in range(NUM_HIGH)]
                    queued = await _wait_queued(http, gw.metrics_url, {"high": NUM_HIGH})
                    sheddable = [await _request(http, gw.base_url, "batch", i) for i in range(NUM_SHEDDABLE)]
                    assert not any(t.done() for t in blockers), "a blocker ended before the queues formed"
                    for t in blockers:
                        t.cancel()
                    return await asyncio.gather(*tasks), sheddable, lows_queued, queued

            results, sheddable, lows_queued, queued = asyncio.run(run())
            shed = metric_sum(gw.metrics_url, "tessera_gateway_rejections_total", reason="shed")

    # High and low are never refused: they wait in the gateway's queue.
    assert all(r["status"] == 200 for r in results)
    # The sheddable class is refused under saturation, with a retry hint.
    assert all(r["status"] == 429 and r["body"]["error"]["code"] == "shed" for r in sheddable)
    assert shed == NUM_SHEDDABLE
    assert queued["low"] == lows_queued, "a low left the queue while every slot was held"
    # Order, not speed: weights 8:1 let about one low through per eight
    # highs; equal weights would let one through per high (checked by setting
    # the weights equal: 9 of 24 lows ahead of the 12th high).
    order = "".join(r["class"][0] for r in sorted(results, key=lambda r: r["first_at"]))
    twelfth_high = [i for i, c in enumerate(order) if c == "h"][11]
    lows_ahead = order[:twelfth_high].count("l")
    in_pods = NUM_LOW - int(lows_queued)
    print(f"start order {order}; {in_pods} lows in the pods before the highs came, {lows_ahead} lows ahead of "
          "the 12th high")
    assert lows_ahead <= in_pods + 12 // 8 + 1, order
