"""What a tuning run leaves: the recommended settings as a merge patch
(`kubectl patch inferenceservice NAME --type merge --patch-file
patch.yaml`) and as the whole resource (`kubectl apply -f tuned.yaml`), the
trials as JSON, and goodput against each knob as a plot."""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from tessera_tools.tune.knobs import Knob, with_settings
from tessera_tools.tune.search import Trial


def engine_patch(settings: dict[str, int]) -> dict:
    """The settings as a merge patch of the resource (spec.engine, spec.pools)."""
    return {"spec": with_settings({}, settings)["spec"]}


def trial_record(trial: Trial) -> dict:
    return {"settings": trial.settings, "goodput": trial.goodput, "meets_slos": trial.meets, **trial.detail}


def write_outputs(out: Path, resource: dict, best: Trial, start: Trial, trials: list[Trial], knobs: list[Knob],
                  summary: dict) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    patch, tuned = out / "patch.yaml", out / "tuned.yaml"
    patch.write_text(yaml.safe_dump(engine_patch(best.settings), sort_keys=False))
    tuned.write_text(yaml.safe_dump(with_settings(resource, best.settings), sort_keys=False))
    report = out / "report.json"
    report.write_text(json.dumps({**summary, "best": trial_record(best), "start": trial_record(start),
                                  "trials": [trial_record(t) for t in trials]}, indent=2))
    return [patch, tuned, report, *_plots(out, best, trials, knobs)]


def _plots(out: Path, best: Trial, trials: list[Trial], knobs: list[Knob]) -> list[Path]:
    """Goodput against each knob, the other knobs at their best values."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for knob in knobs:
        others = {k: v for k, v in best.settings.items() if k != knob.name}
        points = sorted((t.settings[knob.name], t.goodput, t.meets) for t in trials
                        if {k: v for k, v in t.settings.items() if k != knob.name} == others)
        fig, ax = plt.subplots(figsize=(5, 3.5))
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o")
        for x, y, meets in points:
            if not meets:
                ax.annotate("misses SLO", (x, y), fontsize=7)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(knob.name)
        ax.set_ylabel("goodput (req/s)")
        ax.set_title(f"goodput vs {knob.name}")
        fig.tight_layout()
        path = out / f"goodput_vs_{knob.name}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths
