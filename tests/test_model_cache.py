"""What slimkv keeps from a model file between processes (slimkv/model_io/model_cache.py):
the GGUF's metadata and tensor table, and its tokenizer's conversion. A later load reads the
cache instead of parsing the file, and gets what parsing gives; an entry that would differ,
or an unwritable cache, only means parsing again."""

from __future__ import annotations

import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

import slimkv.model_io.model_cache as model_cache
import slimkv.model_io.tokenizer as tokenizer_module
from slimkv.loadtest.workloads import corpus
from slimkv.model_io import default_model_path
from slimkv.model_io.loader import _fused_weights, _read_gguf
from slimkv.model_io.model_cache import CACHE_DIR_ENV, cache_path, read_gguf
from slimkv.model_io.tokenizer import Tokenizer, cache_folder, same_answers

pytestmark = pytest.mark.slow
TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two numbers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}}]


@pytest.fixture
def conversions(monkeypatch) -> list[str]:
    """The GGUF files converted (AutoTokenizer called with ``gguf_file``) from now on."""
    calls: list[str] = []
    load = transformers.AutoTokenizer.from_pretrained

    def spy(path, *args, **kwargs):
        if "gguf_file" in kwargs:
            calls.append(kwargs["gguf_file"])
        return load(path, *args, **kwargs)

    monkeypatch.setattr(tokenizer_module.AutoTokenizer, "from_pretrained", spy)
    return calls


def test_the_second_load_reads_the_folder_and_answers_as_the_conversion(
        tmp_path: Path, monkeypatch, conversions: list[str]) -> None:
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    path = default_model_path()
    converted = Tokenizer.from_gguf(path)
    assert conversions == [os.path.basename(path)]
    assert sorted(os.listdir(cache_folder(path))) == ["chat_template.jinja", "tokenizer.json",
                                                      "tokenizer_config.json"]
    cached = Tokenizer.from_gguf(path)
    assert conversions == [os.path.basename(path)]          # no second conversion
    assert cached.name == converted.name == "SmolLM2-135M-Instruct"
    assert same_answers(converted, cached)
    text = corpus()[:20000]
    assert cached.encode(text) == converted.encode(text)
    chat = [{"role": "user", "content": "What is 2 + 2?"}]
    assert cached.apply_chat_template(chat, TOOLS) == converted.apply_chat_template(chat, TOOLS)
    assert cached.tool_format == converted.tool_format


def test_the_key_follows_the_file_and_the_folder_setting(tmp_path: Path, monkeypatch) -> None:
    gguf = tmp_path / "model.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "cache"))
    first = cache_folder(str(gguf))
    assert first.parent == tmp_path / "cache" and first.name.startswith("model.Q4_1-")
    assert first.suffix == ".tokenizer"
    os.utime(gguf, ns=(1, 1))                               # a rewritten file: a new key
    assert cache_folder(str(gguf)) != first
    monkeypatch.delenv(CACHE_DIR_ENV)
    assert cache_folder(str(gguf)).parent == Path.home() / ".cache/slimkv/models"


def test_a_folder_answering_otherwise_is_not_kept(tmp_path: Path, monkeypatch,
                                                  conversions: list[str]) -> None:
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    path = default_model_path()
    good = Tokenizer.from_gguf(path)
    changed = Tokenizer(transformers.AutoTokenizer.from_pretrained(cache_folder(path)), "x")
    assert same_answers(good, changed)
    changed.hf.chat_template = good.hf.chat_template + " "
    assert not same_answers(good, changed)
    for name in os.listdir(cache_folder(path)):
        os.remove(cache_folder(path) / name)
    os.rmdir(cache_folder(path))
    monkeypatch.setattr(tokenizer_module, "same_answers", lambda a, b: False)
    assert same_answers(Tokenizer.from_gguf(path), good)    # the conversion itself, served
    assert not cache_folder(path).exists() and os.listdir(tmp_path) == []
    assert len(conversions) == 2


def test_an_unwritable_cache_still_loads(tmp_path: Path, monkeypatch) -> None:
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "a-file" / "cache"))
    tokenizer = Tokenizer.from_gguf(default_model_path())
    assert tokenizer.decode(tokenizer.encode("The capital of France")) == "The capital of France"
    assert (tmp_path / "a-file").read_text() == ""


@pytest.fixture
def readers(monkeypatch) -> list[str]:
    """The files GGUFReader parses from now on."""
    calls: list[str] = []
    reader = gguf.GGUFReader

    def spy(path, *args, **kwargs):
        calls.append(path)
        return reader(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", spy)
    return calls


def test_the_gguf_index_maps_what_the_reader_parses(tmp_path: Path, monkeypatch,
                                                     readers: list[str]) -> None:
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    path = default_model_path()
    parsed_meta, parsed = read_gguf(path)
    [index] = tmp_path.glob("*.gguf.json")
    mapped_meta, mapped = read_gguf(path)
    assert readers == [path]                                # the second read: the index
    reader = gguf.GGUFReader(path)                          # the library's own answer
    scalars = {k: f.contents() for k, f in reader.fields.items()
               if f.types[0] != gguf.GGUFValueType.ARRAY}
    assert parsed_meta == mapped_meta == scalars and mapped_meta["llama.block_count"] == 30
    assert len(mapped) == len(reader.tensors) == 272
    for a, b in zip(mapped, reader.tensors):
        assert (a.name, a.type, a.data.dtype, a.data.shape) == (
            b.name, b.tensor_type, b.data.dtype, b.data.shape)
        assert np.array_equal(a.data, b.data), a.name
    # The engine's weights through either path, bit for bit.
    args_a, get_a = _read_gguf(path)
    index.unlink()
    args_b, get_b = _read_gguf(path)
    assert args_a == args_b
    fused_a, fused_b = _fused_weights(args_a, get_a), _fused_weights(args_b, get_b)
    assert fused_a.keys() == fused_b.keys()
    assert all(torch.equal(fused_a[k], fused_b[k]) for k in fused_a)


def test_an_index_that_maps_otherwise_is_not_kept(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    mapped = model_cache._mapped

    def shifted(path, rows, types):
        return mapped(path, [{**row, "offset": row["offset"] - 4} for row in rows], types)

    monkeypatch.setattr(model_cache, "_mapped", shifted)
    meta, tensors = read_gguf(default_model_path())
    assert meta["general.architecture"] == "llama" and len(tensors) == 272
    assert os.listdir(tmp_path) == []
    assert not cache_path(default_model_path(), "gguf.json", gguf_version()).exists()


def gguf_version() -> str:
    import importlib.metadata

    return importlib.metadata.version("gguf")
