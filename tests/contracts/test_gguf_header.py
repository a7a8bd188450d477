"""contracts.gguf_header reads what gguf-py's GGUFReader reads, for the parts the start-up checks use."""

import gguf
import pytest

from contracts.gguf_header import read_header
from tiny_embedding_gguf import tiny_bert_gguf
from tiny_gguf import ARCHS


def assert_same(path) -> None:
    reader, header = gguf.GGUFReader(path), read_header(str(path))
    keys = [key for key in reader.fields if not key.startswith("GGUF.")]  # the reader's own: version and counts
    assert list(header.fields) == keys
    for key in keys:
        expected, got = reader.fields[key].contents(), header.get_field(key).contents()
        assert got == expected and type(got) is type(expected), key
    start = reader.data_offset
    assert [(t.name, t.tensor_type, [int(n) for n in t.shape], int(t.n_elements), int(t.n_bytes),
             int(t.data_offset) - start) for t in reader.tensors] == \
        [(t.name, t.tensor_type, list(t.shape), t.n_elements, t.n_bytes, t.data_offset) for t in header.tensors]
    assert header.get_field("no.such.key") is None


@pytest.mark.parametrize("arch", ARCHS)
def test_every_family_fixture_reads_as_gguf_py_reads_it(tiny_gguf, arch):
    assert_same(tiny_gguf(arch))


def test_an_embedding_fixture_reads_as_gguf_py_reads_it():
    assert_same(tiny_bert_gguf("embed"))


def test_the_embedded_model_reads_as_gguf_py_reads_it(embedded_model_path):
    """49k tokens and 49k merges: string arrays skipped at read, decoded when asked for."""
    assert_same(embedded_model_path)


def test_a_file_that_is_not_gguf_is_refused(tmp_path):
    path = tmp_path / "not.gguf"
    path.write_bytes(b"GGML" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF"):
        read_header(str(path))


def test_a_truncated_file_is_refused(tmp_path, tiny_gguf):
    data = tiny_gguf("llama").read_bytes()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[:len(data) // 2])
    with pytest.raises(ValueError, match="truncated"):
        read_header(str(path))
    with pytest.raises(ValueError):
        gguf.GGUFReader(path)  # as gguf-py refuses it


def test_a_file_cut_inside_its_metadata_is_refused(tmp_path, tiny_gguf):
    path = tmp_path / "cut.gguf"
    path.write_bytes(tiny_gguf("llama").read_bytes()[:200])
    with pytest.raises(ValueError, match="truncated or corrupt GGUF header"):
        read_header(str(path))


def test_a_rewritten_file_is_read_again(tmp_path, tiny_gguf):
    """Kept per (path, size, mtime): the same path with other contents is not answered from the first read."""
    path = tmp_path / "model.gguf"
    path.write_bytes(tiny_gguf("llama").read_bytes())
    assert read_header(str(path)).get_field("general.architecture").contents() == "llama"
    path.write_bytes(tiny_gguf("qwen2").read_bytes())
    assert read_header(str(path)).get_field("general.architecture").contents() == "qwen2"
