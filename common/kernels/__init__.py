"""Kernels, each beside its torch reference: Triton attention, fused elementwise ops, staging copies,
host-to-device copies."""
