"""GGUF loading (common/models/gguf.py): a GGUF written here from the tiny checkpoint with the gguf
package's writer (Q/K rows permuted as llama.cpp's converter does) converts back to the same tensors,
config fingerprint, tokens and chat template; transformers' own GGUF reader agrees on the tensors
(an independent check of the Q/K unpermute); a SentencePiece vocabulary tokenizes as transformers'
GGUF tokenizer does; Llama 3.1's rope_freqs read back as llama3 rope scaling; files kvferry cannot
read are refused naming the architecture, the quantization type or the tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

gguf = pytest.importorskip("gguf")

from kvferry.common.errors import ModelLoadError  # noqa: E402
from kvferry.common.models.config import ModelConfig  # noqa: E402
from kvferry.common.models.gguf import cached_folder, convert_gguf  # noqa: E402
from kvferry.common.text.tokenizer import Tokenizer  # noqa: E402
from tests.cluster import tiny_model_dirs  # noqa: E402

HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
TEXTS = ["The capital of France is", "Hello, world! 12345\n\n  tabs\tand ünïcode", "<|eot_id|> x"]


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(name: str) -> str:
    fixed = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    if name in fixed:
        return fixed[name]
    _, _, layer, rest = name.split(".", 3)
    part, kind = rest.rsplit(".", 1)
    return f"blk.{layer}.{HF_TO_GGUF[part]}.{kind}"


def write_tokenizer(w, folder: Path, model: str) -> None:
    tj = json.loads((folder / "tokenizer.json").read_text())
    tc = json.loads((folder / "tokenizer_config.json").read_text())
    vocab = tj["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {t["content"] for t in tj["added_tokens"] if t["special"]}
    w.add_tokenizer_model(model)
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in special else 1 for t in tokens])
    w.add_token_merges([" ".join(m) for m in tj["model"]["merges"]])
    w.add_bos_token_id(vocab[tc["bos_token"]])
    w.add_eos_token_id(vocab[tc["eos_token"]])
    w.add_eot_token_id(vocab["<|end_of_text|>"])
    w.add_add_bos_token(True)
    w.add_chat_template(tc["chat_template"])


def write_gguf(path: Path, folder: Path, *, arch: str = "llama", tokenizer: str = "gpt2", edit=None,
               permuted: bool = True, write_tokens=None) -> Path:
    """The tiny checkpoint ``folder`` as a GGUF at ``path`` (F32 tensors); ``edit(writer)`` may add more."""
    c = json.loads((folder / "config.json").read_text())
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c["num_hidden_layers"])
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(c["hidden_size"])
    w.add_feed_forward_length(c["intermediate_size"])
    w.add_head_count(c["num_attention_heads"])
    w.add_head_count_kv(c["num_key_value_heads"])
    w.add_key_length(c["head_dim"])
    w.add_rope_freq_base(c["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(c["rms_norm_eps"])
    w.add_vocab_size(c["vocab_size"])
    if write_tokens is None:
        write_tokenizer(w, folder, tokenizer)
    else:
        w.add_tokenizer_model(tokenizer)
        write_tokens(w)
    heads = {"q_proj": c["num_attention_heads"], "k_proj": c["num_key_value_heads"]}
    for name, tensor in load_file(str(folder / "model.safetensors")).items():
        values = tensor.float().numpy()
        if permuted and name.split(".")[-2] in heads:
            values = permute(values, heads[name.split(".")[-2]])
        w.add_tensor(gguf_name(name), values)
    if edit is not None:
        edit(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(tiny target folder, its GGUF, the folder converted back)."""
    target = Path(tiny_model_dirs()[0])
    tmp = tmp_path_factory.mktemp("gguf")
    path = write_gguf(tmp / "tiny.gguf", target)
    return target, path, convert_gguf(path, tmp / "converted")


def test_round_trip_gives_the_same_tensors_and_config(tiny_gguf):
    target, _, converted = tiny_gguf
    original, back = load_file(str(target / "model.safetensors")), load_file(str(converted / "model.safetensors"))
    assert sorted(original) == sorted(back)
    for name, tensor in original.items():
        assert torch.equal(back[name], tensor.float()), name
    ours, theirs = ModelConfig.from_dir(converted), ModelConfig.from_dir(target)
    assert ours.fingerprint == theirs.fingerprint
    assert (set(ours.eos_token_ids), ours.bos_token_id, ours.has_tied_embeddings) == \
        (set(theirs.eos_token_ids), theirs.bos_token_id, False)


