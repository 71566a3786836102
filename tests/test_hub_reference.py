"""A GGUF on the hub named as Ollama and llama.cpp name one (engine/worker/loading/hub_reference.py):
every form parsed, malformed ones refused; the file of the quantization named chosen from a
repository's files, Q4_K_M when none is named, and a missing one refused naming those there are;
a split model (gguf_split.py) read as one. Resolution runs on huggingface_hub's own functions over
a cache laid out here as huggingface_hub lays it out, with HF_HUB_OFFLINE=1: no network."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter

from engine import LLM, SamplingParams
from engine.worker.loading import model_files, model_loader
from engine.worker.loading.gguf_file import inspect_gguf, open_reader, read_checkpoint
from engine.worker.loading.gguf_folder import gguf_source
from engine.worker.loading.hub_reference import (HubReference, HubReferenceError, choose_gguf, gguf_models,
                                                 hub_gguf_file, parse_hub_reference)
from tests.test_checkpoint import assert_same
from tests.test_gguf_file import tiny_llama_tensors, write_gguf, write_gguf_parts

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.mark.parametrize("text, repo_id, quantization, names_gguf", [
    ("user/repo:Q4_K_M", "user/repo", "Q4_K_M", True),             # llama.cpp's -hf
    ("user/repo:q8_0", "user/repo", "Q8_0", True),                 # the quantization in any case
    ("hf.co/user/repo:Q4_K_M", "user/repo", "Q4_K_M", True),       # Ollama's
    ("hf.co/user/repo", "user/repo", None, True),
    ("hf.co/user/repo:latest", "user/repo", None, True),           # Ollama's tag for its default
    ("HF.co/Org-1/Model.v2_GGUF:IQ4_XS", "Org-1/Model.v2_GGUF", "IQ4_XS", True),
    ("huggingface.co/user/repo:UD-Q4_K_XL", "user/repo", "UD-Q4_K_XL", True),
    ("https://huggingface.co/user/repo", "user/repo", None, True),
    ("https://huggingface.co/user/repo/", "user/repo", None, True),
    ("https://hf.co/user/repo:Q6_K", "user/repo", "Q6_K", True),
    ("user/repo", "user/repo", None, False),                       # or a transformers hub id
])
def test_every_form_parses(text, repo_id, quantization, names_gguf):
    assert parse_hub_reference(text) == HubReference(repo_id, quantization, names_gguf)
    assert model_files.is_gguf_path(text) == names_gguf  # a bare id is a GGUF only if its files say so


@pytest.mark.parametrize("text", ["SmolLM2-135M-Instruct", "/models/llama", "./models/llama", "model.gguf",
                                  "a/b/c", "C:/models/llama", "https://example.com/user/repo"])
def test_other_names_are_not_hub_references(text):
    assert parse_hub_reference(text) is None


@pytest.mark.parametrize("text", ["hf.co/user", "hf.co/user/repo/blob/main/model.gguf", "user/repo:",
                                  "user/repo:Q4:K", "https://huggingface.co/user/repo/tree/main", "hf.co/-user/repo"])
def test_malformed_references_are_refused_naming_the_forms(text):
    with pytest.raises(HubReferenceError, match=r"not a hub reference to a GGUF model: write user/repo:QUANT"):
        parse_hub_reference(text)


LISTING = [".gitattributes", "README.md", "smollm2-135m-instruct-q4_k_m.gguf", "Model.Q8_0.gguf",
           "model_Q4_K_S.gguf", "mmproj-model-f16.gguf", "Q6_K/big-Q6_K-00001-of-00002.gguf",
           "Q6_K/big-Q6_K-00002-of-00002.gguf"]


@pytest.mark.parametrize("quantization, files", [
    ("Q4_K_M", ["smollm2-135m-instruct-q4_k_m.gguf"]),
    (None, ["smollm2-135m-instruct-q4_k_m.gguf"]),      # the default
    ("Q8_0", ["Model.Q8_0.gguf"]),
    ("Q4_K_S", ["model_Q4_K_S.gguf"]),
    ("Q6_K", ["Q6_K/big-Q6_K-00001-of-00002.gguf", "Q6_K/big-Q6_K-00002-of-00002.gguf"]),  # every part
])
def test_the_file_named_by_its_quantization_is_chosen(quantization, files):
    assert choose_gguf(gguf_models(LISTING), quantization, "user/repo") == files


def test_a_missing_quantization_is_refused_naming_those_there_are():
    assert "mmproj-model-f16.gguf" not in gguf_models(LISTING)  # a vision projector is no model of its own
    with pytest.raises(HubReferenceError, match=r"^no Q5_K_M file in user/repo; it has: Q4_K_M, Q4_K_S, Q6_K, Q8_0$"):
        choose_gguf(gguf_models(LISTING), "Q5_K_M", "user/repo")
    with pytest.raises(HubReferenceError, match=r"^no Q4_K file in user/repo"):  # Q4_K_M is not Q4_K
        choose_gguf(gguf_models(LISTING), "Q4_K", "user/repo")
    with pytest.raises(HubReferenceError, match=r"no Q4_K_M file \(the default when none is named\) in user/repo; "
                                                r"it has: F16, Q8_0"):
        choose_gguf(gguf_models(["m-Q8_0.gguf", "m-F16.gguf"]), None, "user/repo")
    assert choose_gguf(gguf_models(["m-Q8_0.gguf"]), None, "user/repo") == ["m-Q8_0.gguf"]  # the only one
    with pytest.raises(HubReferenceError, match=r"^user/repo has no GGUF file$"):
        choose_gguf(gguf_models(["config.json", "model.safetensors"]), None, "user/repo")


# --- huggingface_hub's cache, laid out as it lays it out, offline ---------------------------------

def cache_repo(cache: Path, repo_id: str, files: dict[str, Path | bytes]) -> Path:
    """`files` (repository path -> content, or a file moved in) as huggingface_hub stores a download
    of `repo_id` at `main`: blobs/<sha256>, snapshots/<commit>/<path> linking to it, refs/main
    holding the commit. Returns the snapshot folder."""
    storage = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = storage / "snapshots" / COMMIT
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        staged = storage / "blobs" / "incoming"
        if isinstance(content, Path):
            content.rename(staged)
        else:
            staged.write_bytes(content)
        with open(staged, "rb") as file:
            blob = staged.with_name(hashlib.file_digest(file, "sha256").hexdigest())
        staged.rename(blob)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (storage / "refs").mkdir(exist_ok=True)
    (storage / "refs" / "main").write_text(COMMIT)
    return snapshot


def write_tiny_model(path: Path, hf_model, vocabulary_from: str, split_max_tensors: int = 0) -> list[Path]:
    """The tiny Llama as a whole GGUF model (split as llama.cpp's gguf-split splits, at
    `split_max_tensors` a part): llama hyperparameters, `vocabulary_from`'s tokenizer, every
    tensor in F32, and its tied head written out as `output.weight`, last (a split model's head in
    its last part). Returns its files."""
    config = hf_model.config

    def metadata(writer: GGUFWriter) -> None:
        writer.add_name("tiny")
        writer.add_context_length(config.max_position_embeddings)
        writer.add_embedding_length(config.hidden_size)
        writer.add_block_count(config.num_hidden_layers)
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count(config.num_attention_heads)
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_rope_freq_base(float(getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]))
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
        writer.add_vocab_size(config.vocab_size)
        for key, field in open_reader(vocabulary_from).fields.items():  # the engine's reader: gguf's takes seconds
            if key.startswith("tokenizer."):
                array = field.types[0] == GGUFValueType.ARRAY
                writer.add_key_value(key, field.contents(), field.types[0], sub_type=field.types[-1] if array else None)

    tensors = tiny_llama_tensors(hf_model, GGMLQuantizationType.F32, encode=lambda weights: weights)
    head = hf_model.state_dict()["model.embed_tokens.weight"].detach().float().numpy().copy()
    tensors.append(("output.weight", head, GGMLQuantizationType.F32))
    return write_gguf_parts(path, "llama", tensors, 0, split_max_tensors, metadata)


@pytest.fixture(scope="module")
def hub(tmp_path_factory, tiny_hf, embedded_gguf):
    """huggingface_hub's cache (HF_HUB_CACHE) holding: user/tiny-GGUF (the tiny model split in
    three F32 parts, a Q8_0 file, a vision projector), user/only-GGUF (one Q4_K_M file),
    user/tiny (a transformers model), user/no-GGUF (a README), user/half-GGUF (two parts of three
    of a split model); offline (HF_HUB_OFFLINE=1), and the
    engine's cache private to this module."""
    from huggingface_hub import constants

    root = tmp_path_factory.mktemp("hub")
    cache, staging = root / "hub", root / "staging"
    staging.mkdir()
    parts = write_tiny_model(staging / "tiny-F32.gguf", tiny_hf, embedded_gguf, split_max_tensors=8)
    assert [p.name for p in parts] == [f"tiny-F32-0000{i}-of-00003.gguf" for i in (1, 2, 3)]
    q8 = write_gguf(staging / "tiny-Q8_0.gguf", "llama", tiny_llama_tensors(tiny_hf)[:2], file_type=7)
    cache_repo(cache, "user/tiny-GGUF", {"README.md": b"# tiny\n", **{f"F32/{p.name}": p for p in parts},
                                         "tiny-Q8_0.gguf": Path(q8), "mmproj-tiny-f16.gguf": b"GGUF"})
    only = write_gguf(staging / "only.Q4_K_M.gguf", "llama", tiny_llama_tensors(tiny_hf)[:2], file_type=15)
    cache_repo(cache, "user/only-GGUF", {"only.Q4_K_M.gguf": Path(only)})
    cache_repo(cache, "user/tiny", {"config.json": b"{}", "model.safetensors": b"\0", "tiny-Q8_0.gguf": b"GGUF"})
    cache_repo(cache, "user/no-GGUF", {"README.md": b"# nothing\n"})
    cache_repo(cache, "user/half-GGUF", {f"half-Q8_0-0000{i}-of-00003.gguf": b"GGUF%d" % i for i in (1, 2)})
    with pytest.MonkeyPatch.context() as patch:
        # huggingface_hub reads both when imported: its module's values too, for this process
        for name, value in (("HF_HUB_OFFLINE", True), ("HF_HUB_CACHE", str(cache))):
            patch.setenv(name, "1" if value is True else value)
            patch.setattr(constants, name, value)
        patch.setenv("PAGEDCHAT_CACHE", str(root / "pagedchat"))
        yield cache.resolve()  # as huggingface_hub names the files it hands back


