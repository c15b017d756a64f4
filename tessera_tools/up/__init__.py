"""`tessera up`: the whole platform on one machine from an InferenceService YAML."""

from tessera_tools.up.runner import add_parser

__all__ = ["add_parser"]
