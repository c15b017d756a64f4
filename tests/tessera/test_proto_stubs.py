"""The committed stubs in tessera/v1 are what protoc makes of proto/ today."""

from __future__ import annotations

from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parents[2]


def test_generated_stubs_are_current(tmp_path):
    protos = sorted(str(p.relative_to(ROOT / "proto")) for p in (ROOT / "proto").rglob("*.proto"))
    assert protos
    args = ["protoc", f"-I{ROOT / 'proto'}", f"--python_out={tmp_path}", f"--pyi_out={tmp_path}",
            f"--grpc_python_out={tmp_path}", *protos]
    assert protoc.main(args) == 0
    generated = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*") if p.is_file())
    assert generated
    for rel in generated:
        committed = ROOT / rel
        assert committed.is_file(), f"{rel} is not committed; run `make proto`"
        assert committed.read_bytes() == (tmp_path / rel).read_bytes(), f"{rel} is stale; run `make proto`"
