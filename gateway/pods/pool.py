"""The set of engine pods by role, kept fresh by their pushed load reports.

Each pod streams `LoadReport`s (Engine.StreamLoad); a broken stream or a
failed call ejects the pod, and the watcher reconnects every
`reprobe_interval_s` until a report arrives again. A pod silent for
`load_timeout_s` is stalled (a stopped process keeps its connection open):
it is ejected and its in-flight Generate calls end too, retried elsewhere if
they streamed nothing yet. Membership changes come from discovery (a static
list or EndpointSlices).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import grpc

from gateway.config import AdmissionConfig, RouterConfig
from gateway.loop_lag import LoopLag
from gateway.pods.deadline import NoProgress, ProgressDeadline
from gateway.pods.pod import Pod
from gateway.pods.prefix_index import PrefixIndex
from tessera.internal_channel import InternalClient
from tessera.v1 import engine_pb2 as epb

logger = logging.getLogger(__name__)


class PodPool:
    def __init__(self, router_config: RouterConfig, admission_config: AdmissionConfig,
                 on_change: Callable[[], None] = lambda: None, client: InternalClient | None = None,
                 loop_lag: LoopLag | None = None) -> None:
        self.router_config = router_config
        # The credentials every pod's channel presents (tessera/internal_channel.py).
        self.client = client
        self.admission_config = admission_config
        # Called after every report or ejection (admission re-reads capacity).
        self.on_change = on_change
        # This process's event-loop lateness: deadlines are put off while it lags (pods/deadline.py).
        self.loop_lag = loop_lag
        self.pods: dict[str, Pod] = {}
        self._watchers: dict[str, asyncio.Task] = {}
        # The pods' pushed prefix caches (router.prefix_match "pushed"; empty otherwise).
        self.prefix_index = PrefixIndex(max_keys_per_pod=router_config.max_pushed_blocks_per_pod)
        self._pushed_keys = router_config.prefix_match == "pushed"

    # -- membership ------------------------------------------------------
    def set_members(self, role: str, addresses: list[str]) -> None:
        """Make the pods of `role` exactly `addresses` (discovery calls this)."""
        wanted = set(addresses)
        for address, pod in list(self.pods.items()):
            if pod.role == role and address not in wanted:
                self._remove(address)
        for address in addresses:
            if address not in self.pods:
                pod = Pod(address, role, self.client)
                self.pods[address] = pod
                self.prefix_index.add(address)
                self._watchers[address] = asyncio.get_running_loop().create_task(self._watch(pod))
                logger.info("pool: added %s pod %s", role, address)
        self.on_change()

    def _remove(self, address: str) -> None:
        """No new request goes to the pod; those it runs finish (it drains
        when it leaves the Service), bounded by the stream idle timeout."""
        pod = self.pods.pop(address)
        self._watchers.pop(address).cancel()
        self.prefix_index.remove(address)
        pod.eject()  # plans made before it left skip it on a retry
        asyncio.get_running_loop().create_task(pod.close_when_idle(self.router_config.stream_idle_timeout_s))
        logger.info("pool: removed %s pod %s", pod.role, address)

    async def close(self) -> None:
        for task in self._watchers.values():
            task.cancel()
        await asyncio.gather(*self._watchers.values(), return_exceptions=True)
        await asyncio.gather(*(pod.close() for pod in self.pods.values()), return_exceptions=True)

    # -- state -----------------------------------------------------------
    def routable(self, role: str | None = None) -> list[Pod]:
        return [p for p in self.pods.values() if p.routable and (role is None or p.role == role)]

    def roles(self) -> set[str]:
        return {p.role for p in self.pods.values()}

    @property
    def disaggregated(self) -> bool:
        return bool(self.routable("prefill")) and bool(self.routable("decode"))

    def free_slots(self) -> int:
        """Requests the pool can take before every entry pod is saturated.

        Entry pods are those that start requests: mixed pods, or decode pods
        in P/D mode (every request ends there)."""
        a = self.admission_config
        entry = [p for p in self.pods.values() if p.role in ("mixed", "decode")]
        return sum(p.free_slots(a.max_waiting_per_pod, a.max_kv_usage) for p in entry)

    def eject(self, pod: Pod, reason: str) -> None:
        """Stop routing to the pod. Its in-flight calls go on: a pod that
        refuses new work (draining) still finishes what it has."""
        if pod.healthy:
            logger.warning("pool: ejecting %s pod %s: %s", pod.role, pod.address, reason)
        pod.eject()
        self.on_change()

    def stall(self, pod: Pod, reason: str) -> None:
        """Eject a pod that stopped answering, and end its in-flight calls:
        they would wait as long as the pod stays frozen."""
        if pod.calls:
            logger.warning("pool: %s pod %s stalled; ending its %d in-flight call(s)",
                           pod.role, pod.address, len(pod.calls))
        self.eject(pod, reason)
        self._end_calls(pod, reason)

    @staticmethod
    def _end_calls(pod: Pod, reason: str) -> None:
        for deadline in list(pod.calls):
            deadline.expire(f"engine pod stalled: {reason}")

    # -- load reports ----------------------------------------------------
    async def _watch(self, pod: Pod) -> None:
        interval = self.router_config.load_interval_ms
        refused = False
        while True:
            call = None
            try:
                # A new stream pushes the whole set again: what the last one said is dropped.
                self.prefix_index.clear(pod.address)
                call = pod.stub.StreamLoad(epb.LoadRequest(interval_ms=interval, prefix_cache_keys=self._pushed_keys))
                await self._read_reports(pod, call)
            except asyncio.CancelledError:
                raise
            except NoProgress as e:
                self.stall(pod, str(e))
            except grpc.aio.AioRpcError as e:
                if e.code() == grpc.StatusCode.UNAUTHENTICATED and not refused:
                    # Never routable until fixed: say so once, loudly (eject logs only a healthy pod).
                    logger.error("pool: %s pod %s refuses this gateway's internal token: the gateway and "
                                 "the engine pods must share one internal secret", pod.role, pod.address)
                refused = e.code() == grpc.StatusCode.UNAUTHENTICATED
                self.eject(pod, f"load stream: {e.code().name}")
            except Exception as e:  # never let one pod's watcher die
                self.eject(pod, f"load stream: {e!r}")
            else:
                self.eject(pod, "load stream ended")
            finally:
                if call is not None:
                    call.cancel()  # a stalled stream would otherwise linger
            await asyncio.sleep(self.router_config.reprobe_interval_s)

    async def _read_reports(self, pod: Pod, call) -> None:
        """Apply the pod's reports until its stream ends; NoProgress if one
        is `load_timeout_s` late."""
        deadline = ProgressDeadline(self.router_config.load_timeout_s, "load report", self.loop_lag)
        while (report := await deadline.read(call)) is not grpc.aio.EOF:
            was_routable = pod.routable
            if report.HasField("prefix_cache"):
                if self._pushed_keys:
                    self.prefix_index.apply(pod.address, report.prefix_cache, report.num_kv_blocks)
                report.ClearField("prefix_cache")  # applied: the kept report stays small
            pod.on_report(report)
            if not was_routable and pod.routable:
                logger.info("pool: %s pod %s is serving", pod.role, pod.address)
            if report.stalled:
                self._end_calls_of_stalled(pod, was_routable)
            self.on_change()

    def _end_calls_of_stalled(self, pod: Pod, was_routable: bool) -> None:
        """The pod still reports, but its engine loop is wedged in one step
        (it says so past its --step-timeout): not routable (Pod.routable), and
        its calls end now (retried elsewhere when nothing was streamed)."""
        if was_routable:
            logger.warning("pool: %s pod %s reports its engine loop stalled; ending its %d in-flight call(s)",
                           pod.role, pod.address, len(pod.calls))
        self._end_calls(pod, "its engine loop is stuck in one step")
