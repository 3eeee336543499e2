"""The gradient sketch behind the cross-step SNR estimator: unbiased, accurate, the same on every process."""

import pytest
import torch

from oblr_trl.estimators.sketch import GradientSketch


def _sketch_of(sketch: GradientSketch, tensors) -> torch.Tensor:
    for index, tensor in enumerate(tensors):
        sketch.add(index, tensor)
    return sketch.pop(torch.device("cpu"))


def test_small_tensors_are_kept_exactly_and_large_ones_projected():
    shapes = [torch.Size([3, 4]), torch.Size([200, 64]), torch.Size([64, 300]), torch.Size([5000])]
    sketch = GradientSketch(shapes, rank=8, exact_below=4096)
    assert sketch.size == 12 + 64 * 8 + 64 * 8 + 8
    generator = torch.Generator().manual_seed(0)
    x = [torch.randn(s, generator=generator) for s in shapes]
    flat = _sketch_of(sketch, x)
    assert torch.equal(flat[:12], x[0].reshape(-1))


def test_sketch_inner_products_are_unbiased_and_accurate_for_correlated_gradients():
    shapes = [torch.Size([256, 128]), torch.Size([128, 512]), torch.Size([64])]
    generator = torch.Generator().manual_seed(1)
    shared = [torch.randn(s, generator=generator) for s in shapes]
    x = [a + torch.randn(a.shape, generator=generator) for a in shared]
    y = [a + torch.randn(a.shape, generator=generator) for a in shared]
    exact = sum((a * b).sum() for a, b in zip(x, y, strict=True)).item()
    norm = (sum(a.pow(2).sum() for a in x) * sum(b.pow(2).sum() for b in y)).sqrt().item()
    estimates = []
    for seed in range(40):
        sketch = GradientSketch(shapes, rank=8, seed=seed)
        estimates.append(torch.dot(_sketch_of(sketch, x), _sketch_of(sketch, y)).item())
    estimates = torch.tensor(estimates, dtype=torch.float64)
    # one sketch: error of order ‖x‖‖y‖/√(k·kept side) ≈ 3 % here, all within 12 %; over seeds: unbiased
    assert ((estimates - exact).abs() < 0.12 * norm).all()
    assert (estimates - exact).abs().mean() < 0.05 * norm
    assert abs(estimates.mean().item() - exact) < 3 * estimates.std().item() / len(estimates) ** 0.5 + 1e-9


def test_sketches_add_up_across_micro_batches_and_processes():
    shapes = [torch.Size([100, 80])]
    generator = torch.Generator().manual_seed(2)
    parts = [torch.randn(shapes[0], generator=generator) for _ in range(3)]
    together = _sketch_of(GradientSketch(shapes, seed=5), [sum(parts)])
    separately = sum(_sketch_of(GradientSketch(shapes, seed=5), [p]) for p in parts)  # a fresh object per "process"
    torch.testing.assert_close(together, separately, rtol=1e-5, atol=1e-4)


def test_pieces_along_the_first_dimension_add_up_to_the_sketch_of_the_whole_gradient():
    """FSDP2 keeps rows r0…r1 of each gradient on a process (torch.chunk's uneven split): every layout (kept
    exactly, X·V, Vᵀ·X, a 1-D tensor projected or kept) sketched in pieces equals the sketch of the whole."""
    shapes = [torch.Size([3, 4]), torch.Size([50, 300]), torch.Size([300, 20]), torch.Size([5000]), torch.Size([7]),
              torch.Size([])]
    generator = torch.Generator().manual_seed(3)
    x = [torch.randn(s, generator=generator) for s in shapes]
    whole = _sketch_of(GradientSketch(shapes, rank=4, exact_below=100, seed=7), x)
    for processes in (2, 3):
        total = torch.zeros_like(whole)
        for rank in range(processes):  # a fresh object per process, as on separate ranks
            sketch = GradientSketch(shapes, rank=4, exact_below=100, seed=7)
            for index, tensor in enumerate(x):
                if tensor.dim() == 0:
                    if rank == 0:
                        sketch.add(index, tensor)
                    continue
                chunks = torch.chunk(tensor, processes)
                if rank < len(chunks):
                    sketch.add(index, chunks[rank], start=sum(len(c) for c in chunks[:rank]))
            total += sketch.pop(torch.device("cpu"))
        torch.testing.assert_close(total, whole, rtol=1e-5, atol=1e-4)
    one_piece = GradientSketch(shapes, rank=4, exact_below=100, seed=7)
    for index, tensor in enumerate(x):
        if tensor.dim():
            one_piece.add(index, torch.chunk(tensor, 2)[0])
    assert not torch.allclose(one_piece.pop(torch.device("cpu")), whole, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("shape, start", [((3, 4), 8), ((3, 5), 0), ((2, 4), -1)])
def test_a_piece_that_does_not_fit_its_parameter_is_refused(shape, start):
    with pytest.raises(ValueError, match="does not fit"):
        GradientSketch([torch.Size([10, 4])]).add(0, torch.ones(shape), start=start)


def test_a_projected_row_lands_in_its_own_k_entries_of_the_sketch():
    """The layout a checkpoint's sketch is saved in: X·V row by row (k entries a row), Vᵀ·X whole."""
    shapes = [torch.Size([64, 300]), torch.Size([300, 20])]
    for index, shape in enumerate(shapes):
        sketch = GradientSketch(shapes, rank=4, exact_below=100, seed=11)
        row = 5
        x = torch.zeros(shape)
        x[row] = torch.randn(shape[1], generator=torch.Generator().manual_seed(index))
        sketch.add(index, x)
        flat = sketch.pop(torch.device("cpu"))
        offset = 64 * 4 if index else 0
        nonzero = flat.nonzero().reshape(-1)
        if index == 0:  # X·V: only this row's k entries
            assert nonzero.tolist() == list(range(offset + row * 4, offset + row * 4 + 4))
        else:  # Vᵀ·X: one row of X reaches every column of the k × cols block
            assert len(nonzero) == 4 * 20 and nonzero.min() >= offset
