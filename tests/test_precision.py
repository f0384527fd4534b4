"""Half inputs, coded wires and the accumulation knob, in one process: the codec, the simulator, the checks."""

import subprocess
import sys

import numpy as np
import pytest

import mpiring
from mpiring.core.precision import Plain, Precision, Wire, canonical_precision, named_dtype, row_bytes
from mpiring.testing import assert_attention_close, reference, reference_backward, tolerance

from launch import MPIEXEC, clean_env, mpiexec_argv

try:
    import ml_dtypes
except ImportError:  # the bfloat16 cases skip, with the reason, where the `half` extra is not installed
    ml_dtypes = None

BF16 = pytest.param("bfloat16", marks=pytest.mark.skipif(ml_dtypes is None, reason='bfloat16 needs ml_dtypes: '
                                                          'pip install -e ".[half]"'))
FP8 = [pytest.param(name, marks=BF16.marks) for name in ("float8_e4m3", "float8_e5m2")]  # ml_dtypes' too
HALF = ["float16", BF16]
WIRES = ["float16", BF16, "int8", *FP8]


def _inputs(rng, dtype, shape=(2, 37, 16)):
    """Unit-normal q, k, v rounded to ``dtype``, and the same values in float64 (what the reference sees)."""
    arrays = [rng.standard_normal(shape).astype(named_dtype(dtype)) for _ in range(3)]
    return arrays, [a.astype(np.float64) for a in arrays]


@pytest.mark.parametrize("wire", WIRES)
def test_wire_codes_each_row_within_its_step(rng, wire):
    x = rng.standard_normal((3, 2, 50, 64)).astype(np.float32)
    x[0, 0, 3] = 0  # a row of zeros stays zeros
    w = Wire(wire, np.float32)
    coded = w.encode(x)
    scaled = wire in ("int8", "float8_e4m3", "float8_e5m2")
    assert coded.dtype == w.dtype and coded.shape == x.shape[:-1] + (64 + 4 * scaled,)
    back = w.decode(coded)
    assert back.dtype == np.float32 and back.shape == x.shape
    assert np.all(back[0, 0, 3] == 0)
    err = np.abs(back - x)
    peak = np.abs(x).max(axis=-1, keepdims=True)
    if wire == "int8":  # absmax / 127 per token and head, rounded to nearest: at most half a step
        step = peak / 127
        assert np.all(err <= step * 0.5 * (1 + 1e-6)) and np.abs(coded[..., :64]).max() == 127
    elif scaled:  # absmax / 448 (57344): each value one rounding to FP8's 3 (2) mantissa bits, or half its
        top, bits, tiny = {"float8_e4m3": (448, 3, 2.0 ** -9), "float8_e5m2": (57344, 2, 2.0 ** -16)}[wire]
        scale = peak / top  # smallest step (a subnormal) in the scaled units, rounded to nearest
        assert np.all(err <= np.maximum(np.abs(x) * 2.0 ** -(bits + 1), scale * tiny / 2) * (1 + 1e-5) + 1e-30)
        codes = coded[..., :64].view(named_dtype(wire)).astype(np.float32)
        assert np.all(np.abs(codes).max(axis=-1)[peak[..., 0] > 0] == top)  # each row's peak at the top code
        assert np.all(err <= peak * {"float8_e4m3": 1 / 28, "float8_e5m2": 1 / 14}[wire] * (1 + 1e-6))
    else:  # one rounding to the wire's mantissa
        eps = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}[wire]
        assert np.all(err <= np.abs(x) * eps)
    padded = w.decode_padded(coded)  # as the forward kernel takes a block: [x | 1]^T
    np.testing.assert_array_equal(padded[..., :64, :], np.swapaxes(back, -1, -2))
    assert np.all(padded[..., 64, :] == 1)


@pytest.mark.parametrize("wire", [None, *WIRES])
def test_own_blocks_stay_exact_and_arrived_ones_are_decoded(rng, wire):
    """``own`` is the input in the compute dtype (the forward's [x | 1]^T too), ``arrived`` the decoded wire
    form; ``row_bytes`` (the byte predictions') counts a row as ``Wire.row_bytes`` does."""
    x = rng.standard_normal((2, 5, 8)).astype(np.float32)
    w = Wire(wire, np.float32)
    (mine,), (opened,) = w.own((x,)), w.own((x,), padded=True)
    np.testing.assert_array_equal(mine, x)
    np.testing.assert_array_equal(opened[..., :8, :], np.swapaxes(x, -1, -2))
    assert np.all(opened[..., 8, :] == 1) and opened.dtype == np.float32
    (back,), (padded,) = w.arrived((w.encode(x),)), w.arrived((w.encode(x),), padded=True)
    np.testing.assert_array_equal(back, w.decode(w.encode(x)))
    np.testing.assert_array_equal(padded, w.decode_padded(w.encode(x)) if w.coded else w.encode(x))
    assert (wire is None) == np.array_equal(back, x)  # a coded wire changed something
    assert w.encode(x).nbytes == 10 * row_bytes(wire, 8, 4) == 10 * w.row_bytes(8)  # 10 rows of 8 values
    assert row_bytes(wire, 8, 8) == Wire(wire, np.float64).row_bytes(8)
    assert Plain(np.float16).encode(x).dtype == np.float16 and Plain(np.float16).kept(x).dtype == np.float16


