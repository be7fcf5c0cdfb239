"""FP8 (e4m3) linear weights and the w8a8 GEMMs that read them.

``Fp8Weight`` holds what one rank keeps of a (possibly fused) linear: the float8_e4m3fn weight
[out, in], one byte per element, and fp32 scales (dequantized ``w = weight * scale``)::

    per-row (tensor, channel formats)  scale [out]: one per output row. A per-tensor checkpoint
                                       scale is repeated over the rows of its part, so fused q/k/v
                                       and gate/up each keep their own.
    block (fp8, 128 x 128 blocks)      scale [out, ceil(in/128)]: the checkpoint's block scales
                                       [ceil(out/128), ceil(in/128)] with each block row repeated
                                       for its (up to) 128 weight rows.

Why block scales are stored row-expanded: fused q/k/v or gate/up parts and TP slices then need
not start on a 128-row boundary (the tiny preset's 64-row k/v, Llama's 1,024-row k at TP 16), and
the kernel's per-row scale load costs nothing next to the weight. It costs 4 bytes per 128
weights (3 % over the 1-byte weights). Along ``in`` the groups stay aligned to the checkpoint's:
a TP slice of a row-parallel block weight must start on a multiple of 128 (refused by
``tp_layers``, naming the sizes).

``fp8_linear`` is what ``attn.linear`` calls for such a weight. For prefill-sized inputs the
activations are quantized dynamically (per token, or per token per 128-column group for block
weights; ``amax / 448`` as the checkpoints' dynamic scheme does) and the GEMM runs

    CUDA, M <= 16   common/kernels/triton_gemv.py: weight-only (W8A16), the e4m3 weight dequantized
                    in registers, x not quantized (decode steps: bound by the weights' bytes); block
                    scales up to 64 rows where it measured faster than the block GEMM
                    (``triton_gemv.takes_rows``)
    CUDA, per-row,  per-token quant + the same kernel's dot on FP8 tensor cores (W8A8; 1.05-1.43x
      M <= 64       _scaled_mm at 64 rows on an H100, the quant included)
    CUDA, per-row   torch._scaled_mm with row-wise scales (scale_a [M, 1], scale_b [1, N], out bf16)
    CUDA, block     common/kernels/triton_fp8_gemm.py (per-token-group quant + block GEMM)
    otherwise       the torch reference: dequantize both, matmul in fp32, cast to x's dtype

On the W8A8 per-row routes the input may come quantized already (``TokenQuantized``): the triton
backend's norm and silu kernels quantize what they make for such a linear in the same launch
(``takes_token_quant``; ``FUSE_TOKEN_QUANT`` turns it off for A/B runs), bit for bit as the separate
``per_token_quant`` kernel would.

The CPU path is W8A8 at every M, so CPU pairs and colocated CPU engines agree with each other;
on CUDA a decode step's linears are the more exact W8A16 (``reference_weight_only``) up to 16 rows.
"""

from __future__ import annotations

import torch
from torch import nn

from kvferry.common.errors import ModelLoadError
from kvferry.common.kernels.quant_rows import SplitParts, TokenQuantized

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3 value
MIN_AMAX = 1e-12  # an all-zero row still gets a finite scale (its values quantize to 0)
FP8_GEMV_MAX_ROWS = 64  # up to this many rows on CUDA: the weight-only GEMV (at most triton_gemv.FP8_GEMV_MAX_ROWS)


