"""``tessera operator``: run the kopf operator for one or more namespaces, or all of them."""

from __future__ import annotations

import argparse
import logging
import os

import kopf
import yaml
from kubernetes import config

from tessera_operator.cli import OPERATOR_NAMESPACE_ENV
from tessera_operator.handlers import register
from tessera_operator.kube import KubeApi

logger = logging.getLogger(__name__)


def load_client_config() -> None:
    """The pod's service account in a cluster, the kubeconfig elsewhere; ValueError (one line
    from `tessera operator`, not a traceback) when neither names a cluster."""
    try:
        config.load_incluster_config()
        return
    except config.ConfigException:
        pass  # not in a pod: the kubeconfig's turn
    try:
        config.load_kube_config()
    except (config.ConfigException, OSError, yaml.YAMLError) as e:
        where = os.environ.get("KUBECONFIG") or "~/.kube/config"
        raise ValueError(f"no Kubernetes cluster configured (kubeconfig {where}: {e}): set KUBECONFIG to a "
                         "kubeconfig file, or run in a pod with a service account") from None


def kopf_options(args: argparse.Namespace) -> dict:
    if args.interval <= 0:
        raise ValueError("interval must be > 0")
    if not 0 <= args.liveness_port < 65536:
        raise ValueError(f"liveness_port: {args.liveness_port} is not a port")
    registry = kopf.OperatorRegistry()
    register(registry, args.interval)
    # A registry of our own has no login handler (kopf adds its fallbacks to its default registry
    # only): without this one, kopf finds no credentials and stops at once. The official client's
    # in-cluster or kubeconfig credentials, as load_client_config reads them.
    kopf.on.login(registry=registry)(kopf.login_via_client)
    return {
        "registry": registry,
        # One replica, no peering objects: the chart runs a single pod with the Recreate strategy.
        "standalone": True,
        "clusterwide": bool(args.all_namespaces),
        "namespaces": list(args.namespaces or ()),
        "liveness_endpoint": f"http://0.0.0.0:{args.liveness_port}/healthz" if args.liveness_port else None,
    }


def serve(args: argparse.Namespace) -> int:
    options = kopf_options(args)
    load_client_config()  # first: without a cluster, nothing else matters
    if not args.operator_namespace:
        logger.warning("no --operator-namespace (nor $%s): NetworkPolicies admit only "
                       "spec.networkPolicy.metricsNamespaces to the metrics ports, so autoscaling "
                       "cannot scrape where policies are enforced", OPERATOR_NAMESPACE_ENV)
    kopf.run(memo=kopf.Memo(api=KubeApi(), operator_namespace=args.operator_namespace), **options)
    return 0
