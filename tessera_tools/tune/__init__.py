"""``tessera tune``: the engine settings of an InferenceService that give the
most goodput while holding SLOs, found by running the platform on this
machine (`tessera up`) under a serving load (`tessera bench serve`'s)."""

from tessera_tools.tune.cli import add_parser

__all__ = ["add_parser"]
