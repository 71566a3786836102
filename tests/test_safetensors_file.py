"""A safetensors file read tensor by tensor into memory of the engine's own, not a mapping of
the file: the same tensors as the safetensors library's, and a clear error for a damaged file."""
import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.worker.loading.safetensors_file import SafetensorsError, read_tensors


@pytest.fixture
def saved(tmp_path):
    torch.manual_seed(0)
    tensors = {"a.weight": torch.randn(7, 5), "b.weight": torch.randn(3, 4).to(torch.bfloat16),
               "c.weight": torch.randn(6).half(), "ids": torch.arange(5), "mask": torch.tensor([True, False]),
               "empty": torch.zeros(0, 3)}
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


def test_the_tensors_are_the_librarys_and_own_their_memory(saved):
    ours, theirs = read_tensors(saved), load_file(str(saved))
    assert ours.keys() == theirs.keys()
    for name, tensor in theirs.items():
        assert ours[name].dtype == tensor.dtype and torch.equal(ours[name], tensor)
        # no two tensors share memory, and none is a view of anything bigger
        assert ours[name].untyped_storage().nbytes() == ours[name].nbytes
    pointers = [t.data_ptr() for t in ours.values() if t.nbytes]
    assert len(set(pointers)) == len(pointers)


def test_floating_point_tensors_are_converted_and_the_rest_kept(saved):
    ours = read_tensors(saved, torch.float32)
    theirs = load_file(str(saved))
    assert ours["b.weight"].dtype == ours["c.weight"].dtype == torch.float32
    assert torch.equal(ours["b.weight"], theirs["b.weight"].float())
    assert ours["ids"].dtype == torch.int64 and ours["mask"].dtype == torch.bool


def test_a_damaged_file_is_refused_naming_what_is_wrong(saved, tmp_path):
    data = saved.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[:-8])
    with pytest.raises(SafetensorsError, match="ends inside tensor"):
        read_tensors(cut)
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    header["a.weight"]["dtype"] = "F8_E4M3X"
    odd = json.dumps(header).encode()
    (tmp_path / "odd.safetensors").write_bytes(struct.pack("<Q", len(odd)) + odd + data[8 + length:])
    with pytest.raises(SafetensorsError, match="a.weight has dtype F8_E4M3X"):
        read_tensors(tmp_path / "odd.safetensors")
    header["a.weight"].update(dtype="F32", shape=[7, 6])
    wrong = json.dumps(header).encode()
    (tmp_path / "wrong.safetensors").write_bytes(struct.pack("<Q", len(wrong)) + wrong + data[8 + length:])
    with pytest.raises(SafetensorsError, match=r"a.weight spans 140 bytes, its shape \[7, 6\] in F32 168"):
        read_tensors(tmp_path / "wrong.safetensors")
