"""Each way a GGUF file can be wrong gets its own error through `tessera make-model --from-gguf`:
exit 2, a message naming what is wrong, and nothing left behind (no output folder, no staging)."""

from __future__ import annotations

import re
import struct

import gguf
import numpy as np
import pytest

from tessera_tools.cli import main
from tessera_tools.fixtures.make_gguf import Q, make_gguf


def _truncated(src, dst):
    data = src.read_bytes()
    dst.write_bytes(data[: len(data) * 2 // 3])


def _unknown_type(src, dst):
    # The first tensor's info: name (u64 length + bytes), n_dims (u32), dims (u64 each), type (u32).
    data = bytearray(src.read_bytes())
    name = gguf.GGUFReader(str(src)).tensors[0].name.encode()
    at = data.find(struct.pack("<Q", len(name)) + name) + 8 + len(name)
    n_dims = struct.unpack_from("<I", data, at)[0]
    struct.pack_into("<I", data, at + 4 + 8 * n_dims, 200)
    dst.write_bytes(bytes(data))


def _architecture(name):
    def write(src, dst):
        writer = gguf.GGUFWriter(str(dst), name)
        writer.add_block_count(1)
        writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    return write


def _not_gguf(src, dst):
    dst.write_bytes(b"PK\x03\x04 not a gguf file at all" * 10)


CASES = {
    "truncated": (_truncated, "truncated|not a readable GGUF file"),
    "unknown tensor type": (_unknown_type, "not a readable GGUF file.*200"),
    "unsupported architecture": (_architecture("falcon"), "architecture 'falcon' is not one the engine runs"),
    "not a GGUF file": (_not_gguf, "not a readable GGUF file"),
}


@pytest.fixture(scope="module")
def good(tiny_gguf_base, tmp_path_factory):
    return make_gguf(tiny_gguf_base, tmp_path_factory.mktemp("good") / "good.gguf", Q.Q8_0)


@pytest.fixture(scope="module")
def no_tokenizer(tiny_gguf_base, tmp_path_factory):
    return make_gguf(tiny_gguf_base, tmp_path_factory.mktemp("bare") / "bare.gguf", Q.F16, with_tokenizer=False)


def _run(capsys, file, out):
    code = main(["make-model", "--from-gguf", str(file), str(out)])
    return code, capsys.readouterr().err


def _left_nothing(out):
    assert not out.exists()
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}")] == []


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_file_exits_2_naming_the_problem(case, good, tmp_path, capsys):
    make, pattern = CASES[case]
    bad = tmp_path / "bad.gguf"
    make(good, bad)
    code, err = _run(capsys, bad, tmp_path / "out")
    assert code == 2, err
    assert err.startswith("tessera make-model: error: ") and "Traceback" not in err
    assert str(bad) in err
    assert re.search(pattern, err), err
    _left_nothing(tmp_path / "out")


def test_file_without_tokenizer(no_tokenizer, tmp_path, capsys):
    code, err = _run(capsys, no_tokenizer, tmp_path / "out")
    assert code == 2 and "carries no tokenizer" in err, err
    _left_nothing(tmp_path / "out")


def test_missing_file(tmp_path, capsys):
    code, err = _run(capsys, tmp_path / "nope.gguf", tmp_path / "out")
    assert code == 2 and "no such file" in err, err


def test_good_file_imports_through_the_command(good, tmp_path, capsys):
    code, err = _run(capsys, good, tmp_path / "out")
    assert code == 0, err
    assert (tmp_path / "out" / "model.safetensors").is_file()
