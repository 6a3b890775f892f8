"""Faster linear layers for the few rows decoding produces, on CPU in float32.

A decoding step multiplies a handful of rows by every weight matrix of the model, and
the matrices no longer fit in cache, so the step is bound by reading them. PyTorch's CPU
`F.linear` (x @ W.T) reads them poorly for so few rows; the same product computed as
W @ x.T streams W in its stored row-major order. Measured on this project's 2-core CPU
(SmolLM2-135M):
- its 49152 x 576 lm_head: 9 / 22 / 33 / 16 ms for 1 / 2 / 3 / 4+ rows with `F.linear`
  (a 2- or 3-token verification cost more than an 8-token one), 3.1 / 3.1 / 4.0 / 4.6 /
  6.8 ms for 1 / 2 / 3 / 4 / 8 rows as W @ x.T (one row is computed as two: a
  matrix-vector product takes the slow path again);
- 30 layers of its MLP matrices cycled (cold cache): 25 / 40 / 34 / 35 ms for 1 / 2 / 4 /
  8 rows against 9 / 9 / 17 / 26 ms;
- the whole model, one decode step / an 8-token verification: 51 / 83 ms -> 35 / 77 ms
  at 1K context, 66 / 111 -> 49 / 106 ms at 4K.
Rows go in and come out contiguous: W @ x.T with x a transposed view (what the product
returned before, and what act(gate) * up then kept for the MLP's down projection) took
530 instead of 197 us there, 2.7-5x in isolation; made contiguous, a 2-token verification
costs 1.09-1.16 decode steps at 2-7K context instead of 1.36-1.41, a 4-token one
1.31-1.39 instead of 1.42-1.65 (interleaved, one run).
Plain decoding and speculative verification both go through it, so the baseline is the
fastest configuration too. Values are the same dot products; only the summation order
inside the BLAS kernel may differ, as between any two GEMM shapes. Prefills (more than
`MAX_ROWS` rows), other devices and other dtypes keep `F.linear`."""

import types

import torch

MAX_ROWS = 16


def few_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """F.linear(x, weight, bias), computed as weight @ x.T when x has few rows (CPU, fp32)."""
    rows = x.numel() // x.shape[-1]
    if rows > MAX_ROWS or x.device.type != "cpu" or weight.dtype != torch.float32 or x.dtype != weight.dtype:
        return torch.nn.functional.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1]).contiguous()
    if rows == 1:  # a matrix-vector product takes the slow path again: use two rows
        flat = torch.cat([flat, flat])
    # Contiguous out (a copy of a few rows): a transposed view would be the next layer's
    # input (the MLP's down projection reads act(gate) * up, which keeps its layout),
    # and W @ x.T with x a transposed view is 2.7-5x slower than with contiguous rows.
    out = (weight @ flat.T).T[:rows].contiguous()
    if bias is not None:
        out = out + bias
    return out.reshape(*x.shape[:-1], weight.shape[0])


def _forward(self, x: torch.Tensor) -> torch.Tensor:
    return few_rows_linear(x, self.weight, self.bias)


def install(model) -> int:
    """Route every plain `nn.Linear` of `model` through `few_rows_linear` (subclasses,
    e.g. quantised layers, keep their own forward). Returns how many were routed."""
    n = 0
    for m in model.modules():
        if type(m) is torch.nn.Linear:
            m.forward = types.MethodType(_forward, m)
            n += 1
    return n
