"""The ``kvferry`` command: ``prefill``, ``decode``, ``up``, ``convert-gguf``, ``make-tiny-model``, ``keygen``.

The worker subcommands hand over to ``kvferry.prefill_worker.__main__`` / ``kvferry.decode_worker.__main__`` by
module name, so ``common`` never imports a worker package.
"""

from __future__ import annotations

import argparse
import importlib
import sys

USAGE = """kvferry <command> [options]

commands:
  prefill           run the prefill daemon            (kvferry prefill --help)
  decode            run the decode daemon             (kvferry decode --help)
  up                prefill + decode + sglang-router on loopback (default model: SmolLM2-135M-Instruct)
  convert-gguf      write a GGUF file as a Hugging Face folder (safetensors, tokenizer.json, chat template)
  make-tiny-model   write DIR/target and DIR/draft, small seeded checkpoints with random weights
  keygen            write CURVE key pairs for the bootstrap socket
"""


def _make_tiny_model(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvferry make-tiny-model")
    parser.add_argument("dir", help="output folder; DIR/target and DIR/draft are written")
    parser.add_argument("--seed", type=int, default=0)
    from kvferry.common.models.tiny import make_tiny_model, presets

    parser.add_argument("--preset", default="tiny", choices=list(presets),
                        help=f"one of: {', '.join(presets)} (default tiny; see common/models/tiny.py)")
    args = parser.parse_args(argv)

    paths = make_tiny_model(args.dir, seed=args.seed, preset=args.preset)
    print(f"wrote {paths}")
    return 0


def _convert_gguf(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvferry convert-gguf", description="Dequantize a GGUF file into a "
                                     "Hugging Face checkpoint folder that --model DIR loads")
    parser.add_argument("file", help="the .gguf file (Llama, Mistral, Qwen2, Qwen3; byte-level or SentencePiece BPE)")
    parser.add_argument("dir", help="output folder: config.json, model.safetensors, tokenizer.json, "
                                    "tokenizer_config.json (with the chat template), generation_config.json")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="dtype of the dequantized weights (default float32)")
    args = parser.parse_args(argv)
    from kvferry.common.errors import ModelLoadError
    from kvferry.common.models.gguf import convert_gguf

    try:
        print(f"wrote {convert_gguf(args.file, args.dir, args.dtype)}")
    except ModelLoadError as exc:
        print(f"kvferry convert-gguf: {exc}", file=sys.stderr)
        return 2
    return 0


def _keygen(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kvferry keygen", description="CURVE key pair for the bootstrap socket")
    parser.add_argument("dir", help="output folder")
    parser.add_argument("--name", default="kvferry", help="file name stem: NAME.key (public), NAME.key_secret")
    args = parser.parse_args(argv)
    from kvferry.common.transport.zmq import keygen

    public, secret = keygen(args.dir, args.name)
    print(f"public key: {public}\nsecret key: {secret}")
    return 0


def _up(argv: list[str]) -> int:
    from kvferry.common.up import main as up_main

    return up_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command in ("prefill", "decode"):
        module = importlib.import_module(f"kvferry.{command}_worker.__main__")
        return module.main(rest)
    handlers = {"make-tiny-model": _make_tiny_model, "convert-gguf": _convert_gguf, "keygen": _keygen, "up": _up}
    if command not in handlers:
        print(f"kvferry: unknown command {command!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return handlers[command](rest)


if __name__ == "__main__":
    sys.exit(main())
