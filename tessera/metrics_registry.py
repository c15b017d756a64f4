"""The Prometheus registry every component (gateway, engine pod) serves.

One home for what a scrape of any Tessera process carries besides its own
metrics: the process's CPU, memory, file descriptors and start time
(``process_*``) and the Python version (``python_info``), and no ``_created``
series, which double the series of every counter and histogram and which
Prometheus does not need (it detects counter resets itself).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, PlatformCollector, ProcessCollector, disable_created_metrics


def component_registry() -> CollectorRegistry:
    """A new registry holding the process and platform collectors."""
    # A process-wide switch of prometheus_client, read at each scrape: every registry the
    # process serves loses its `_created` series, whichever component set it up.
    disable_created_metrics()
    registry = CollectorRegistry()
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry
