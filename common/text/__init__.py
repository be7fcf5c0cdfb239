"""Text: the tokenizer (Hugging Face tokenizer.json or a GGUF's vocabulary) and the streaming detokenizer."""