def test_uncoded_wire_is_the_array_itself():
    x = np.ones((2, 3), np.float32)
    w = Wire(None, np.float32)
    assert not w.coded and w.encode(x) is x and w.decode(x) is x
    assert Wire(None, np.float16).coded  # half inputs are widened on arrival


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_simulator_takes_half_inputs(rng, dtype, P):
    """Tiles in float32; out in the input dtype, lse in float32; within the dtype's tolerance of float64."""
    (Q, K, V), exact = _inputs(rng, dtype)
    out, lse, _ = mpiring.simulate(Q, K, V, P, causal=True, layout="zigzag")
    assert out.dtype == named_dtype(dtype) and lse.dtype == np.float32
    ref, ref_lse = reference(*exact, causal=True)
    assert_attention_close(out, ref, named_dtype(dtype))
    assert_attention_close(lse, ref_lse, np.float32)  # lse stays in float32: its error is float32's


@pytest.mark.usefixtures("each_kernel")
@pytest.mark.parametrize("dtype", HALF)
def test_block_kernels_compute_half_inputs_in_float32(rng, dtype):
    """attention_block(_backward) on half inputs: float32 tiles and results, within the dtype's tolerance."""
    (q, k, v), exact = _inputs(rng, dtype, (2, 300, 16))
    dout = rng.standard_normal(q.shape).astype(q.dtype)
    out, lse = mpiring.attention_block(q, k, v)
    assert out.dtype == lse.dtype == np.float32
    ref, ref_lse = reference(*exact)
    assert_attention_close(out, ref, q.dtype)
    assert_attention_close(lse, ref_lse, np.float32)
    grads = mpiring.attention_block_backward(dout, q, k, v, out, lse)
    want = mpiring.reference_attention_backward(dout.astype(np.float64), *exact)
    for got, ref, name in zip(grads, want, ("dq", "dk", "dv")):
        assert got.dtype == np.float32
        assert_attention_close(got, ref, q.dtype, name)


@pytest.mark.parametrize("wire", WIRES)
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_simulator_wire_error_within_its_bound(rng, wire, dtype):
    (Q, K, V), exact = _inputs(rng, dtype, (2, 64, 32))
    ref, _ = reference(*exact, causal=True)
    out, _, _ = mpiring.simulate(Q, K, V, 4, causal=True, layout="zigzag", wire_dtype=wire)
    error = assert_attention_close(out, ref, np.dtype(dtype), wire=wire)
    assert error > 10 * tolerance(dtype)  # the coding did happen: far above the dtype's own error
    one, _, _ = mpiring.simulate(Q, K, V, 1, causal=True, wire_dtype=wire)
    assert_attention_close(one, ref, np.dtype(dtype))  # nothing travels at P = 1: exact


def test_accumulate_sets_the_running_dtype_and_input_grows_the_error(rng):
    """bfloat16 out kept in bfloat16 between blocks (accumulate='input') rounds at every merge."""
    if ml_dtypes is None:
        pytest.skip('bfloat16 needs ml_dtypes: pip install -e ".[half]"')
    (Q, K, V), exact = _inputs(rng, "bfloat16", (4, 480, 32))
    ref, _ = reference(*exact, causal=True)
    mean = {}
    for accumulate in ("float64", "float32", "input"):
        out, lse, _ = mpiring.simulate(Q, K, V, 8, causal=True, layout="zigzag", accumulate=accumulate)
        assert out.dtype == Q.dtype and lse.dtype == np.float32
        assert_attention_close(out, ref, Q.dtype)
        mean[accumulate] = float(np.mean(np.abs(out.astype(np.float64) - ref)))
    assert mean["float32"] == pytest.approx(mean["float64"], rel=0.05)
    assert mean["input"] > 1.3 * mean["float64"]
    assert Precision(np.float32, accumulate="float32").out == np.float32
    assert Precision(Q.dtype, accumulate="input").out == Q.dtype
    assert Precision(Q.dtype, accumulate="input").lse == np.float32


