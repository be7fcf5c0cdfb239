"""The tokenizer files of a GGUF (``tokenizer.ggml.*`` metadata) as a ``tokenizer.json`` and its side files.

A ``gpt2`` GGUF tokenizer is byte-level BPE: ``tokenizer.ggml.tokens`` is the vocabulary in id order
(byte-level text, as in ``tokenizer.json``), ``merges`` the BPE merges as "left right" strings,
``token_type`` marks control tokens (3: special added tokens) and user-defined ones (4: added, not
special). ``tokenizer.ggml.pre`` names llama.cpp's pre-tokenizer, which ``PRE_TOKENIZERS`` maps to
the Hugging Face one it was converted from. A ``llama`` GGUF tokenizer is SentencePiece BPE (Llama 2,
Mistral): "▁" marks spaces, ``<0xNN>`` tokens are the byte fallback, and the merges, which such files
often omit, are recovered from ``tokenizer.ggml.scores``.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

from kvferry.common.errors import ModelLoadError

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


def _byte_level_bpe(meta, tokens: list[str]) -> Tokenizer:
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ModelLoadError(f"{meta.path}: tokenizer.ggml.pre is '{pre}'; supported: {', '.join(PRE_TOKENIZERS)}")
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    tok.pre_tokenizer = PRE_TOKENIZERS[pre]()
    if pre in NFC_PRE:
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    return tok


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """SentencePiece BPE merges implied by the vocabulary: every split of a token into two tokens,
    best-scored merged token first (as transformers' ``generate_merges``)."""
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for token, score in zip(tokens, scores):
        local = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        found.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    found.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in found]


def _sentencepiece_bpe(meta, tokens: list[str]) -> Tokenizer:
    """Llama 2 / Mistral style: "▁" for spaces, byte fallback tokens <0xNN>, merges from the scores."""
    scores = list(meta.get("tokenizer.ggml.scores"))
    if meta.has("tokenizer.ggml.merges"):
        merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges")]
    else:
        merges = merges_from_scores(tokens, scores)
    unk = _token(meta, tokens, "unk")
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=True,
                               byte_fallback=True, unk_token=unk))
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first" if prefix else "never",
                                                 split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1, right=0)] if prefix else []))
    return tok


def build_tokenizer(meta) -> Tokenizer:
    """The ``tokenizers`` object of a GGUF's metadata (``meta``: ``kvferry.common.models.gguf.Metadata``)."""
    kind = meta.get("tokenizer.ggml.model")
    builders = {"gpt2": _byte_level_bpe, "llama": _sentencepiece_bpe}
    if kind not in builders:
        raise ModelLoadError(f"{meta.path}: tokenizer.ggml.model is '{kind}'; supported: 'gpt2' (byte-level "
                             "BPE), 'llama' (SentencePiece BPE)")
    tokens = list(meta.get("tokenizer.ggml.tokens"))
    types = list(meta.get("tokenizer.ggml.token_type", [1] * len(tokens)))
    tok = builders[kind](meta, tokens)
    # Added tokens keep their ids: each is already in the vocabulary at its id.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, kind in zip(tokens, types) if kind == CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, kind in zip(tokens, types) if kind == USER_DEFINED])
    bos = meta.get("tokenizer.ggml.bos_token_id", None)
    if add_bos(meta) and bos is not None:
        b = tokens[int(bos)]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{b}:0 $A:0", pair=f"{b}:0 $A:0 {b}:1 $B:1", special_tokens=[(b, int(bos))])
    elif kind == "gpt2":
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    else:
        tok.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
    return tok


def add_bos(meta) -> bool:
    """llama.cpp's default: SentencePiece vocabularies add BOS, byte-level ones do not."""
    return bool(meta.get("tokenizer.ggml.add_bos_token", meta.get("tokenizer.ggml.model") == "llama"))


_ID_KEYS = {"unk": "unknown", "pad": "padding"}  # GGUF's names for these ids


def _token(meta, tokens: list[str], name: str) -> str | None:
    value = meta.get(f"tokenizer.ggml.{_ID_KEYS.get(name, name)}_token_id", None)
    return None if value is None or not 0 <= int(value) < len(tokens) else tokens[int(value)]


def tokenizer_files(meta, max_length: int) -> tuple[str, dict[str, dict]]:
    """(tokenizer.json text, {file name: JSON} for tokenizer_config.json and generation_config.json)."""
    tok = build_tokenizer(meta)
    tokens = list(meta.get("tokenizer.ggml.tokens"))
    config: dict = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": max_length,
                    "add_bos_token": add_bos(meta),
                    "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False))}
    for name in ("bos", "eos", "unk", "pad"):
        text = _token(meta, tokens, name)
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
