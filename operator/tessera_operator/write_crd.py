"""Write the chart's CRD file from crd.py (crd.crd_yaml): `python -m tessera_operator.write_crd [PATH]`."""

from __future__ import annotations

import sys
from pathlib import Path

from tessera_operator.crd import crd_yaml

CHART_CRD = Path("charts/tessera/crds/inferenceservices.tessera.dev.yaml")


def main(argv: list[str]) -> int:
    path = Path(argv[0]) if argv else CHART_CRD
    path.write_text(crd_yaml(), encoding="utf-8")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
