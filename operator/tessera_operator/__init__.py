"""Tessera's Kubernetes operator: the InferenceService CRD, reconcile, autoscaling, kopf handlers.

The folder is operator/ but the import name is tessera_operator: `operator`
would shadow the standard library module.
"""

from tessera_operator.validation import InvalidInferenceService, validate_inference_service

__all__ = ["InvalidInferenceService", "validate_inference_service"]
