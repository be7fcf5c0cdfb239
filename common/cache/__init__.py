"""The KV cache: the paged KV pool and its page allocator (the radix trees will live here)."""
