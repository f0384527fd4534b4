"""mpiring.torch's sequence mixers under MPI: forward and backward against torch autograd of one-process loops.

    mpiexec -n 4 python -m pytest --with-mpi -m mpi -q tests/test_mixers_torch_mpi.py     # also -n 1, 2, 3

Each adapter (``causal_conv1d``, ``linear_attention``, ``chunk_gated_delta_rule``,
``mamba_chunk_scan``, ``selective_scan``) takes this rank's shard of float64
tensors drawn from one seed; its output and the gradients of every input
(the shared weights' summed over ranks) are compared with torch autograd of
a plain loop over the whole sequence written from the definitions, for every
layout, with and without documents. Then the same adapters against
transformers' own CPU kernels on the whole sequence (float32: they compute in
float32), and options mpiring cannot run refused on every rank.
"""

import numpy as np
import pytest
from mpi4py import MPI

from mpiring import LAYOUTS, shard_indices

torch = pytest.importorskip("torch")
mt = pytest.importorskip("mpiring.torch")

from mixer_loops import loop_conv, loop_linear, loop_scan, loop_ssd  # noqa: E402

pytestmark = pytest.mark.mpi


S, Bz = 19, 2


def problems(gen):
    """name -> (inputs, their sequence dims (None: shared), one-process loop(starts), adapter(**call))."""
    def rnd(*shape, low=None):
        t = torch.rand(*shape, generator=gen, dtype=torch.float64) if low is not None else \
            torch.randn(*shape, generator=gen, dtype=torch.float64)
        return (-t if low == "neg" else t).requires_grad_()
    out = {}
    x, w, b = rnd(Bz, 3, S), rnd(3, 4), rnd(3)
    out["conv"] = ([x, w, b], [2, None, None], lambda st: lambda x, w, b: torch.nn.functional.silu(loop_conv(x, w, b,
                                                                                                              st)),
                   lambda call: lambda x, w, b: mt.causal_conv1d(x, w, b, "silu", **call))
    q, k, v, g = rnd(Bz, S, 2, 3), rnd(Bz, S, 2, 3), rnd(Bz, S, 2, 2), rnd(Bz, S, 2, 3, low="neg")
    out["gla"] = ([q, k, v, g], [1] * 4, lambda st: lambda q, k, v, g: loop_linear(q, k, v, g, None, st, 3 ** -0.5),
                  lambda call: lambda q, k, v, g: mt.linear_attention(q, k, v, g, **call))
    q, k, v, g, beta = rnd(Bz, S, 1, 3), rnd(Bz, S, 1, 3), rnd(Bz, S, 2, 2), rnd(Bz, S, 2, low="neg"), rnd(Bz, S, 2,
                                                                                                         low="pos")

    def gdn_loop(st):
        def f(q, k, v, g, beta):
            q, k = (mt._l2norm(t.repeat_interleave(2, 2)) for t in (q, k))
            return loop_linear(q, k, v, g, beta, st, 3 ** -0.5)
        return f
    out["gdn"] = ([q, k, v, g, beta], [1] * 5, gdn_loop,
                  lambda call: lambda *a: mt.chunk_gated_delta_rule(*a, use_qk_l2norm_in_kernel=True, **call)[0])
    ins = [rnd(Bz, S, 4, 3), rnd(Bz, S, 4), rnd(4, low="neg"), rnd(Bz, S, 2, 2), rnd(Bz, S, 2, 2), rnd(4), rnd(4)]
    out["ssd"] = (ins, [1, 1, None, 1, 1, None, None], lambda st: lambda *a: loop_ssd(*a, st),
                  lambda call: lambda x, dt, A, Bm, Cm, D, bias: mt.mamba_chunk_scan(x, dt, A, Bm, Cm, 8, D=D,
                                                                                    dt_bias=bias, dt_softplus=True,
                                                                                    **call))
    ins = [rnd(Bz, 3, S), rnd(Bz, 3, S), rnd(3, 2, low="neg"), rnd(Bz, 2, S), rnd(Bz, 2, S), rnd(3), rnd(Bz, 3, S),
           rnd(3)]
    out["scan"] = (ins, [2, 2, None, 2, 2, None, 2, None], lambda st: lambda *a: loop_scan(*a, st),
                   lambda call: lambda x, dt, A, Bm, Cm, D, z, bias: mt.selective_scan(x, dt, A, Bm, Cm, D, z, bias,
                                                                                      True, **call))
    return out