def snapshot_file(cache: Path, repo_id: str, path: str) -> str:
    return str(cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / COMMIT / path)


def test_references_resolve_from_the_cache_offline(hub):
    first = snapshot_file(hub, "user/tiny-GGUF", "F32/tiny-F32-00001-of-00003.gguf")
    for text in ("user/tiny-GGUF:F32", "hf.co/user/tiny-GGUF:f32", "https://huggingface.co/user/tiny-GGUF:F32"):
        assert hub_gguf_file(text) == first
    assert hub_gguf_file("user/tiny-GGUF:Q8_0") == snapshot_file(hub, "user/tiny-GGUF", "tiny-Q8_0.gguf")
    # user/repo alone: Q4_K_M, only where the repository holds GGUF files and no transformers model
    assert hub_gguf_file("user/only-GGUF") == snapshot_file(hub, "user/only-GGUF", "only.Q4_K_M.gguf")
    assert hub_gguf_file("user/tiny") is None and model_files.resolve_model("user/tiny") == "user/tiny"
    assert model_files.resolve_model("user/not-cached") == "user/not-cached"  # a hub id: transformers' to load
    assert hub_gguf_file("user/tiny:Q8_0") == snapshot_file(hub, "user/tiny", "tiny-Q8_0.gguf")  # named: the GGUF


