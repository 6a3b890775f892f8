"""Few-row linear layers (`dlite.few_rows`): the same products as `F.linear` for every
row count on either side of the switch, with and without bias, contiguous rows out of
any layout in; a target routed through them decodes the same greedy text, and
speculative decoding over it stays lossless."""

import pytest
import torch

from dlite import few_rows
from dlite.decoding.decode import plain_generate, speculative_generate
from dlite.decoding.lookup import PromptLookupDrafter
from tests.unit.test_spec_decode import tiny_target


@pytest.mark.parametrize("rows", [1, 2, 3, 8, few_rows.MAX_ROWS, few_rows.MAX_ROWS + 1, 40])
@pytest.mark.parametrize("bias", [False, True])
def test_same_products_as_f_linear(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(300, 64, generator=g), torch.randn(2, rows, 64, generator=g)[:1]
    b = torch.randn(300, generator=g) if bias else None
    out = few_rows.few_rows_linear(x, w, b)
    assert out.shape == (1, rows, 300)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [1, 2, 5])
def test_rows_come_out_contiguous_whatever_goes_in(rows):
    """A transposed view as input (what act(gate) * up would be, were the products it
    multiplies views) gives the same product, and the result is contiguous: W @ x.T over
    a transposed view is several times slower, so no layer may hand one to the next."""
    g = torch.Generator().manual_seed(rows)
    w, x = torch.randn(300, 64, generator=g), torch.randn(64, rows, generator=g).T
    out = few_rows.few_rows_linear(x, w)
    assert out.is_contiguous() and (rows == 1 or not x.is_contiguous())
    torch.testing.assert_close(out, torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-5)
    twice = few_rows.few_rows_linear(torch.nn.functional.silu(out) * out, torch.randn(7, 300, generator=g))
    assert twice.is_contiguous()


def test_other_dtypes_keep_f_linear():
    w, x = torch.randn(30, 8, dtype=torch.bfloat16), torch.randn(2, 8, dtype=torch.bfloat16)
    assert torch.equal(few_rows.few_rows_linear(x, w), torch.nn.functional.linear(x, w))


def test_a_routed_target_decodes_the_same_and_stays_lossless():
    prompt = [5, 17, 99, 3, 42, 8, 61, 7, 5, 17, 99, 3, 42]
    ref, _ = plain_generate(tiny_target(), prompt, 30)
    target = tiny_target()
    n_linear = sum(type(m) is torch.nn.Linear for m in target.modules())
    assert few_rows.install(target) == n_linear > 0
    out, _ = plain_generate(target, prompt, 30)
    spec, rounds = speculative_generate(target, PromptLookupDrafter(prompt, 128, gamma=4), prompt, 30)
    assert out == ref and spec == ref and rounds