@pytest.mark.parametrize("name", ["conv", "gla", "gdn", "ssd", "scan"])
def test_adapters_against_autograd_of_a_loop(name):
    comm = MPI.COMM_WORLD
    gen = torch.Generator().manual_seed(7)
    failed = []
    for layout in LAYOUTS:
        for cu in (None, [0, 6, 7, S]):
            starts = np.isin(np.arange(S), [0] if cu is None else cu[:-1])
            for passing in ("ring", "allgather", "scan"):
                inputs, dims, loop, adapter = problems(gen)[name]
                out = loop(starts)(*inputs)
                dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
                want = torch.autograd.grad(out, inputs, dout)
                idx = torch.as_tensor(shard_indices(S, comm.size, comm.rank, layout))
                local = [t.detach().index_select(d, idx).requires_grad_() if d is not None else
                         t.detach().clone().requires_grad_() for t, d in zip(inputs, dims)]
                got = adapter(dict(comm=comm, seq_len=S, layout=layout, cu_seqlens=cu, passing=passing))(*local)
                grads = torch.autograd.grad(got, local, dout.index_select(dims[0], idx))
                errors = [(got - out.index_select(dims[0], idx)).abs().max().item()]
                for g, w, d in zip(grads, want, dims):
                    mine = torch.from_numpy(comm.allreduce(g.numpy())) if d is None else g
                    errors.append((mine - (w if d is None else w.index_select(d, idx))).abs().max().item())
                if max(errors) > 1e-11:
                    failed.append(f"{layout} cu={cu} {passing}: errors {errors}")
    every = comm.allgather(failed)
    assert not any(every), every


def test_adapters_agree_with_transformers_kernels():
    """On the whole sequence's shards, float32: transformers' torch fallbacks compute in float32 (and ignore
    packed documents), so no documents here and a float32 tolerance."""
    pytest.importorskip("transformers")
    from transformers.models.falcon_h1.modeling_falcon_h1 import mamba2_chunk_scan
    from transformers.models.jamba.modeling_jamba import mamba_selective_scan
    from transformers.models.lfm2.modeling_lfm2 import causal_conv1d_fn
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    comm = MPI.COMM_WORLD
    gen = torch.Generator().manual_seed(3)
    f32 = dict(generator=gen, dtype=torch.float32)
    call = dict(comm=comm, seq_len=S, layout="zigzag", passing="scan")
    idx = torch.as_tensor(shard_indices(S, comm.size, comm.rank, "zigzag"))
    errors, layouts = {}, {}
    x, w = torch.randn(Bz, 6, S, **f32), torch.randn(6, 4, **f32)
    mine = mt.causal_conv1d(x[..., idx], w, None, "silu", **call)
    errors["conv"], layouts["conv"] = (mine - causal_conv1d_fn(x, w, None, "silu")[..., idx]).abs().max(), mine
    q, k, v = torch.randn(Bz, S, 2, 4, **f32), torch.randn(Bz, S, 2, 4, **f32), torch.randn(Bz, S, 4, 3, **f32)
    g, beta = -torch.rand(Bz, S, 4, **f32), torch.rand(Bz, S, 4, **f32)
    mine = mt.chunk_gated_delta_rule(*(t[:, idx] for t in (q, k, v, g, beta)), use_qk_l2norm_in_kernel=True, **call)
    theirs = torch_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=8, use_qk_l2norm_in_kernel=True)
    errors["gdn"], layouts["gdn"] = (mine[0] - theirs[0][:, idx]).abs().max(), mine[0]
    x, dt, A = torch.randn(Bz, S, 4, 3, **f32), torch.randn(Bz, S, 4, **f32), -torch.rand(4, **f32)
    Bm, Cm, D, bias = torch.randn(Bz, S, 2, 2, **f32), torch.randn(Bz, S, 2, 2, **f32), torch.randn(4, **f32), \
        torch.randn(4, **f32)
    mine = mt.mamba_chunk_scan(*(t[:, idx] for t in (x, dt)), A, *(t[:, idx] for t in (Bm, Cm)), 8, D=D,
                               dt_bias=bias, dt_softplus=True, **call)
    theirs = mamba2_chunk_scan(x, dt, A, Bm, Cm, 8, D=D, dt_bias=bias, dt_softplus=True)
    errors["ssd"], layouts["ssd"] = (mine - theirs[:, idx]).abs().max(), mine
    x, dt, A = torch.randn(Bz, 3, S, **f32), torch.randn(Bz, 3, S, **f32), -torch.rand(3, 2, **f32)
    Bm, Cm, z = torch.randn(Bz, 2, S, **f32), torch.randn(Bz, 2, S, **f32), torch.randn(Bz, 3, S, **f32)
    mine = mt.selective_scan(*(t[..., idx] for t in (x, dt)), A, *(t[..., idx] for t in (Bm, Cm)), D[:3],
                             z[..., idx], bias[:3], True, **call)
    theirs = mamba_selective_scan(x, dt, A, Bm, Cm, D=D[:3], z=z, delta_bias=bias[:3], delta_softplus=True)
    errors["scan"], layouts["scan"] = (mine - theirs[..., idx]).abs().max(), mine
    bad = {name: float(e) for name, e in errors.items() if not e <= 2e-5}
    # contiguous, as transformers' own are: Falcon-H1's mixer calls .view() on what mamba2_chunk_scan returns
    bad.update({name: "not contiguous" for name, t in layouts.items() if not t.is_contiguous()})
    assert not any(comm.allgather(bad)), comm.allgather(bad)