def test_a_cached_transformers_model_asks_the_hub_nothing(hub, monkeypatch):
    """Online, a bare `user/repo` the cache holds as a transformers model is one without a listing
    (against a hub where nothing listens, a listing retries for ~20 s before the cache is read)."""
    import time

    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    start = time.monotonic()
    assert model_files.resolve_model("user/tiny") == "user/tiny"
    assert time.monotonic() - start < 5


def test_what_a_repository_lacks_is_refused_naming_what_it_has(hub):
    with pytest.raises(HubReferenceError, match=r"^no Q5_K_M file in user/tiny-GGUF \(the files cached in .*: offline "
                                                r"\(HF_HUB_OFFLINE is set\)\); it has: F32, Q8_0$"):
        model_files.resolve_model("user/tiny-GGUF:Q5_K_M")
    with pytest.raises(HubReferenceError, match=r"no Q4_K_M file \(the default when none is named\) in user/tiny-GGUF"):
        model_files.resolve_model("hf.co/user/tiny-GGUF")
    with pytest.raises(HubReferenceError, match=r"^user/no-GGUF \(.*\) has no GGUF file$"):
        model_files.resolve_model("hf.co/user/no-GGUF")
    with pytest.raises(HubReferenceError, match=r"^half-Q8_0-00001-of-00003.gguf is the first of 3 parts of a split "
                                                r"GGUF model, and user/half-GGUF \(.*\) lacks "
                                                r"half-Q8_0-00003-of-00003.gguf$"):
        model_files.resolve_model("user/half-GGUF:Q8_0")
    with pytest.raises(HubReferenceError, match=r"cannot find user/not-cached:Q4_K_M: offline \(HF_HUB_OFFLINE is "
                                                r"set\), and huggingface_hub's cache .* holds no snapshot of "
                                                r"user/not-cached"):
        model_files.resolve_model("hf.co/user/not-cached")


