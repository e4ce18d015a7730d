"""The host's step in one pass (offload/host_step.py) against torch's own optimizer.step(): the same
bits in the parameters, moments and step counts, over several steps, for Adam and AdamW with weight
decay, amsgrad and maximize, fp32 and 16-bit gradients, a clip factor, shards of any length (chunk
ends inside the shard, a last partial chunk), any number of threads; and only where it applies."""
from __future__ import annotations

import itertools

import pytest
import torch

from zeroshard.offload import host_step

N = 3 * host_step.CHUNK + 777  # three whole chunks and a partial one


def _torch_reference(cls, options: dict, p0: torch.Tensor, grads: list[torch.Tensor], factor: float):
    p = torch.nn.Parameter(p0.clone())
    opt = cls([p], fused=True, **options)
    for g in grads:
        p.grad = g.float() * factor if factor != 1.0 else g.float()
        opt.step()
    return p.detach(), opt.state[p]


def _folded(cls, options: dict, p0: torch.Tensor, grads: list[torch.Tensor], factor: float,
            out_dtype: torch.dtype | None):
    p = torch.nn.Parameter(p0.clone())
    opt = cls([p], fused=True, **options)
    assert host_step.folds(opt, has_user_hooks=False)
    scratch = host_step.scratch_for()
    out = torch.empty(N, dtype=out_dtype) if out_dtype is not None else None  # None: the master goes up
    for g in grads:
        host_step.update(opt, p, g, factor, out, scratch)
        assert out is None or torch.equal(out, p.detach().to(out_dtype)), "the copy going up: the new values"
    return p.detach(), opt.state[p]


@pytest.mark.parametrize("cls, options", [
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    (torch.optim.Adam, {"lr": 1e-3}),  # (the common loops: with AdamW's decay above, without it here)
    (torch.optim.Adam, {"lr": 3e-3, "weight_decay": 0.01, "amsgrad": True}),
    (torch.optim.AdamW, {"lr": 1e-3, "betas": (0.8, 0.95), "eps": 1e-6, "maximize": True, "amsgrad": True}),
])
def test_the_folded_step_is_torchs_step_bit_for_bit(cls, options):
    generator = torch.Generator().manual_seed(0)
    p0 = torch.randn(N, generator=generator)
    dtypes = (torch.float32, torch.bfloat16, torch.float16)
    pairs = itertools.product(dtypes, dtypes + (None,))  # (None: the fp32 master itself goes up)
    for (grad_dtype, out_dtype), factor, threads in itertools.product(pairs, (1.0, 0.37), (1, 3)):
        torch.set_num_threads(threads)
        grads = [torch.randn(N, generator=generator).to(grad_dtype) for _ in range(3)]
        want_p, want_state = _torch_reference(cls, options, p0, grads, factor)
        got_p, got_state = _folded(cls, options, p0, grads, factor, out_dtype)
        what = (cls.__name__, grad_dtype, out_dtype, factor, threads)
        assert torch.equal(got_p, want_p), what
        assert sorted(got_state) == sorted(want_state), what
        for key, value in want_state.items():
            assert torch.equal(got_state[key], value) and got_state[key].dtype == value.dtype, (what, key)
    torch.set_num_threads(1)


def test_the_gradient_is_read_not_written():
    p = torch.nn.Parameter(torch.randn(N))
    opt = torch.optim.AdamW([p], lr=1e-2, fused=True)
    grad = torch.randn(N).to(torch.bfloat16)
    kept = grad.clone()
    host_step.update(opt, p, grad, 0.5, None, host_step.scratch_for())
    assert torch.equal(grad, kept)


def test_only_torchs_fused_adam_with_plain_hyperparameters_folds():
    p = [torch.nn.Parameter(torch.zeros(4))]
    assert host_step.folds(torch.optim.AdamW(p, fused=True), has_user_hooks=False)
    assert not host_step.folds(torch.optim.AdamW(p, fused=True), has_user_hooks=True)
    assert not host_step.folds(torch.optim.AdamW(p), has_user_hooks=False)  # not fused: torch's step
    assert not host_step.folds(torch.optim.AdamW(p, lr=torch.tensor(1e-3), fused=True), has_user_hooks=False)
    assert not host_step.folds(torch.optim.SGD(p, lr=0.1), has_user_hooks=False)

    class MyAdam(torch.optim.Adam):  # a subclass may step otherwise
        pass
    assert not host_step.folds(MyAdam(p, fused=True), has_user_hooks=False)


def test_the_loop_is_built_where_it_can_be():
    """Where torch's kernels are AVX2/AVX-512 and a C compiler is there, the update runs the loop
    (the tests above would pass on the slower fallback too)."""
    import shutil
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512") or not shutil.which("cc"):
        pytest.skip("no C compiler or another CPU capability: the fallback runs, tested above")
    assert host_step._kernel() is not None
