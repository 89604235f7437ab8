"""Tests of swarmfd.accumulate.GradAccum: the mean of micro-step gradients, cycles, errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from swarmfd.accumulate import GradAccum

from .support.harness import require_torch


class Param:
    """A parameter object in the torch style: the gradient lives in ``.grad``."""

    def __init__(self, grad: np.ndarray | None) -> None:
        self.grad = grad


finite = st.floats(min_value=-1e3, max_value=1e3, allow_nan=False, width=64)


@given(
    steps=st.integers(min_value=1, max_value=6),
    shape=hnp.array_shapes(min_dims=0, max_dims=3, max_side=4),
    data=st.data(),
)
def test_finish_writes_the_mean_of_the_micro_steps(steps, shape, data):
    """After `steps` micro-steps, finish() leaves the mean of their gradients in place."""
    grad = np.zeros(shape)
    bias = np.zeros(3)
    accum = GradAccum([grad, bias], steps)
    seen_w, seen_b = [], []
    for i in range(steps):
        assert not accum.should_step()
        assert accum.count == i
        grad[...] = data.draw(hnp.arrays(np.float64, shape, elements=finite))
        bias[...] = data.draw(hnp.arrays(np.float64, 3, elements=finite))
        seen_w.append(grad.copy())
        seen_b.append(bias.copy())
        accum.step([grad, bias])
    assert accum.should_step()
    out = accum.finish([grad, bias])
    np.testing.assert_allclose(grad, np.mean(seen_w, axis=0), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(bias, np.mean(seen_b, axis=0), rtol=1e-12, atol=1e-12)
    assert out[0] is grad and out[1] is bias
    assert accum.count == 0
    assert not accum.should_step()


def test_cycles_are_independent():
    """finish() starts a new cycle: the next mean does not include the previous cycle."""
    g = np.zeros(2, dtype=np.float32)
    accum = GradAccum([g], steps=2)
    for value in (1.0, 3.0):
        g[:] = value
        accum.step([g])
    accum.finish([g])
    assert g.tolist() == [2.0, 2.0]
    for value in (10.0, 20.0):
        g[:] = value
        accum.step([g])
    accum.finish([g])
    assert g.tolist() == [15.0, 15.0]


def test_reset_discards_accumulated_gradients():
    """reset() forgets the micro-steps so far; finish() then needs new ones."""
    g = np.ones(3)
    accum = GradAccum([g], steps=3)
    accum.step([g])
    accum.step([g])
    accum.reset()
    assert accum.count == 0
    with pytest.raises(RuntimeError, match="no accumulated micro-steps"):
        accum.finish([g])
    g[:] = 4.0
    accum.step([g])
    accum.finish([g])
    assert g.tolist() == [4.0, 4.0, 4.0]


def test_short_last_cycle_is_averaged_over_its_own_count():
    """finish() before `steps` micro-steps (end of an epoch) divides by the actual count."""
    g = np.zeros(1)
    accum = GradAccum([g], steps=4)
    for value in (2.0, 4.0, 9.0):
        g[:] = value
        accum.step([g])
    assert not accum.should_step()
    accum.finish([g])
    assert g.tolist() == [5.0]


def test_params_with_grad_attribute():
    """Objects with .grad (torch style) work, including a .grad replaced between steps."""
    p = Param(np.zeros((2, 2)))
    accum = GradAccum([p], steps=2)
    p.grad = np.full((2, 2), 1.0)  # a new array, as torch's zero_grad(set_to_none) produces
    accum.step([p])
    p.grad = np.full((2, 2), 5.0)
    accum.step([p])
    out = accum.finish([p])
    assert p.grad.tolist() == [[3.0, 3.0], [3.0, 3.0]]
    assert out[0] is p.grad


def test_grad_none_at_construction_is_bound_at_first_step():
    """A .grad of None before the first backward is fine; its shape is fixed at the first step."""
    p = Param(None)
    accum = GradAccum([p], steps=1)
    p.grad = np.array([2.0, 4.0])
    accum.step([p])
    accum.finish([p])
    assert p.grad.tolist() == [2.0, 4.0]
    p.grad = np.zeros(3)
    with pytest.raises(ValueError, match=r"param 0 has gradient shape \(3,\), expected \(2,\)"):
        accum.step([p])


def test_grad_none_at_step_is_an_error():
    """step() without a gradient (backward not run) names the param."""
    accum = GradAccum([Param(np.zeros(1)), Param(np.zeros(1))], steps=1)
    with pytest.raises(ValueError, match="param 1 has no gradient"):
        accum.step([Param(np.zeros(1)), Param(None)])


def test_single_array_and_generator_params():
    """A single array counts as one param; a generator (model.parameters()) is accepted."""
    g = np.arange(4.0)
    accum = GradAccum(g, steps=1)
    assert accum.num_params == 1
    accum.step(g)
    accum.finish(g)
    assert g.tolist() == [0.0, 1.0, 2.0, 3.0]
    grads = [np.ones(2), np.ones(3)]
    accum = GradAccum((x for x in grads), steps=1)
    assert accum.num_params == 2
    accum.step(iter(grads))
    accum.finish(iter(grads))


def test_float16_is_accumulated_in_float32():
    """float16 gradients are summed in float32: a float16 sum of 64 x 2050 would overflow."""
    g = np.zeros(1, dtype=np.float16)
    accum = GradAccum([g], steps=64)
    for i in range(64):
        g[:] = 2052.0 if i % 2 else 2048.0  # sum 131200 > float16 max 65504; mean 2050
        accum.step([g])
    accum.finish([g])
    assert g.dtype == np.float16
    assert g.tolist() == [2050.0]


def test_step_validates_count_shape_dtype():
    """step() with other params than at construction raises ValueError naming index and shapes."""
    accum = GradAccum([np.zeros((2, 3)), np.zeros(4)], steps=2)
    with pytest.raises(ValueError, match="got 1 params, expected 2"):
        accum.step([np.zeros((2, 3))])
    with pytest.raises(ValueError, match=r"param 1 has gradient shape \(5,\), expected \(4,\)"):
        accum.step([np.zeros((2, 3)), np.zeros(5)])
    with pytest.raises(ValueError, match="param 0 has gradient dtype float32, expected float64"):
        accum.step([np.zeros((2, 3), dtype=np.float32), np.zeros(4)])
    assert accum.count == 0  # failed calls accumulate nothing


def test_failed_step_leaves_accumulators_untouched():
    """A step() that fails validation on its last param adds nothing for the earlier ones."""
    a, b = np.ones(2), np.ones(2)
    accum = GradAccum([a, b], steps=1)
    with pytest.raises(ValueError):
        accum.step([np.full(2, 100.0), np.ones(3)])
    accum.step([a, b])
    accum.finish([a, b])
    assert a.tolist() == [1.0, 1.0]


def test_finish_validates_before_writing():
    """finish() with a wrong param raises and writes nothing; the cycle is kept."""
    a = np.full(2, 3.0)
    accum = GradAccum([a], steps=1)
    accum.step([a])
    a[:] = 0.0
    with pytest.raises(ValueError, match="param 0 has gradient shape"):
        accum.finish([np.zeros(3)])
    assert accum.count == 1
    accum.finish([a])
    assert a.tolist() == [3.0, 3.0]


@pytest.mark.parametrize("dtype", [np.int32, np.int64, np.uint8, np.bool_])
def test_integer_gradients_rejected(dtype):
    """Integer/bool gradients raise TypeError: their mean is not representable."""
    with pytest.raises(TypeError, match="expected a floating"):
        GradAccum([np.zeros(2, dtype=dtype)], steps=2)
    p = Param(None)
    accum = GradAccum([p], steps=2)
    p.grad = np.zeros(2, dtype=dtype)
    with pytest.raises(TypeError, match="expected a floating"):
        accum.step([p])


@pytest.mark.parametrize(
    ("steps", "exc", "words"),
    [
        (0, ValueError, "steps must be a positive integer"),
        (-3, ValueError, "steps must be a positive integer"),
        (2.0, TypeError, "steps must be a positive integer"),
        (True, TypeError, "steps must be a positive integer"),
        ("4", TypeError, "steps must be a positive integer"),
    ],
)
def test_bad_steps(steps, exc, words):
    """steps must be a positive int (bool and float rejected)."""
    with pytest.raises(exc, match=words):
        GradAccum([np.zeros(1)], steps)


def test_bad_params():
    """Params that are neither arrays nor have .grad raise TypeError naming the index."""
    with pytest.raises(TypeError, match="param 1 is a list"):
        GradAccum([np.zeros(1), [1.0, 2.0]], steps=1)
    with pytest.raises(TypeError, match="params must be a sequence"):
        GradAccum(3, steps=1)  # type: ignore[arg-type]


def test_finish_without_steps():
    """finish() before any step() raises RuntimeError."""
    with pytest.raises(RuntimeError, match="no accumulated micro-steps"):
        GradAccum([np.zeros(1)], steps=1).finish([np.zeros(1)])


def test_properties_and_repr():
    """steps/count/num_params report the configuration and progress."""
    accum = GradAccum([np.zeros(1), np.zeros(2)], np.int64(3))
    accum.step([np.zeros(1), np.zeros(2)])
    assert (accum.steps, accum.count, accum.num_params) == (3, 1, 2)
    assert repr(accum) == "GradAccum(num_params=2, steps=3, count=1)"


# --- torch (skipped without it, failed under CI=true) ---------------------------------


def test_torch_parameters():
    """torch parameters: gradients are read and written through zero-copy numpy views."""
    torch = require_torch()
    w = torch.nn.Parameter(torch.zeros(2, 2))
    b = torch.nn.Parameter(torch.zeros(2))
    accum = GradAccum([w, b], steps=2)  # .grad is None before the first backward
    for scale in (1.0, 3.0):
        w.grad = None
        b.grad = None
        ((w * scale).sum() + (b * scale).sum()).backward()
        accum.step([w, b])
    out = accum.finish([w, b])
    assert torch.equal(w.grad, torch.full((2, 2), 2.0))
    assert torch.equal(b.grad, torch.full((2,), 2.0))
    assert np.shares_memory(out[0], w.grad.numpy())


def test_torch_gradient_tensors_directly():
    """A list of gradient tensors (p.grad) is accepted like numpy arrays."""
    torch = require_torch()
    g = torch.zeros(3)
    accum = GradAccum([g], steps=2)
    g.fill_(1.0)
    accum.step([g])
    g.fill_(2.0)
    accum.step([g])
    accum.finish([g])
    assert torch.equal(g, torch.full((3,), 1.5))


def test_torch_bfloat16_is_written_back():
    """bfloat16 has no numpy dtype: accumulated through float32 and copied back into the tensor."""
    torch = require_torch()
    g = torch.zeros(2, dtype=torch.bfloat16)
    accum = GradAccum([g], steps=2)
    g.fill_(1.0)
    accum.step([g])
    g.fill_(3.0)
    accum.step([g])
    out = accum.finish([g])
    assert out[0] is g
    assert g.dtype == torch.bfloat16
    assert torch.equal(g, torch.full((2,), 2.0, dtype=torch.bfloat16))
