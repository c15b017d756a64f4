"""The gateway's hop to engine pods is authenticated (gateway/pods/pod.py,
tessera/internal_channel.py, engine_pod/server/auth.py): the internal token
on every call, mutual TLS when configured; a client that merely reaches a
pod learns nothing of a tenant's cached blocks, even knowing its name."""

from __future__ import annotations

import random
from pathlib import Path

import grpc
import httpx
import pytest

from engine_pod.server.process import EnginePodProcess
from gateway.config import GatewayConfigError, InternalConfig, gateway_config_from_dict
from gateway.main import build_gateway, internal_client
from gateway.process import GatewayProcess
from kv_store.block_hash import hash_request_tokens
from tessera.internal_channel import InternalClient, InternalTLS
from tessera.internal_secret import SECRET_ENV, SECRET_FILE_ENV, InternalSecret
from tessera.v1 import engine_pb2 as epb
from tessera.v1 import engine_pb2_grpc as epb_grpc
from tests.conftest import TEST_INTERNAL_SECRET
from tests.tls_certs import write_test_certs
from tests.gateway.conftest import KEYS, MODEL_NAME, POD_ARGS, gateway_config, write_tenants

SECRET = InternalSecret.from_text(TEST_INTERNAL_SECRET)
BLOCK_SIZE = 16
# The name the pod's certificate carries; pods are dialled by IP.
SERVER_NAME = "engine.tessera.internal"


def _load(address: str, hashes: list[bytes], metadata=()) -> epb.LoadReport:
    with grpc.insecure_channel(address) as channel:
        return epb_grpc.EngineStub(channel).GetLoad(epb.LoadRequest(block_hashes=hashes), metadata=metadata,
                                                    timeout=10)


def test_a_tenant_name_reveals_nothing_of_its_blocks(platform, engine_pods):
    """After tenant alice's prompt is served: without the token a pod answers
    nothing; with it, hashes salted with alice's name (what an attacker can
    guess) match no block, while her real, keyed salt matches the prompt."""
    prompt = [random.Random(16).randrange(100, 4000) for _ in range(3 * BLOCK_SIZE)]
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1, "temperature": 0.0}
    r = httpx.post(platform.base_url + "/v1/completions", json=body,
                   headers={"Authorization": f"Bearer {KEYS['alice']}"}, timeout=60)
    assert r.status_code == 200, r.text
    guessed = hash_request_tokens(prompt, BLOCK_SIZE, "tenant:alice")
    real = hash_request_tokens(prompt, BLOCK_SIZE, SECRET.cache_salt("tenant:alice"))
    for pod in engine_pods:
        with pytest.raises(grpc.RpcError) as err:
            _load(pod.address, real)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert _load(pod.address, guessed, SECRET.metadata()).matched_prefix_blocks == 0
    assert max(_load(p.address, real, SECRET.metadata()).matched_prefix_blocks for p in engine_pods) == 3


def test_gateway_without_a_secret_refuses_to_start(monkeypatch):
    """Before anything else loads (the pods would refuse every call)."""
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    config = gateway_config_from_dict(_config())
    with pytest.raises(GatewayConfigError) as err:
        build_gateway(config)
    assert all(name in str(err.value) for name in ("internal.secret_file", SECRET_FILE_ENV, SECRET_ENV))


# -- the internal section of the gateway config ---------------------------------
def _config(internal: dict | None = None) -> dict:
    config = {"model": {"name": "m", "path": "/m"}, "pods": {"static": [{"address": "127.0.0.1:1"}]}}
    return config if internal is None else {**config, "internal": internal}


def test_internal_config_parses_and_refuses_typos():
    config = gateway_config_from_dict(_config({"secret_file": "/s", "tls": {
        "ca_file": "/ca", "cert_file": "/crt", "key_file": "/key", "server_name": SERVER_NAME}}))
    assert config.internal == InternalConfig("/s", InternalTLS("/ca", "/crt", "/key", SERVER_NAME))
    with pytest.raises(GatewayConfigError, match=r"internal: unknown field\(s\) \['secret'\]"):
        gateway_config_from_dict(_config({"secret": "x"}))
    with pytest.raises(GatewayConfigError, match="internal.tls: .*key_file"):
        gateway_config_from_dict(_config({"tls": {"ca_file": "/ca", "cert_file": "/crt"}}))
    with pytest.raises(GatewayConfigError, match="internal: expected a mapping"):
        gateway_config_from_dict({**_config(), "internal": None})


def test_unreadable_tls_files_are_named(tmp_path):
    (tmp_path / "secret").write_text(TEST_INTERNAL_SECRET)
    missing = InternalTLS(str(tmp_path / "ca.crt"), "/nope.crt", "/nope.key")
    with pytest.raises(GatewayConfigError, match=r"internal.tls.ca_file: cannot read .*ca.crt"):
        internal_client(InternalConfig(str(tmp_path / "secret"), missing))