def test_what_mpiring_cannot_run_is_refused_on_every_rank():
    comm = MPI.COMM_WORLD
    n = len(shard_indices(S, comm.size, comm.rank, "contiguous"))
    q = torch.randn(1, n, 2, 3, dtype=torch.float64)
    beta = torch.rand(1, n, 2, dtype=torch.float64)
    state = torch.zeros(1, 2, 3, 3, dtype=torch.float64) if comm.rank == comm.size - 1 else None
    ssd = (q, -beta, -torch.ones(2, dtype=torch.float64), q[:, :, :1], q[:, :, :1])  # x, dt, A, B, C (1 group)
    messages = []
    for call in (lambda: mt.chunk_gated_delta_rule(q, q, q, -beta, beta, initial_state=state, comm=comm, seq_len=S),
                 lambda: mt.causal_conv1d(q[..., 0, :].transpose(1, 2), torch.ones(3, 4, dtype=torch.float64),
                                          activation="gelu" if comm.rank == 0 else "silu", comm=comm, seq_len=S),
                 lambda: mt.linear_attention(q.int() if comm.rank == 0 else q, q, q, comm=comm, seq_len=S),
                 lambda: mt.linear_attention(q, q, q, problem="a planted problem" if comm.rank == comm.size - 1 else
                                             None, comm=comm, seq_len=S),
                 lambda: mt.mamba_chunk_scan(*ssd, dt_limit=None if comm.rank == 0 else (0.0, 1.0), comm=comm,
                                             seq_len=S),
                 lambda: mt.mamba_chunk_scan(*ssd, z=ssd[0] if comm.rank == 0 else None, comm=comm, seq_len=S)):
        try:
            call()
            messages.append(None)
        except ValueError as exc:
            messages.append(str(exc))
    every = comm.allgather(messages)
    assert all(m == every[0] for m in every) and all(every[0]), every
    assert "initial_state" in every[0][0] and "activation='gelu'" in every[0][1] and "int32" in every[0][2]
    assert "a planted problem" in every[0][3]  # one rank's problem= (mpiring.hf's padding mask): every rank's error
    assert "time_step_limit=None" in every[0][4] and "z=" in every[0][5]
