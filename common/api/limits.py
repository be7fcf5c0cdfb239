"""What one HTTP request may cost before any model work: the body's size, and a prompt's length
checked before it is tokenized.

`--max-request-bytes` bounds the body: a `Content-Length` over it is answered 413 before the body
is read, and a chunked body is cut off (413) as soon as the bytes read pass it. A text prompt too
long to fit the context whatever it tokenizes to is refused (400) without tokenizing it: a token
decodes to at most `max_token_bytes` bytes of text, so a prompt of more than
`PROMPT_CHARS_PER_TOKEN_BYTE * max_token_bytes * max_context_tokens` characters has more tokens
than the context holds (the factor leaves room for normalizers that shorten text, e.g. NFKC).
"""

from __future__ import annotations

from starlette.requests import Request

from kvferry.common.api.backend import TokenizerLike
from kvferry.common.api.schema import FieldError

DEFAULT_MAX_REQUEST_BYTES = 32 * 2**20
PROMPT_CHARS_PER_TOKEN_BYTE = 4


class RequestTooLargeError(FieldError):
    """The request body is larger than `--max-request-bytes` (HTTP 413)."""

    http_status = 413

    def __init__(self, message: str) -> None:
        super().__init__(None, message)


def _too_large(size_text: str, max_bytes: int) -> RequestTooLargeError:
    return RequestTooLargeError(f"the request body has {size_text} bytes; this server accepts at most "
                                f"{max_bytes} (--max-request-bytes); send a shorter request")


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The whole body, or RequestTooLargeError once it is known to pass `max_bytes`."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise _too_large(declared, max_bytes)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(f"more than {max_bytes}", max_bytes)
        chunks.append(chunk)
    return b"".join(chunks)


def max_token_bytes(tokenizer: TokenizerLike, vocab_size: int | None) -> int | None:
    """The most UTF-8 bytes any one token decodes to (special tokens included: a prompt may spell
    them), or None when the vocabulary cannot be walked."""
    if not vocab_size:
        return None
    longest = 0
    for token_id in range(vocab_size):
        longest = max(longest, len(tokenizer.decode([token_id], skip_special_tokens=False).encode()))
    return longest or None


def max_prompt_chars(tokenizer: TokenizerLike, vocab_size: int | None, max_context_tokens: int) -> int | None:
    """Characters beyond which a text prompt cannot fit `max_context_tokens` (None: no bound)."""
    longest = max_token_bytes(tokenizer, vocab_size)
    if longest is None:
        return None
    return PROMPT_CHARS_PER_TOKEN_BYTE * longest * max_context_tokens