class Fp8Weight(nn.Module):
    """FP8 weight [out, in] and its scales (see the module docstring); ``block`` is None for per-row
    scales, else the block size (128)."""

    def __init__(self, out_features: int, in_features: int, block: int | None, device: torch.device) -> None:
        super().__init__()
        self.block = block
        self.register_buffer("weight", torch.empty((out_features, in_features), dtype=FP8_DTYPE, device=device))
        shape = (out_features,) if block is None else (out_features, -(-in_features // block))
        self.register_buffer("scale", torch.empty(shape, dtype=torch.float32, device=device))

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    def dequantize(self) -> torch.Tensor:
        """The fp32 weight [out, in] the scales describe."""
        return self.weight.float() * self.expanded_scale()

    def expanded_scale(self) -> torch.Tensor:
        """[out, 1] (per-row) or [out, in] (block) fp32: the factor of each weight element."""
        if self.block is None:
            return self.scale[:, None]
        return self.scale.repeat_interleave(self.block, dim=1)[:, :self.weight.shape[1]]


def linear_weight(module_names: list[str], quantization, out_features: int, in_features: int,
                  dtype: torch.dtype, device: torch.device) -> nn.Parameter | Fp8Weight:
    """The weight of one (fused) linear made of the Hugging Face modules ``module_names``: FP8 when
    ``quantization`` (a ``quant_config.Fp8Scheme`` or None) quantizes them, else a plain parameter.
    Fused parts must agree: one quantized and one ignored cannot share a weight."""
    quantized = [quantization is not None and quantization.quantizes(name) for name in module_names]
    if any(quantized) and not all(quantized):
        listed = {name: q for name, q in zip(module_names, quantized)}
        raise ModelLoadError(f"quantization_config ignores some of the fused modules {listed} (True: FP8): "
                             "fused q/k/v and gate/up must be all FP8 or all unquantized")
    if all(quantized):
        return Fp8Weight(out_features, in_features, 128 if quantization.is_block else None, device)
    # Uninitialised: the loader overwrites every element.
    return nn.Parameter(torch.empty((out_features, in_features), dtype=dtype, device=device), requires_grad=False)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (e4m3 weight, fp32 scale [out]): one scale per row, ``amax / 448``."""
    scale = w.float().abs().amax(dim=1).clamp(min=MIN_AMAX) / FP8_MAX
    return (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w -> (e4m3 weight, fp32 scale [1]): one scale for the whole tensor."""
    scale = w.float().abs().amax().clamp(min=MIN_AMAX).reshape(1) / FP8_MAX
    return (w.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def quantize_blocks(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """w [out, in] -> (e4m3 weight, fp32 scale_inv [ceil(out/block), ceil(in/block)]): one scale per
    block x block tile, the last tile of each dim ragged."""
    out_features, in_features = w.shape
    rows, cols = -(-out_features // block), -(-in_features // block)
    padded = torch.zeros(rows * block, cols * block, dtype=torch.float32)
    padded[:out_features, :in_features] = w.float()
    tiles = padded.view(rows, block, cols, block)
    scale = tiles.abs().amax(dim=(1, 3)).clamp(min=MIN_AMAX) / FP8_MAX  # [rows, cols]
    q = (tiles / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(rows * block, cols * block)
    return q[:out_features, :in_features].to(FP8_DTYPE).contiguous(), scale


def per_token_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (e4m3 [T, K], fp32 scale [T, 1]): dynamic per-token quantization, ``amax / 448``."""
    scale = x.float().abs().amax(dim=1, keepdim=True).clamp(min=MIN_AMAX) / FP8_MAX
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def per_token_group_quant(x: torch.Tensor, group: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, K] -> (e4m3 [T, K], fp32 scale [T, ceil(K/group)]): one scale per token per ``group``
    columns (the last group ragged), as DeepSeek-V3 and Qwen3-FP8 quantize activations."""
    num_tokens, k = x.shape
    num_groups = -(-k // group)
    padded = torch.zeros(num_tokens, num_groups * group, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    groups = padded.view(num_tokens, num_groups, group)
    scale = groups.abs().amax(dim=2).clamp(min=MIN_AMAX) / FP8_MAX
    q = (groups / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).view(num_tokens, num_groups * group)[:, :k]
    return q.to(FP8_DTYPE).contiguous(), scale


def reference_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The w8a8 GEMM in torch: quantize x as the kernels do, dequantize both, matmul in fp32, cast
    to x's dtype. x [..., in] -> [..., out]."""
    flat = x.reshape(-1, x.shape[-1])
    if w.block is None:
        xq, xs = per_token_quant(flat)
        x_deq = xq.float() * xs
    else:
        xq, xs = per_token_group_quant(flat, w.block)
        x_deq = xq.float() * xs.repeat_interleave(w.block, dim=1)[:, :flat.shape[1]]
    out = x_deq @ w.dequantize().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


def reference_weight_only(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The W8A16 GEMM in torch (what ``triton_gemv.fp8_gemv`` computes for decode-sized M on CUDA):
    x unquantized, the weight dequantized, matmul in fp32, cast to x's dtype."""
    out = x.float() @ w.dequantize().t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def _can_scaled_mm(x: torch.Tensor, w: Fp8Weight) -> bool:
    # Row-wise scaled_mm: CUDA, bf16 output, K and N multiples of 16 (cuBLASLt's FP8 alignment).
    return x.is_cuda and x.dtype == torch.bfloat16 and not w.shape[0] % 16 and not w.shape[1] % 16


def _gemv_takes(rows: int, n: int) -> bool:
    from kvferry.common.kernels import triton_gemv  # imports triton: only on CUDA

    return triton_gemv.takes_rows(rows, n)


FUSE_TOKEN_QUANT = True  # producers quantize what feeds a W8A8 per-row linear (bench/engine.py --fp8-unfused-quant)
# Tests under Triton's interpreter only: CPU rows take the routes CUDA rows take and the kernels run interpreted, so
# the CPU suite checks how the layers feed them (tests/gpu/test_triton_fp8_layers.py). Never set by the daemons.
KERNELS_ON_CPU = False


def _on_kernels(x: torch.Tensor) -> bool:
    return x.is_cuda or KERNELS_ON_CPU


def route(x: torch.Tensor, w: Fp8Weight, rows: int) -> str:
    """Which GEMM ``fp8_linear`` runs for ``rows`` rows of ``x`` (module docstring): ``gemv``
    (weight-only), ``block``, ``gemv_w8a8``, ``scaled_mm`` or ``reference``."""
    if not _on_kernels(x):
        return "reference"
    weight_only = rows <= 16 or (w.block is not None and _gemv_takes(rows, w.shape[0]))
    if rows <= FP8_GEMV_MAX_ROWS and weight_only:
        return "gemv"
    if w.block is not None:
        return "block"
    if rows <= FP8_GEMV_MAX_ROWS:  # per-row scales, 17 to 64 rows: W8A8 through the GEMV's dot path
        return "gemv_w8a8"
    return "scaled_mm" if _can_scaled_mm(x, w) else "reference"


def takes_token_quant(w, x: torch.Tensor) -> bool:
    """Whether a linear of weight ``w`` quantizes ``x`` [T, K] per token on the GPU (W8A8 with
    per-row scales): then the kernel producing ``x`` may hand it over quantized (``TokenQuantized``)."""
    return (FUSE_TOKEN_QUANT and isinstance(w, Fp8Weight) and w.block is None and _on_kernels(x) and x.dim() == 2
            and route(x, w, x.shape[0]) in ("gemv_w8a8", "scaled_mm"))


def fp8_linear(x: torch.Tensor | TokenQuantized, w: Fp8Weight, bias: torch.Tensor | None = None,
               defer_sum: bool = False) -> torch.Tensor | SplitParts:
    """x [..., in] @ dequant(w).T + bias, with x quantized dynamically (unless it comes quantized,
    ``TokenQuantized``); the kernel by device, rows and weight kind (module docstring). ``defer_sum``
    (x [T, in]): a split-K GEMV's parts may come back unsummed (``SplitParts``, for ``add_rms_norm``)."""
    quantized = x if isinstance(x, TokenQuantized) else None
    x = x.rows if quantized is not None else x
    rows = x.numel() // x.shape[-1]
    flat = x.reshape(-1, x.shape[-1])
    if _on_kernels(x) and flat.stride(-1) != 1:
        flat = flat.contiguous()
    how = route(x, w, rows)
    defer_sum = defer_sum and x.dim() == 2  # SplitParts are [S, T, out]
    if how == "gemv":
        from kvferry.common.kernels import triton_gemv  # imports triton: only on CUDA

        out = triton_gemv.fp8_gemv(flat, w.weight, w.scale, w.block, bias, defer_sum=defer_sum)
        return out if isinstance(out, SplitParts) else out.reshape(*x.shape[:-1], w.shape[0])
    if how == "block":
        from kvferry.common.kernels import triton_fp8_gemm  # imports triton: only on CUDA

        out = triton_fp8_gemm.w8a8_block_linear(flat, w.weight, w.scale, w.block, bias)
        return out.reshape(*x.shape[:-1], w.shape[0])
    if how == "reference":
        return reference_linear(x, w, bias)
    from kvferry.common.kernels import triton_fp8_gemm, triton_gemv  # imports triton: only on CUDA

    xq, xs = (quantized.q, quantized.scale) if quantized is not None else triton_fp8_gemm.per_token_quant(flat)
    if how == "gemv_w8a8":
        out = triton_gemv.fp8_gemv(xq, w.weight, w.scale, None, bias, x_scale=xs, out_dtype=x.dtype,
                                   defer_sum=defer_sum)
        if isinstance(out, SplitParts):
            return out
    else:
        out = torch._scaled_mm(xq, w.weight.t(), scale_a=xs, scale_b=w.scale[None, :], out_dtype=torch.bfloat16)
        out = out if bias is None else out + bias
    return out.reshape(*x.shape[:-1], w.shape[0])
