"""Model layers: attention and its backend choice, rotary, RMSNorm, tensor-parallel sharding."""
