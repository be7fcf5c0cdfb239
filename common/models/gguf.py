"""A GGUF file (llama.cpp's format) read as a Hugging Face checkpoint folder.

``convert_gguf(file, dir)`` writes what ``--model DIR`` loads: ``config.json`` from the file's
``{arch}.*`` metadata, ``model.safetensors`` with every tensor dequantized (the ``gguf`` package's
numpy dequantizers) to one dtype, and the tokenizer (``common/text/gguf_tokenizer.py``). ``cached_folder``
converts once into ``~/.cache/kvferry/gguf/<key>/<stem>/`` (keyed by the file's path, size, mtime
and the dtype); that is how the daemons and ``kvferry up`` serve ``--model FILE.gguf``.

llama.cpp's converter permutes the Q and K rows of ``llama`` models (its rotary pairs adjacent
dimensions, Hugging Face's the two halves of a head): ``_unpermute`` undoes it. Llama 3.1 rope
scaling travels as a ``rope_freqs`` tensor of factors: ``llama3_scaling`` reads it back. Architectures other
than those of ``ARCHITECTURES``, tensors this model has no place for and quantization types the
``gguf`` package cannot dequantize are refused with a ``ModelLoadError`` naming them.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvferry.common.errors import ModelLoadError
from kvferry.common.text.gguf_tokenizer import tokenizer_files

# general.architecture -> (config.json architectures entry, model_type). Mistral GGUFs say "llama".
ARCHITECTURES = {"llama": ("LlamaForCausalLM", "llama"), "qwen2": ("Qwen2ForCausalLM", "qwen2"),
                 "qwen3": ("Qwen3ForCausalLM", "qwen3")}
PERMUTED_QK = ("llama",)  # llama.cpp permutes Q/K rows only for these
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CONVERTER_VERSION = 2  # part of the cache key: bump when the folder written for a file changes

GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                  "output.weight": "lm_head.weight"}
LAYER_TENSORS = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                 "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                 "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
                 "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                 "ffn_down": "mlp.down_proj"}
ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1 rope scaling, as llama.cpp stores it
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def is_gguf(model: str | Path) -> bool:
    return str(model).lower().endswith(".gguf")


def _reader(path: Path):
    import gguf  # the gguf package (llama.cpp's reader): a dependency, imported only when a GGUF is read

    if not path.is_file():
        raise ModelLoadError(f"{path}: file not found; --model FILE.gguf must name a GGUF file")
    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # the reader raises ValueError/struct.error/OSError on a bad file
        raise ModelLoadError(f"{path}: cannot read as GGUF: {exc}") from exc


class Metadata:
    """Typed access to a GGUF's key/value table; every failure names the file and the key."""

    def __init__(self, reader, path: Path) -> None:
        self.fields, self.path = reader.fields, path

    def get(self, key: str, default: Any = ...) -> Any:
        field = self.fields.get(key)
        if field is None:
            if default is ...:
                raise ModelLoadError(f"{self.path}: metadata key '{key}' is missing")
            return default
        return field.contents()

    def has(self, key: str) -> bool:
        return key in self.fields


def architecture(meta: Metadata) -> str:
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"{meta.path}: architecture '{arch}' is not served; supported GGUF architectures: "
                             f"{', '.join(sorted(ARCHITECTURES))} (Mistral GGUFs say 'llama')")
    return arch