# -- mutual TLS -----------------------------------------------------------------
@pytest.fixture(scope="module")
def tls_pod(tiny_llama, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    certs = write_test_certs(folder, SERVER_NAME)
    flags = ["--tls-cert-file", certs["server.crt"], "--tls-key-file", certs["server.key"],
             "--tls-client-ca-file", certs["ca.crt"]]
    with EnginePodProcess(tiny_llama, [*POD_ARGS, *flags], log_path=folder / "pod.log", health_port=True) as pod:
        pod.wait_serving()  # over the plaintext health port: the gRPC port demands a client certificate
        yield pod, certs


def _get_load(client_or_channel, address: str, metadata=()) -> grpc.StatusCode:
    channel = client_or_channel.channel(address) if isinstance(client_or_channel, InternalClient) \
        else client_or_channel
    with channel:
        try:
            epb_grpc.EngineStub(channel).GetLoad(epb.LoadRequest(), metadata=metadata, timeout=10)
        except grpc.RpcError as e:
            return e.code()
    return grpc.StatusCode.OK


def test_tls_pod_refuses_clients_without_its_ca_s_certificate(tls_pod):
    pod, certs = tls_pod
    tls = InternalTLS(certs["ca.crt"], certs["client.crt"], certs["client.key"], SERVER_NAME)
    token = SECRET.metadata()
    rogue = InternalTLS(certs["ca.crt"], certs["rogue.crt"], certs["rogue.key"], SERVER_NAME)
    unnamed = InternalTLS(certs["ca.crt"], certs["client.crt"], certs["client.key"])
    codes = {
        "client certificate and token": _get_load(InternalClient(SECRET, tls), pod.address),
        # The token alone, in plaintext or over TLS without a client certificate: no handshake.
        "plaintext": _get_load(grpc.insecure_channel(pod.address), pod.address, token),
        "no client certificate": _get_load(grpc.secure_channel(
            pod.address, grpc.ssl_channel_credentials(Path(certs["ca.crt"]).read_bytes()),
            options=tls.channel_options()), pod.address, token),
        "another CA's certificate": _get_load(InternalClient(SECRET, rogue), pod.address),
        # The pod's certificate names SERVER_NAME, not the IP dialled.
        "no server_name": _get_load(InternalClient(SECRET, unnamed), pod.address),
        # A client certificate does not replace the token.
        "no token": _get_load(grpc.secure_channel(pod.address, tls.credentials(), options=tls.channel_options()),
                              pod.address),
    }
    unavailable = grpc.StatusCode.UNAVAILABLE
    assert codes == {"client certificate and token": grpc.StatusCode.OK, "plaintext": unavailable,
                     "no client certificate": unavailable, "another CA's certificate": unavailable,
                     "no server_name": unavailable, "no token": grpc.StatusCode.UNAUTHENTICATED}


def test_gateway_serves_a_completion_through_a_tls_pod(tls_pod, tiny_llama, tmp_path):
    pod, certs = tls_pod
    internal = {"tls": {"ca_file": certs["ca.crt"], "cert_file": certs["client.crt"],
                        "key_file": certs["client.key"], "server_name": SERVER_NAME}}
    config = gateway_config(tiny_llama, [(pod, "mixed")], write_tenants(tmp_path / "tenants.yaml"), internal=internal)
    with GatewayProcess(config, tmp_path, log_path=tmp_path / "gateway.log") as gw:
        gw.wait_ready(num_pods=1)
        r = httpx.post(gw.base_url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4},
                       headers={"Authorization": f"Bearer {KEYS['alice']}"}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 4


def test_a_gateway_with_another_secret_is_refused_and_says_so_once(engine_pods, caplog):
    """A gateway whose secret differs from the pods' never routes to them, and
    its log says why once (not every re-probe)."""
    import asyncio

    from gateway.config import AdmissionConfig, RouterConfig
    from gateway.pods.pool import PodPool

    async def watch_a_while() -> bool:
        client = InternalClient(InternalSecret.from_text("another-deployment-secret-" + "x" * 32))
        pool = PodPool(RouterConfig(reprobe_interval_s=0.1), AdmissionConfig(), client=client)
        pool.set_members("mixed", [engine_pods[0].address])
        await asyncio.sleep(1.5)  # about a dozen refused re-probes
        routable = bool(pool.routable())
        await pool.close()
        return routable

    with caplog.at_level("ERROR", logger="gateway.pods.pool"):
        assert not asyncio.run(watch_a_while())
    refusals = [r for r in caplog.records if "refuses this gateway's internal token" in r.getMessage()]
    assert len(refusals) == 1
    assert SECRET.token not in caplog.text
