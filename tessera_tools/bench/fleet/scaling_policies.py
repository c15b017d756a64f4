"""The autoscale scenario's pools and their ScalingPolicy from the flags,
over the CRD's per-pool defaults (crd_engine.autoscaling_schema): one mixed
pool (--min-replicas ... --scale-target), or with --disaggregated a prefill
and a decode pool (--prefill-*, --decode-*), each on a signal the CRD allows
that pool. A flag of the mode not chosen is refused when set off its
default, so a run never ignores what it was told."""

from __future__ import annotations

import argparse

from tessera_operator.autoscale import TARGET_FIELDS, ScalingPolicy
from tessera_operator.crd_engine import autoscaling_schema
from tessera_tools.bench.fleet import MIXED_FLAG_DEFAULTS, PD_FLAG_DEFAULTS, PD_ROLES

# The fields of one pool's flags, as the mixed pool's are named (--min-replicas; --prefill-min-replicas).
POOL_FIELDS = ("min_replicas", "max_replicas", "scale_signal", "scale_target")


def _flag(role: str, field: str) -> str:
    prefix = "" if role == "mixed" else f"{role}-"
    return f"--{prefix}{field.replace('_', '-')}"


def _value(args: argparse.Namespace, role: str, field: str):
    return getattr(args, field if role == "mixed" else f"{role}_{field}")


def pool_policy(args: argparse.Namespace, role: str) -> ScalingPolicy:
    """One pool's policy: its flags over the CRD's defaults for that pool (signal, its target, tolerance,
    step limits, the scale-down step unless --max-scale-down-step); ValueError naming the flag when the
    CRD does not allow the signal for the pool."""
    low, high = _value(args, role, "min_replicas"), _value(args, role, "max_replicas")
    if low > high:
        raise ValueError(f"{_flag(role, 'min_replicas')} {low} exceeds {_flag(role, 'max_replicas')} {high}")
    crd = autoscaling_schema()["properties"][role]["properties"]
    signal = _value(args, role, "scale_signal") or crd["signal"]["default"]
    allowed = crd["signal"]["enum"]
    if signal not in allowed:
        raise ValueError(f"{_flag(role, 'scale_signal')} {signal}: a {role} pool scales on {', '.join(allowed)} "
                         f"(the CRD's autoscaling.{role}.signal)")
    target = _value(args, role, "scale_target")
    target = target if target is not None else crd[TARGET_FIELDS[signal]]["default"]
    return ScalingPolicy(signal=signal, target=float(target), min_replicas=low, max_replicas=high,
                         tolerance=crd["tolerance"]["default"], up_window_s=args.scale_up_window,
                         down_window_s=args.scale_down_window, max_up_step=crd["maxScaleUpStep"]["default"],
                         max_down_step=args.max_scale_down_step or crd["maxScaleDownStep"]["default"],
                         down_stabilization=args.scale_down_stabilization or crd["scaleDownStabilization"]["default"])


def scaling_policy(args: argparse.Namespace) -> ScalingPolicy:
    """The mixed pool's."""
    return pool_policy(args, "mixed")


def _set_off_default(args: argparse.Namespace, roles: tuple[str, ...], defaults: dict) -> list[str]:
    return [_flag(role, f) for role in roles for f in POOL_FIELDS if _value(args, role, f) != defaults[f]]


def pool_policies(args: argparse.Namespace) -> dict[str, ScalingPolicy]:
    """{role: policy} of the fleet's pools, in the order the report lists them. ValueError on a flag
    that does not apply to the mode (a mixed pool's under --disaggregated, a P/D pool's without)."""
    if args.disaggregated:
        roles, unused, why = PD_ROLES, _set_off_default(args, ("mixed",), MIXED_FLAG_DEFAULTS), "--disaggregated"
    else:
        roles, unused, why = ("mixed",), _set_off_default(args, PD_ROLES, PD_FLAG_DEFAULTS), "a mixed pool"
    if unused:
        raise ValueError(f"{', '.join(unused)}: not used with {why} (--disaggregated takes --prefill-* and "
                         "--decode-*, a mixed pool --min-replicas, --max-replicas, --scale-signal, --scale-target)")
    return {role: pool_policy(args, role) for role in roles}