def config_json(meta: Metadata, tensor_names: set[str], dtype: str) -> dict:
    """config.json of the file, from its ``{arch}.*`` keys and which tensors it holds."""
    arch = architecture(meta)
    a = f"{arch}."
    heads = int(meta.get(a + "attention.head_count"))
    kv_heads = meta.get(a + "attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        if len(set(kv_heads)) != 1:
            raise ModelLoadError(f"{meta.path}: {a}attention.head_count_kv differs per layer ({kv_heads}); "
                                 "kvferry serves one KV head count")
        kv_heads = kv_heads[0]
    hidden = int(meta.get(a + "embedding_length"))
    vocab = meta.get(a + "vocab_size", None) or len(meta.get("tokenizer.ggml.tokens"))
    config = {
        "architectures": [ARCHITECTURES[arch][0]], "model_type": ARCHITECTURES[arch][1],
        "vocab_size": int(vocab), "hidden_size": hidden,
        "intermediate_size": int(meta.get(a + "feed_forward_length")),
        "num_hidden_layers": int(meta.get(a + "block_count")),
        "num_attention_heads": heads, "num_key_value_heads": int(kv_heads),
        "head_dim": int(meta.get(a + "attention.key_length", hidden // heads)),
        "rms_norm_eps": float(meta.get(a + "attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(meta.get(a + "rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(meta, a),
        "max_position_embeddings": int(meta.get(a + "context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "attention_bias": arch == "llama" and "blk.0.attn_q.bias" in tensor_names,
        "torch_dtype": dtype,
    }
    bos = meta.get("tokenizer.ggml.bos_token_id", None)
    if bos is not None:
        config["bos_token_id"] = int(bos)
    eos = list(dict.fromkeys(int(meta.get(f"tokenizer.ggml.{n}_token_id")) for n in ("eos", "eot")
                             if meta.has(f"tokenizer.ggml.{n}_token_id")))
    if eos:
        config["eos_token_id"] = eos if len(eos) > 1 else eos[0]
    return config


def _rope_scaling(meta: Metadata, a: str) -> dict | None:
    kind = meta.get(a + "rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(meta.get(a + "rope.scaling.factor"))}
    raise ModelLoadError(f"{meta.path}: {a}rope.scaling.type is '{kind}'; supported: none, linear")


def hf_name(gguf_name: str, path: Path) -> str:
    if gguf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[gguf_name]
    match = _LAYER_NAME.match(gguf_name)
    if match is None or match.group(2) not in LAYER_TENSORS:
        raise ModelLoadError(f"{path}: tensor '{gguf_name}' has no place in a Llama-family model")
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{LAYER_TENSORS[part]}.{kind}"


def llama3_factors(config: dict, factor: float, low: float = 1.0, high: float = 4.0, old_len: int = 8192) -> np.ndarray:
    """The ``rope_freqs`` llama.cpp's converter writes for Llama 3.1 rope scaling (per rotary pair)."""
    dim, base = config["head_dim"], config["rope_theta"]
    freqs = 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    wavelen = 2 * np.pi / freqs
    smooth = (old_len / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old_len / high, 1.0, np.where(wavelen > old_len / low, factor, mid)).astype(np.float32)


def llama3_scaling(reader, meta: Metadata, config: dict) -> dict | None:
    """Llama 3.1 rope scaling recovered from a ``rope_freqs`` tensor: llama.cpp stores only the factors,
    from the Llama 3 defaults (low 1, high 4, original context 8192) and the factor; other factors
    are refused."""
    tensor = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if tensor is None:
        return None
    factors = _dequantize(tensor, meta.path).reshape(-1)
    expected = llama3_factors(config, float(factors.max()))
    if factors.shape != expected.shape or not np.allclose(factors, expected, rtol=1e-5, atol=1e-6):
        raise ModelLoadError(f"{meta.path}: tensor '{ROPE_FREQS}' is not Llama 3.1 rope scaling with "
                             "low_freq_factor 1, high_freq_factor 4 and original context 8192; convert from the "
                             "Hugging Face folder")
    return {"rope_type": "llama3", "factor": float(factors.max()), "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}


def _unpermute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of llama.cpp's ``permute``: reshape(n_head, 2, d/2, ...).swapaxes(1, 2)."""
    half = rows.shape[0] // n_head // 2
    return rows.reshape(n_head, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _dequantize(tensor, path: Path) -> np.ndarray:
    import gguf

    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError:
        readable = ["F32", "F16"] + sorted(t.name for t in gguf.quants._type_traits)
        raise ModelLoadError(f"{path}: tensor '{tensor.name}' has quantization type {tensor.tensor_type.name}, "
                             f"which the gguf package cannot dequantize; readable: {', '.join(readable)}") from None
    shape = tuple(int(n) for n in reversed(tensor.shape))  # GGUF lists the fastest dimension first
    values = values.reshape(shape)
    return values.copy() if not values.flags.writeable else np.ascontiguousarray(values)  # F32: a view of the file


def read_tensors(reader, meta: Metadata, config: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor under its Hugging Face name, dequantized to ``dtype``, Q/K rows unpermuted."""
    permuted = meta.get("general.architecture") in PERMUTED_QK
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    tensors = [t for t in reader.tensors if t.name != ROPE_FREQS]  # read into config.json
    names = [hf_name(t.name, meta.path) for t in tensors]  # refuse before dequantizing anything
    out: dict[str, torch.Tensor] = {}
    for tensor, name in zip(tensors, names):
        values = _dequantize(tensor, meta.path)
        proj = name.split(".")[-2]
        if permuted and proj in heads:
            values = _unpermute(values, heads[proj])
        out[name] = torch.from_numpy(values).to(dtype)
    return out


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, dtype: str = "float32") -> Path:
    """Write ``out_dir`` (config.json, model.safetensors, tokenizer files) from ``gguf_path``."""
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise ModelLoadError(f"dtype is {dtype!r}; supported: {', '.join(DTYPES)}")
    path, out = Path(gguf_path), Path(out_dir)
    reader = _reader(path)
    meta = Metadata(reader, path)
    config = config_json(meta, {t.name for t in reader.tensors}, dtype)
    config["rope_scaling"] = llama3_scaling(reader, meta, config) or config["rope_scaling"]
    tokenizer_json, side_files = tokenizer_files(meta, int(config["max_position_embeddings"]))
    tensors = read_tensors(reader, meta, config, DTYPES[dtype])
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "source": path.name})
    (out / "tokenizer.json").write_text(tokenizer_json)
    for name, content in {"config.json": config, **side_files}.items():
        (out / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n")
    return out


def cache_key(gguf_path: Path, dtype: str) -> str:
    st = gguf_path.stat()
    blob = f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{dtype}|{CONVERTER_VERSION}".encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def cached_folder(gguf_path: str | Path, dtype: str, cache_root: Path | None = None) -> Path:
    """The folder converted from ``gguf_path`` (converted now if not yet): one conversion per file
    and dtype, under a lock so that two daemons starting together convert it once."""
    path = Path(gguf_path).expanduser()
    if not path.is_file():
        raise ModelLoadError(f"{path}: file not found; --model FILE.gguf must name a GGUF file")
    root = (cache_root or Path.home() / ".cache" / "kvferry") / "gguf" / cache_key(path, dtype)
    folder = root / path.stem
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if not (folder / "config.json").is_file():
            partial = root / f".partial-{os.getpid()}"
            shutil.rmtree(partial, ignore_errors=True)
            try:
                convert_gguf(path, partial, dtype)
                shutil.rmtree(folder, ignore_errors=True)
                partial.rename(folder)
            finally:
                shutil.rmtree(partial, ignore_errors=True)
    return folder