@pytest.mark.parametrize("options,message", [
    ({"wire_dtype": "int4"}, "wire_dtype must be None or one of 'float16', 'bfloat16', 'int8', 'float8_e4m3', "
                             "'float8_e5m2'; got 'int4'"),
    ({"wire_dtype": "float8_e4m3fn"}, "wire_dtype must be None or one of"),  # ml_dtypes' name: ours is shorter
    ({"wire_dtype": np.float16}, "wire_dtype must be None or one of"),
    ({"grad_wire_dtype": "float16"}, "grad_wire_dtype must be None or one of 'float32', 'float64'; got 'float16'"),
    ({"accumulate": None}, "accumulate must be one of 'float64', 'float32', 'input'; got None"),
    ({"accumulate": "bf16"}, "accumulate must be one of 'float64', 'float32', 'input'; got 'bf16'"),
])
def test_bad_precision_options(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        canonical_precision(options)
    with pytest.raises(ValueError, match="must"):
        mpiring.simulate(*np.ones((3, 4, 2)), 2, **{k: v for k, v in options.items() if k != "grad_wire_dtype"}
                         or {"accumulate": "x"})


def test_gradient_partials_travel_in_float32_by_default():
    assert Precision(np.float32).grad == np.float32 and Precision(np.float16).grad == np.float32
    assert Precision(np.float64).grad == np.float64
    assert Precision(np.float64, grad_wire_dtype="float32").grad == np.float32


@pytest.mark.skipif(MPIEXEC is None, reason="no mpiexec on PATH")
def test_run_command_with_half_inputs_and_int8_wire():
    """`run --dtype bfloat16 --wire-dtype int8 --backward` verifies out, lse and the gradients, bytes as predicted."""
    dtype = "bfloat16" if ml_dtypes is not None else "float16"
    cmd = mpiexec_argv(2, sys.executable, "-m", "mpiring", "run", "--seq-len", "96", "--heads", "2", "--dim", "32",
                       "--causal", "--layout", "zigzag", "--dtype", dtype, "--wire-dtype", "int8", "--backward")
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=clean_env())
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert out.count("VERIFIED") == 1 and "K/V on the wire: int8 (+ a float32 scale per token and head), " \
        "0.281x the bytes of float32" in out and "dK/dV partials on the wire: float32" in out
    assert f"tolerance {tolerance(dtype, 'int8'):g}" in out and "; mean " in out


@pytest.mark.parametrize("wire", ["float8_e4m3", "float8_e5m2", "bfloat16"])
def test_a_wire_ml_dtypes_lacks_is_refused_by_name(monkeypatch, wire):
    """Without ml_dtypes, or with an ml_dtypes that has not the type: a ValueError naming what is missing."""
    import importlib
    import sys

    monkeypatch.setitem(sys.modules, "ml_dtypes", None)  # import ml_dtypes raises ImportError
    with pytest.raises(ValueError, match=f"{wire} needs the ml_dtypes package"):
        canonical_precision({"wire_dtype": wire})
    monkeypatch.setitem(sys.modules, "ml_dtypes", type(sys)("ml_dtypes"))  # an ml_dtypes without the type
    name = {"float8_e4m3": "float8_e4m3fn", "float8_e5m2": "float8_e5m2", "bfloat16": "bfloat16"}[wire]
    with pytest.raises(ValueError, match=f"{wire} needs ml_dtypes.{name}, which ml_dtypes \\? lacks"):
        canonical_precision({"wire_dtype": wire})
    with pytest.raises(ValueError, match=f"{wire} needs ml_dtypes.{name}"):
        mpiring.simulate(*[np.ones((4, 8))] * 3, 2, wire_dtype=wire)
    assert importlib.import_module("numpy") is np  # nothing else disturbed


@pytest.mark.parametrize("wire", FP8)
def test_fp8_error_grows_with_p_and_stays_in_its_bound(wire):
    """The accuracy command's measurement (``error_growth``): nothing coded at P = 1; out and the gradients
    within the wire's ``TOLERANCE`` at P = 2, 4, 8; e5m2 (2 mantissa bits) coarser than e4m3 (3) and int8."""
    from mpiring.tools.bench.accuracy import error_growth

    got = error_growth(96, 2, 32, [1, 2, 4, 8], "float32", "float64", causal=True, wire_dtype=wire, backward=True)
    (out1, _), (grad1, _) = got[1]
    assert out1 < tolerance("float32") and grad1 < tolerance("float32")
    for P in (2, 4, 8):
        (out, _), (grad, _) = got[P]
        assert out > 1e-3 and grad > 1e-3  # coded: far above float32's error
        assert out <= tolerance("float32", wire) and grad <= tolerance("float32", wire)
    int8 = error_growth(96, 2, 32, [4], "float32", "float64", causal=True, wire_dtype="int8", backward=True)[4]
    assert got[4][0][1] > int8[0][1] and got[4][1][1] > int8[1][1]  # mean errors: FP8 coarser than int8


