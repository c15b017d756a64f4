"""The streaming client against a small fake OpenAI-compatible server (in
process): model discovery, dropping a refused ignore_eos, and failures that
are counted instead of stopping the run."""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import replace

from aiohttp import web

from tessera_tools.bench.serve.arrivals import arrival_offsets
from tessera_tools.bench.serve.client import ServeClient
from tessera_tools.bench.serve.dataset import ServeRequest
from tessera_tools.bench.serve.load import run_at_rate
from tessera_tools.bench.serve.runner import resolve_target
from tessera.child_process import free_port


async def models(_request):
    return web.json_response({"object": "list", "data": [{"id": "fake-model"}, {"id": "other"}]})


async def completions(request):
    body = await request.json()
    if "ignore_eos" in body:  # as OpenAI's own API answers an unknown field
        return web.json_response({"error": {"message": "Unrecognized request argument supplied: ignore_eos"}},
                                 status=400)
    if body["prompt"] == "fail":
        return web.json_response({"error": {"message": "boom"}}, status=500)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(body["max_tokens"]):
        await resp.write(f"data: {json.dumps({'choices': [{'index': 0, 'text': f' t{i}', 'finish_reason': None}]})}\n\n"
                         .encode())
        await asyncio.sleep(0.005)
    usage = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": body["max_tokens"]}}
    await resp.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
    return resp


async def scenario(port: int):
    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        args = argparse.Namespace(model=None, endpoint="completions", no_ignore_eos=False)
        requests = [ServeRequest(3, prompt="ok"), ServeRequest(2, prompt="fail"), ServeRequest(4, prompt="ok")]
        async with ServeClient(f"http://127.0.0.1:{port}/v1/") as client:
            target = await resolve_target(client, args, requests[0])
            run = await run_at_rate(client, target, requests, arrival_offsets(3, 50.0, seed=0), 50.0, 2,
                                    progress=False)
            # Nothing listens there: the request fails, the client carries on.
            refused = await client.send(replace(target, base_url=f"http://127.0.0.1:{free_port()}/v1"), requests[0])
    finally:
        await runner.cleanup()
    return target, run, refused


def test_fake_server():
    target, run, refused = asyncio.run(scenario(free_port()))
    assert target.model == "fake-model" and target.ignore_eos is False
    ok, failed, ok2 = run.outcomes
    assert ok.ok and ok.output_tokens == 3 and len(ok.itl_s) == 2 and ok.ttft_s > 0
    assert ok2.ok and ok2.output_tokens == 4
    assert not failed.ok and failed.error.startswith("HTTP 500") and "boom" in failed.error
    assert run.duration_s > 0
    assert not refused.ok and "Connect" in refused.error
