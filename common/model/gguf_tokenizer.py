"""The tokenizer files of a GGUF (``tokenizer.ggml.*`` metadata) as a ``tokenizer.json`` and its side files.

A ``gpt2`` GGUF tokenizer is byte-level BPE: ``tokenizer.ggml.tokens`` is the vocabulary in id order
(byte-level text, as in ``tokenizer.json``), ``merges`` the BPE merges as "left right" strings,
``token_type`` marks control tokens (3: special added tokens) and user-defined ones (4: added, not
special). ``tokenizer.ggml.pre`` names llama.cpp's pre-tokenizer, which ``PRE_TOKENIZERS`` maps to
the Hugging Face one it was converted from. SentencePiece (``llama``) GGUF tokenizers are refused.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from common.errors import ModelLoadError

CONTROL, USER_DEFINED = 3, 4
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
          r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def _byte_level() -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _split_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(pattern), behavior="isolated"),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


# tokenizer.ggml.pre -> the Hugging Face pre-tokenizer llama.cpp's converter recognised it as.
PRE_TOKENIZERS = {
    "default": _byte_level, "gpt-2": _byte_level,
    "smollm": lambda: pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), _byte_level()]),
    "llama-bpe": lambda: _split_then_bytes(_LLAMA3),
    "qwen2": lambda: _split_then_bytes(_QWEN2),
}
NFC_PRE = ("qwen2",)  # Qwen2's tokenizer.json normalizes to NFC first


def build_tokenizer(meta) -> Tokenizer:
    """The ``tokenizers`` object of a GGUF's metadata (``meta``: ``common.model.gguf.Metadata``)."""
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(f"{meta.path}: tokenizer.ggml.model is '{kind}'; supported: 'gpt2' (byte-level "
                             "BPE); convert a SentencePiece model from its Hugging Face folder instead")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ModelLoadError(f"{meta.path}: tokenizer.ggml.pre is '{pre}'; supported: {', '.join(PRE_TOKENIZERS)}")
    tokens = list(meta.get("tokenizer.ggml.tokens"))
    types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    if pre in NFC_PRE:
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    # Added tokens keep their ids: each is already in the vocabulary at its id.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind in zip(tokens, types) if kind == USER_DEFINED])
    bos = meta.get("tokenizer.ggml.bos_token_id", None)
    if meta.get("tokenizer.ggml.add_bos_token", False) and bos is not None:
        b = tokens[int(bos)]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{b}:0 $A:0", pair=f"{b}:0 $A:0 {b}:1 $B:1", special_tokens=[(b, int(bos))])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def _token(meta, tokens: list[str], name: str) -> str | None:
    value = meta.get(f"tokenizer.ggml.{name}_token_id", None)
    return None if value is None or not 0 <= int(value) < len(tokens) else tokens[int(value)]


def tokenizer_files(meta, max_length: int) -> tuple[str, dict[str, dict]]:
    """(tokenizer.json text, {file name: JSON} for tokenizer_config.json and generation_config.json)."""
    tok = build_tokenizer(meta)
    tokens = list(meta.get("tokenizer.ggml.tokens"))
    config: dict = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
                    "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
                    "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False))}
    for name in ("bos", "eos", "unk", "pad"):
        text = _token(meta, tokens, "padding" if name == "pad" else name)
        if text is not None:
            config[f"{name}_token"] = text
    template = meta.get("tokenizer.chat_template", None)
    if template is not None:
        config["chat_template"] = template
    generation: dict = {}
    bos = meta.get("tokenizer.ggml.bos_token_id", None)
    if bos is not None:
        generation["bos_token_id"] = int(bos)
    eos = [meta.get(f"tokenizer.ggml.{n}_token_id", None) for n in ("eos", "eot")]
    eos_ids = list(dict.fromkeys(int(i) for i in eos if i is not None))
    if eos_ids:
        generation["eos_token_id"] = eos_ids if len(eos_ids) > 1 else eos_ids[0]
    return tok.to_str(), {"tokenizer_config.json": config, "generation_config.json": generation}