def test_simulated_backward_is_the_rings(rng):
    """``simulate_backward``: float64 within 1e-12 of the reference for every ring mode at P = 1..4, and a coded
    wire's gradients within its bound and far from the uncoded ones."""
    from mpiring.simulate import simulate_backward

    Q, K, V, dO = (rng.standard_normal(s) for s in [(2, 4, 29, 8), (2, 2, 29, 8), (2, 2, 29, 8), (2, 4, 29, 8)])
    want = reference_backward(dO, Q, K, V, causal=True)
    for P in (1, 2, 3, 4):
        for mode in ("ring", "bidirectional", "allgather"):
            out, lse, _ = mpiring.simulate(Q, K, V, P, causal=True, layout="zigzag", mode=mode)
            grads = simulate_backward(dO, Q, K, V, out, lse, P, causal=True, layout="zigzag", mode=mode)
            for got, ref, name in zip(grads, want, ("dq", "dk", "dv")):
                assert_attention_close(got, ref, np.float64, name)
    coded = simulate_backward(dO, Q, K, V, out, lse, 4, causal=True, layout="zigzag", wire_dtype="int8")
    for got, ref, name in zip(coded, want, ("dq", "dk", "dv")):
        assert tolerance(np.float64) * 100 < assert_attention_close(got, ref, np.float64, name, "int8")


def test_each_rank_sums_its_gradients_in_the_wider_of_the_partials_and_compute_dtypes():
    assert Precision(np.float32).sums == np.float32 and Precision(np.float16).sums == np.float32
    assert Precision(np.float64).sums == np.float64
    assert Precision(np.float32, grad_wire_dtype="float64").sums == np.float64
    assert Precision(np.float64, grad_wire_dtype="float32").sums == np.float64  # the float64 tolerance holds


@pytest.mark.parametrize("dtype, sums", [("float32", np.float32), ("float64", np.float64)])
def test_dq_is_its_blocks_summed_in_ring_order_in_the_sums_dtype(rng, dtype, sums):
    """dq of a rank at P = 4 (full mask, contiguous: rank r meets blocks r, r-1, r-2, r-3) is its four block
    gradients added one after another in ``Precision.sums``, bit for bit; float32 inputs are not summed in
    float64 (those bits differ somewhere)."""
    from mpiring.simulate import simulate_backward

    P, n = 4, 24
    Q, K, V, dO = (rng.standard_normal((2, 3, P * n, 8)).astype(dtype) for _ in range(4))
    out, lse, _ = mpiring.simulate(Q, K, V, P)
    dq = simulate_backward(dO, Q, K, V, out, lse, P)[0]
    wider_differs = False
    for r in range(P):
        rows = mpiring.shard_indices(P * n, P, r, "contiguous")
        do, q, o, lr = dO[..., rows, :], Q[..., rows, :], out[..., rows, :], lse[..., rows]
        delta = np.einsum("...d,...d->...", do, o, dtype=np.float64).astype(dtype)
        parts = [mpiring.attention_block_backward(do, q, K[..., keys, :], V[..., keys, :], o, lr, delta=delta)[0]
                 for keys in (mpiring.shard_indices(P * n, P, (r - s) % P, "contiguous") for s in range(P))]
        total = np.zeros(q.shape, sums)
        for part in parts:
            total += part
        np.testing.assert_array_equal(dq[..., rows, :], total.astype(dtype))
        wide = np.zeros(q.shape, np.float64)
        for part in parts:
            wide += part
        wider_differs |= not np.array_equal(wide.astype(dtype), total.astype(dtype))
    assert wider_differs == (dtype == "float32")


@pytest.mark.parametrize("P", [8, 16])
def test_float32_sums_keep_the_float32_tolerance_at_large_p(rng, P):
    from mpiring.simulate import simulate_backward

    Q, K, V, dO = (rng.standard_normal((2, 2, 5 * P + 3, 16)).astype(np.float32) for _ in range(4))
    want = reference_backward(*(a.astype(np.float64) for a in (dO, Q, K, V)), causal=True)
    out, lse, _ = mpiring.simulate(Q, K, V, P, causal=True, layout="zigzag")
    for got, ref, name in zip(simulate_backward(dO, Q, K, V, out, lse, P, causal=True, layout="zigzag"), want,
                              ("dq", "dk", "dv")):
        assert got.dtype == np.float32
        assert_attention_close(got, ref, np.float32, f"{name} at P = {P}")