def test_a_split_model_reads_as_one(tmp_path, tiny_hf):
    """gguf-py's writer splits the tiny model as gguf-split does (the split keys, metadata in the
    first part only); its parts read as the unsplit file does."""
    tensors = tiny_llama_tensors(tiny_hf)
    whole = write_gguf(tmp_path / "whole.gguf", "llama", tensors, file_type=7)
    parts = write_gguf_parts(tmp_path / "tiny.gguf", "llama", tensors, file_type=7, split_max_tensors=7)
    assert len(parts) == 3
    last = GGUFReader(parts[-1]).fields
    assert "general.architecture" not in last
    assert (last["split.no"].contents(), last["split.count"].contents(), last["split.tensors.count"].contents()) == \
        (2, 3, len(tensors))

    info, unsplit = inspect_gguf(parts[0]), inspect_gguf(whole)
    assert (info.architecture, info.file_type, info.num_parameters) == \
        (unsplit.architecture, unsplit.file_type, unsplit.num_parameters)
    assert info.size_bytes == sum(p.stat().st_size for p in parts)
    config = tiny_hf.config.to_dict()
    assert_same(read_checkpoint(parts[0], config, torch.float32), read_checkpoint(whole, config, torch.float32))

    with pytest.raises(ValueError, match=r"tiny-00002-of-00003.gguf is part 2 of 3 .*: name its first part, "
                                         r"tiny-00001-of-00003.gguf"):
        inspect_gguf(parts[1])
    parts[2].rename(tmp_path / "elsewhere.gguf")
    with pytest.raises(FileNotFoundError, match=r"first of 3 parts .*; missing beside it: tiny-00003-of-00003.gguf"):
        inspect_gguf(parts[0])
    renamed = tmp_path / "renamed.gguf"
    parts[0].rename(renamed)
    with pytest.raises(ValueError, match=r"renamed.gguf is part 1 of a GGUF model split in 3 files, but its name"):
        inspect_gguf(renamed)


def test_a_split_hub_model_loads_and_the_engine_serves_it(hub, tiny_hf, tiny_model_dir, monkeypatch):
    """user/tiny-GGUF:F32 (three parts, its head in the last) as $MODEL: downloaded from the cache,
    its config read from the first part with the head untied (transformers sees the first part's
    tensors only), every part's weights loaded; the engine's greedy reply is the tiny folder's."""
    folder = model_files.resolve_model("hf.co/user/tiny-GGUF:F32")
    first = snapshot_file(hub, "user/tiny-GGUF", "F32/tiny-F32-00001-of-00003.gguf")
    assert gguf_source(folder)["path"] == first  # the name in the repository, not its blob's
    # a server's front end resolves it again (the same environment) without loading torch
    script = ("import sys; from engine.worker.loading.model_files import resolve_model; "
              "print(resolve_model('hf.co/user/tiny-GGUF:F32'), 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.stdout.split() == [folder, "False"]
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(folder)
    assert config.tie_word_embeddings is False and config.num_hidden_layers == tiny_hf.config.num_hidden_layers
    checkpoint = model_loader.load_checkpoint("user/tiny-GGUF:F32", torch.float32)
    assert not checkpoint.tied and torch.equal(checkpoint.parameters["lm_head.weight"],
                                               tiny_hf.state_dict()["model.embed_tokens.weight"])

    monkeypatch.setenv("MODEL", "user/tiny-GGUF:F32")
    ids = model_loader.load_tokenizer(tiny_model_dir).encode("The paged cache holds")
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    ours = LLM(dtype="float32", num_gpu_blocks=64, num_cpu_blocks=8).generate([ids], greedy)[0].outputs[0].token_ids
    theirs = LLM(tiny_model_dir, dtype="float32", num_gpu_blocks=64, num_cpu_blocks=8).generate([ids], greedy)
    assert ours == theirs[0].outputs[0].token_ids and len(ours) == 8