def test_round_trip_gives_the_same_tokens_and_chat_template(tiny_gguf):
    target, _, converted = tiny_gguf
    ours, theirs = Tokenizer.from_dir(converted), Tokenizer.from_dir(target)
    for text in TEXTS:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text))
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(messages)
    assert (ours.bos_token_id, set(ours.eos_token_ids)) == (theirs.bos_token_id, set(theirs.eos_token_ids))


def test_transformers_gguf_reader_agrees_on_the_tensors(tiny_gguf):
    """transformers undoes llama.cpp's Q/K permutation with its own code: same tensors as ours."""
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    _, path, converted = tiny_gguf
    config = transformers.AutoConfig.for_model(**load_gguf_checkpoint(str(path))["config"])
    with torch.device("meta"):
        skeleton = transformers.AutoModelForCausalLM.from_config(config)
    theirs = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)["tensors"]
    ours = load_file(str(converted / "model.safetensors"))
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight",
                 "model.layers.0.mlp.down_proj.weight", "model.embed_tokens.weight"):
        assert torch.equal(torch.as_tensor(theirs[name]).float(), ours[name]), name


def test_cached_folder_converts_once(tiny_gguf, tmp_path):
    _, path, _ = tiny_gguf
    first = cached_folder(path, "float32", cache_root=tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    again = cached_folder(path, "float32", cache_root=tmp_path)
    assert again == first and first.name == "tiny" and (again / "model.safetensors").stat().st_mtime_ns == stamp
    assert cached_folder(path, "bfloat16", cache_root=tmp_path) != first  # one folder per dtype


def test_unknown_architecture_is_refused_by_name(tmp_path):
    target = Path(tiny_model_dirs()[0])
    path = write_gguf(tmp_path / "m.gguf", target, arch="mamba")
    with pytest.raises(ModelLoadError, match="architecture 'mamba' is not served; supported GGUF architectures: "
                                             "llama, qwen2, qwen3"):
        convert_gguf(path, tmp_path / "out")


def test_unreadable_quantization_type_is_refused_by_name(tmp_path):
    """Q8_1 has no dequantizer in the gguf package: the error names the type and the tensor."""
    target = Path(tiny_model_dirs()[0])
    q8_1 = gguf.GGMLQuantizationType.Q8_1
    raw = np.zeros(4 * 40, dtype=np.uint8)  # 128 values: 4 blocks of 32, 40 bytes each

    def edit(w):
        w.add_tensor("blk.0.attn_q.bias", raw, raw_shape=raw.shape, raw_dtype=q8_1)

    path = write_gguf(tmp_path / "q.gguf", target, edit=edit)
    with pytest.raises(ModelLoadError, match="tensor 'blk.0.attn_q.bias' has quantization type Q8_1"):
        convert_gguf(path, tmp_path / "out")


def test_unknown_tokenizer_and_missing_file_are_refused(tmp_path):
    target = Path(tiny_model_dirs()[0])
    path = write_gguf(tmp_path / "t5.gguf", target, tokenizer="t5")
    with pytest.raises(ModelLoadError, match="tokenizer.ggml.model is"):
        convert_gguf(path, tmp_path / "out")
    with pytest.raises(ModelLoadError, match="file not found"):
        cached_folder(tmp_path / "nope.gguf", "float32", cache_root=tmp_path)


def test_qwen3_gguf_keeps_q_and_k_rows_in_order(tmp_path):
    """llama.cpp permutes Q/K only for llama: a qwen3 file's rows are read as they are, its q/k norms
    land in q_norm/k_norm, and the folder loads as Qwen3."""
    from kvferry.common.models.loader import load_model

    target = Path(tiny_model_dirs()[0])
    layers, head_dim = json.loads((target / "config.json").read_text())["num_hidden_layers"], 32

    def norms(w):
        for i in range(layers):
            for part in ("attn_q_norm", "attn_k_norm"):
                w.add_tensor(f"blk.{i}.{part}.weight", np.full(head_dim, 1.5, dtype=np.float32))

    path = write_gguf(tmp_path / "q3.gguf", target, arch="qwen3", edit=norms, permuted=False)
    back = load_file(str(convert_gguf(path, tmp_path / "out") / "model.safetensors"))
    original = load_file(str(target / "model.safetensors"))
    q = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(back[q], original[q])
    assert torch.equal(back["model.layers.0.self_attn.k_norm.weight"], torch.full((head_dim,), 1.5))
    model = load_model(tmp_path / "out")
    assert model.config.architecture == "Qwen3ForCausalLM" and model.config.has_qk_norm


def test_llama31_rope_freqs_become_llama3_rope_scaling(tmp_path):
    """llama.cpp stores Llama 3.1 rope scaling as per-pair factors (rope_freqs): computed here from
    transformers' formula (common/layers/rope.py), they read back as rope_type llama3, factor 32."""
    from kvferry.common.layers.rope import inv_frequencies

    target = Path(tiny_model_dirs()[0])
    raw = json.loads((target / "config.json").read_text())
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    scaled = ModelConfig.from_dict({**raw, "rope_parameters": {**raw["rope_parameters"], **scaling}})
    plain = ModelConfig.from_dir(target)
    factors = (inv_frequencies(plain) / inv_frequencies(scaled)).numpy().astype(np.float32)
    assert factors.min() == 1.0 and factors.max() == pytest.approx(32.0)  # both ends and a band between
    path = write_gguf(tmp_path / "l31.gguf", target, edit=lambda w: w.add_tensor("rope_freqs.weight", factors))
    back = ModelConfig.from_dir(convert_gguf(path, tmp_path / "out"))
    assert back.rope_scaling == scaled.rope_scaling and back.fingerprint == scaled.fingerprint
    assert torch.allclose(inv_frequencies(back), inv_frequencies(scaled), rtol=1e-6)
    bogus = write_gguf(tmp_path / "bad.gguf", target,
                       edit=lambda w: w.add_tensor("rope_freqs.weight", np.linspace(1, 8, 16, dtype=np.float32)))
    with pytest.raises(ModelLoadError, match="'rope_freqs.weight' is not Llama 3.1 rope scaling"):
        convert_gguf(bogus, tmp_path / "out2")


def spm_gguf(path: Path, target: Path) -> Path:
    """The tiny model with a SentencePiece-style BPE vocabulary (Llama 2's shape: <unk> <s> </s>, the
    256 byte-fallback tokens, then merged pieces with "▁" for spaces; scores rank the merges; no
    merges in the file), trained here on the tiny corpus."""
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    from kvferry.common.models.tiny_corpus import CORPUS

    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    spm = HfTokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    spm.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    spm.train_from_iterator([CORPUS], trainers.BpeTrainer(vocab_size=512, special_tokens=specials, show_progress=False))
    vocab = spm.get_vocab()
    tokens = sorted(vocab, key=vocab.get)
    types = [2 if t == "<unk>" else 3 if t in ("<s>", "</s>") else 6 if t.startswith("<0x") else 1 for t in tokens]

    def tokenizer(w):
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_scores([-float(i) for i in range(len(tokens))])
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
        w.add_add_bos_token(True)

    folder = path.parent / "spm-src"
    folder.mkdir(exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        (folder / name).write_bytes((target / name).read_bytes())
    return write_gguf(path, folder, tokenizer="llama", write_tokens=tokenizer)


def test_sentencepiece_gguf_tokenizes_as_transformers_reads_it(tmp_path):
    """A `llama` (SentencePiece) GGUF tokenizer: ids, byte fallback and decoding as transformers'
    own GGUF tokenizer gives them."""
    transformers = pytest.importorskip("transformers")
    path = spm_gguf(tmp_path / "spm.gguf", Path(tiny_model_dirs()[0]))
    ours = Tokenizer.from_dir(convert_gguf(path, tmp_path / "out"))
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in TEXTS + ["  two leading spaces", "emoji \U0001f600 and \u00e9\u00e8", "line\nbreak"]:
        assert ours.encode(text) == theirs(text).input_ids, text
        ids = ours.encode(text)
        assert ours.decode(ids) == theirs.decode(ids, skip_special_tokens=True), text
    assert ours.encode("x")[0] == 1 and ours.bos_token_id == 1 and ours.eos_token_ids == (2,)
