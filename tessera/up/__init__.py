"""`tessera up`: the whole platform on one machine from an InferenceService YAML."""

from tessera.up.runner import add_parser

__all__ = ["add_parser"]
