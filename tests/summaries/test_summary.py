"""Exact-string and field tests of mldebug.summaries across the dtype/layout zoo."""
import collections
import importlib
import json
import math
import warnings

import numpy as np
import pytest
import torch

from mldebug.summaries import describe, has_nonfinite, nonfinite_counts, short_dtype, summary

S = importlib.import_module("mldebug.summaries.compute")       # PIECE, _reduce
T = importlib.import_module("mldebug.summaries.tensor_summary")  # HIST_BINS
D = importlib.import_module("mldebug.summaries.describe")        # REPR_MAX, DESCRIBE_WIDTH
NAN, INF = math.nan, math.inf


def ramp(n=20):
    return torch.arange(n) / 8 - 1


def bad3x3():
    return torch.tensor([[1., NAN, 3.], [INF, -INF, 0.], [NAN, 2., 5.]])


def sparse_src():
    d = torch.zeros(100, 100)
    d[3, 4], d[50, 7], d[20, 1] = 1.0, NAN, -2.0
    return d


def fake():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        return torch.randn(3, 4)


def csr(d):
    with warnings.catch_warnings():  # "sparse CSR support is in beta"
        warnings.simplefilter("ignore")
        return d.to_sparse_csr()


ZOO = [
    (lambda: torch.arange(12.).reshape(3, 4) / 4 - 1,
     "tensor[3, 4] f32 n=12 (48b) x∈[-1.000, 1.750] μ=0.375 σ=0.901"),
    (lambda: torch.randn(3, 196, 196, generator=torch.Generator().manual_seed(0)),
     "tensor[3, 196, 196] f32 n=115248 (450Kb) x∈[-4.343, 4.563] μ=-0.002 σ=1.001"),
    (lambda: ramp().half(), "tensor[20] f16 n=20 (40b) x∈[-1.000, 1.375] μ=0.188 σ=0.740"),
    (lambda: ramp().bfloat16(), "tensor[20] bf16 n=20 (40b) x∈[-1.000, 1.375] μ=0.188 σ=0.740"),
    (lambda: ramp().to(torch.float8_e4m3fn),
     "tensor[20] f8e4m3 n=20 (20b) x∈[-1.000, 1.375] μ=0.188 σ=0.740"),
    (lambda: ramp().to(torch.float8_e5m2),
     "tensor[20] f8e5m2 n=20 (20b) x∈[-1.000, 1.500] μ=0.188 σ=0.743"),
    (lambda: torch.arange(100, dtype=torch.float64) / 10,
     "tensor[100] f64 n=100 (800b) x∈[0.000, 9.900] μ=4.950 σ=2.901"),
    (lambda: torch.arange(-5, 15), "tensor[20] i64 n=20 (160b) x∈[-5, 14] μ=4.500 σ=5.916"),
    (lambda: torch.arange(200, dtype=torch.uint8),
     "tensor[200] u8 n=200 (200b) x∈[0, 199] μ=99.500 σ=57.879"),
    (lambda: torch.arange(10), "tensor[10] i64 x∈[0, 9] μ=4.500 σ=3.028 [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]"),
    (lambda: torch.arange(20) % 3 == 0, "tensor[20] bool n=20 (20b) True=7 (35.0%)"),
    (lambda: torch.tensor([True, False, True]), "tensor[3] bool True=2 (66.7%) [True, False, True]"),
    (lambda: torch.tensor([3 + 4j, 1j, -1 + 0j]),
     "tensor[3] c64 |x|∈[1.000, 5.000] μ=2.333 σ=2.309 [3+4j, 0+1j, -1+0j]"),
    (lambda: torch.arange(30, dtype=torch.float64) * (1 + 1j),
     "tensor[30] c128 n=30 (480b) |x|∈[0.000, 41.012] μ=20.506 σ=12.450"),
    (lambda: torch.zeros(0, 3), "tensor[0, 3] f32 empty"),
    (lambda: torch.tensor(2.5), "tensor[] f32 2.5"),
    (lambda: torch.tensor([1., 2., 3.]), "tensor[3] f32 x∈[1.000, 3.000] μ=2.000 σ=1.000 [1., 2., 3.]"),
    (lambda: torch.arange(12.).reshape(3, 4).t(),
     "tensor[4, 3] f32 n=12 (48b) x∈[0.000, 11.000] μ=5.500 σ=3.606"),
    (lambda: torch.arange(100.).reshape(10, 10)[::2, 1::3],
     "tensor[5, 3] f32 n=15 (60b) x∈[1.000, 87.000] μ=44.000 σ=29.387"),
    (lambda: torch.empty(3, 4, device="meta"), "tensor[3, 4] f32 n=12 (48b) meta"),
    (fake, "tensor[3, 4] f32 n=12 (48b) fake"),
    (lambda: sparse_src().to_sparse(),
     "tensor[100, 100] f32 n=10000 (60b) sparse_coo: stats of 3 stored values "
     "x∈[-2.000, 1.000] μ=-0.500 σ=2.121 NaN!1"),
    (lambda: csr(sparse_src()),
     "tensor[100, 100] f32 n=10000 (844b) sparse_csr: stats of 3 stored values "
     "x∈[-2.000, 1.000] μ=-0.500 σ=2.121 NaN!1"),
    (bad3x3, "tensor[3, 3] f32 x∈[0.000, 5.000] μ=2.200 σ=1.924 NaN!2 +Inf!1 -Inf!1 "
             "[[1., nan, 3.], [inf, -inf, 0.], [nan, 2., 5.]]"),
    (lambda: torch.zeros(100), "tensor[100] f32 n=100 (400b) x∈[0.000, 0.000] μ=0.000 σ=0.000 all zeros"),
    (lambda: torch.full((100,), 1e30), "tensor[100] f32 n=100 (400b) x∈[1.000e+30, 1.000e+30] "
                                       "μ=1.000e+30 σ=0.000"),
    (lambda: np.arange(12.).reshape(3, 4), "ndarray[3, 4] f64 n=12 (96b) x∈[0.000, 11.000] μ=5.500 σ=3.606"),
    (lambda: np.arange(6, dtype=np.int32), "ndarray[6] i32 x∈[0, 5] μ=2.500 σ=1.871 [0, 1, 2, 3, 4, 5]"),
    (lambda: np.array([True, False]), "ndarray[2] bool True=1 (50.0%) [True, False]"),
    (lambda: np.array([1., NAN, INF] * 5), "ndarray[15] f64 n=15 (120b) x∈[1.000, 1.000] μ=1.000 "
                                           "σ=0.000 NaN!5 +Inf!5"),
    (lambda: np.arange(20, dtype=np.float16)[::-1], "ndarray[20] f16 n=20 (40b) x∈[0.000, 19.000] "
                                                    "μ=9.500 σ=5.916"),
    (lambda: np.arange(20, dtype=np.uint64), "ndarray[20] u64 n=20 (160b) x∈[0, 19] μ=9.500 σ=5.916"),
    (lambda: np.array([1, "a", None], dtype=object), "ndarray[3] object no numeric stats [1, 'a', None]"),
    (lambda: np.array(["ab", "c"]), "ndarray[2] U2 no numeric stats ['ab', 'c']"),
    (lambda: np.zeros(3, dtype=[("a", "i4"), ("b", "f4")]),
     "ndarray[3] struct{a,b} no numeric stats [(0, 0.0), (0, 0.0), (0, 0.0)]"),
    (lambda: np.float16(1.5), "ndarray[] f16 1.5"),
]


@pytest.mark.parametrize("make,expected", ZOO, ids=[e.split(" n=")[0][:40] for _, e in ZOO])
def test_one_line(make, expected):
    assert str(summary(make())) == expected


def test_grad_markers_and_grad_summary():
    a = torch.tensor([1., 2., 3.], requires_grad=True)
    b = a * 2
    assert str(summary(a)) == "tensor[3] f32 x∈[1.000, 3.000] μ=2.000 σ=1.000 grad [1., 2., 3.]"
    assert str(summary(b)) == ("tensor[3] f32 x∈[2.000, 6.000] μ=4.000 σ=2.000 "
                               "grad_fn=MulBackward0 [2., 4., 6.]")
    assert summary(b).grad_fn == "MulBackward0" and summary(a).grad is None
    b.sum().backward()
    s = summary(a)
    assert str(s.grad) == "tensor[3] f32 x∈[2.000, 2.000] μ=2.000 σ=0.000 [2., 2., 2.]"
    assert ".grad: tensor[3] f32" in s.format_long()
    assert s.to_dict()["grad"]["values"] == [2.0, 2.0, 2.0]


def test_nonfinite_fields():
    s = summary(bad3x3())
    assert (s.nan, s.posinf, s.neginf, s.zeros) == (2, 1, 1, 1)
    assert (s.min, s.max) == (0.0, 5.0)  # finite values only
    assert s.first_nonfinite == (0, 1)
    assert nonfinite_counts(bad3x3()) == (2, 1, 1)
    assert nonfinite_counts(np.array([NAN, -INF])) == (1, 0, 1)
    assert has_nonfinite(bad3x3()) and not has_nonfinite(torch.ones(3))
    assert sum(s.hist) == 5 and s.hist_range == (0.0, 5.0)


def test_all_nonfinite_has_no_stats():
    s = summary(torch.full((4,), NAN))
    assert (s.nan, s.min, s.mean, s.std, s.hist) == (4, None, None, None, None)
    assert str(s) == "tensor[4] f32 NaN!4 [nan, nan, nan, nan]"


def test_large_with_nans_and_first_index():
    x = torch.arange(1 << 20, dtype=torch.float32).reshape(1024, 1024)
    x[700, 3], x[900, 5], x[1000, 0] = NAN, INF, -INF
    s = summary(x)
    assert (s.nan, s.posinf, s.neginf, s.first_nonfinite) == (1, 1, 1, (700, 3))
    assert s.hist_sampled and s.min == 0.0 and s.max == (1 << 20) - 1
    t = summary(x.t())  # non-contiguous, row-major order of the transposed view
    assert t.first_nonfinite == (0, 1000) and not t.contiguous
    assert summary(x[:, ::2]).first_nonfinite == (1000, 0)


@pytest.mark.parametrize("piece", [7, 1000, 1 << 20])
def test_piecewise_offsets(monkeypatch, piece):
    """Pieces of any size give the same counts, stats and first index (row-major)."""
    monkeypatch.setattr(S, "PIECE", piece)
    x = torch.arange(6000, dtype=torch.float64).reshape(60, 100) % 17 - 3
    x[41, 7], x[42, 0], x[59, 99] = INF, NAN, -INF
    for view, first in ((x, (41, 7)), (x.t(), (0, 42)), (x[:, 1::2], (41, 3))):
        s = summary(view)
        fin = view[torch.isfinite(view)]
        assert s.first_nonfinite == first
        assert (s.min, s.max, s.zeros) == (fin.min().item(), fin.max().item(), (fin == 0).sum().item())
        assert s.mean == pytest.approx(fin.mean().item()) and s.std == pytest.approx(fin.std().item())


def test_first_nonfinite_sparse():
    assert summary(sparse_src().to_sparse()).first_nonfinite == (50, 7)
    assert summary(csr(sparse_src())).first_nonfinite == (50, 7)
    assert summary(sparse_src().to_sparse()).zeros == 9997


def test_matches_reference_stats():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(300_000, generator=g) * 3 + 1
    s = summary(x)
    d = x.double()
    assert s.mean == pytest.approx(d.mean().item(), rel=1e-5)
    assert s.std == pytest.approx(d.std().item(), rel=1e-5)
    assert (s.min, s.max) == (x.min().item(), x.max().item())
    assert s.hist_sampled and len(s.hist) == T.HIST_BINS


def test_cancellation_and_overflow_fall_back_to_exact():
    x = torch.full((10_000,), 1e4) + torch.arange(10_000) % 2 * 1e-2  # |mean| >> std
    assert summary(x).std == pytest.approx(torch.std(x.double()).item(), rel=1e-3)
    y = torch.full((1000,), 3e38)
    y[0] = -3e38  # finite values whose float32 sum of squares overflows
    s = summary(y)
    assert s.nan == s.posinf == 0 and math.isfinite(s.std)
    assert s.mean == pytest.approx(y.double().mean().item(), rel=1e-6)


@pytest.mark.parametrize("make", [
    lambda: torch.randn(1000, generator=torch.Generator().manual_seed(2)),
    bad3x3, lambda: ramp().half(), lambda: torch.arange(-5, 15),
    lambda: torch.tensor([3 + 4j, 1j]), lambda: torch.arange(1 << 19, dtype=torch.float32),
])
def test_device_path_agrees_with_host_path(make):
    """The one-transfer path for accelerators, exercised on the CPU."""
    x = make()
    host, _, small_h = S._reduce(x, x.numel() <= 10, device_path=False)
    dev, _, small_d = S._reduce(x, x.numel() <= 10, device_path=True)
    assert dev.keys() == host.keys()
    for k in host:
        assert dev[k] == pytest.approx(host[k], rel=1e-5, nan_ok=True), k
    assert str(small_d) == str(small_h)


def test_to_dict_is_strict_json():
    for make, _ in ZOO:
        d = summary(make()).to_dict()
        json.dumps(d, allow_nan=False)
    d = summary(bad3x3()).to_dict()
    assert d["values"][0] == [1.0, "nan", 3.0] and d["first_nonfinite"] == [0, 1]


def test_format_long():
    text = summary(bad3x3()).format_long()
    assert text.splitlines()[0] == str(summary(bad3x3()))
    assert "non-finite: NaN 2  +Inf 1  -Inf 1; first at [0, 1]" in text
    assert "zeros: 1 (11.1%)" in text
    assert "hist: 0.000 |█   █   █   █      █| 5.000" in text
    big = summary(torch.arange(1 << 19, dtype=torch.float32)).format_long()
    assert "(sample of" in big


def test_never_modifies_input():
    x = torch.randn(1 << 19, generator=torch.Generator().manual_seed(3), requires_grad=True)
    with torch.no_grad():
        x[5] = NAN
    before = x.detach().clone()
    summary(x)
    describe(x)
    assert torch.equal(x.detach().view(torch.int32), before.view(torch.int32))
    assert x.requires_grad and x.grad is None
    a = np.arange(10.)
    a.flags.writeable = False
    summary(a)
    assert a.flags.writeable is False


def test_odd_input_never_raises():
    class Weird(torch.Tensor):
        def __repr__(self):
            raise RuntimeError("boom")
    for obj in [object(), None, "str", Weird(torch.ones(2)), torch.ones(2, 3).to_sparse_csc()]:
        assert isinstance(str(summary(obj)), str)
        assert isinstance(describe(obj), str)
    assert str(summary(3)) == "int[] unavailable: not a tensor or array"


def test_short_dtype_table():
    assert [short_dtype(d) for d in (torch.bfloat16, torch.int8, torch.complex64, np.dtype("u2"))] \
        == ["bf16", "i8", "c64", "u16"]


# ---------------------------------------------------------------------------------- describe
def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))


def test_describe_module_without_grads():
    assert describe(model(), "model") == (
        "model: Sequential (training): 4 parameter tensors, 26 elements, 104b\n"
        "  name      shape   dtype  device  norm   grad norm  flags\n"
        "  0.weight  [4, 3]  f32    cpu     0.924  -\n"
        "  0.bias    [4]     f32    cpu     0.712  -\n"
        "  2.weight  [2, 4]  f32    cpu     0.805  -\n"
        "  2.bias    [2]     f32    cpu     0.096  -")


def test_describe_module_with_grads_and_nan_param():
    m = model()
    m(torch.ones(5, 3)).sum().backward()
    with torch.no_grad():
        m[2].weight[0, 1] = NAN
    lines = describe(m).splitlines()
    assert lines[1].split() == ["name", "shape", "dtype", "device", "norm", "grad", "norm", "flags"]
    assert lines[2] == "  0.weight  [4, 3]  f32    cpu     0.924  3.827"
    assert lines[4] == "  2.weight  [2, 4]  f32    cpu     nan    1.111      NaN!1"
    assert lines[-1] == "  1 parameter tensor(s) with non-finite values"


def test_describe_big_module_is_bounded():
    text = describe(torch.nn.Sequential(*[torch.nn.Linear(2, 2) for _ in range(40)]))
    assert text.endswith("  ... 30 more") and len(text.splitlines()) == 2 + 50 + 1


def test_describe_containers():
    assert describe([torch.arange(3.), 5, "hi", {"a": 1}]) == (
        "list len=4\n"
        "  0: tensor[3] f32 x∈[0.000, 2.000] μ=1.000 σ=1.000 [0., 1., 2.]\n"
        "  1: 5\n"
        "  2: 'hi'\n"
        "  3: dict len=1")
    out = collections.OrderedDict(loss=torch.tensor(0.5), logits=torch.zeros(2, 10))  # ModelOutput-like
    assert describe(out) == (
        "OrderedDict len=2\n"
        "  loss: tensor[] f32 0.5\n"
        "  logits: tensor[2, 10] f32 n=20 (80b) x∈[0.000, 0.000] μ=0.000 σ=0.000 all zeros")
    Pair = collections.namedtuple("Pair", "x y")
    assert describe(Pair(torch.tensor(1.), 2)) == "Pair len=2\n  x: tensor[] f32 1.\n  y: 2"


def test_describe_bounded_and_safe():
    class Bad:
        def __repr__(self):
            raise ValueError("nope")
    assert describe(Bad()) == "<repr failed: ValueError: nope>"
    assert len(describe(list(range(100_000)))) <= D.REPR_MAX
    many = describe([torch.zeros(2)] * 100).splitlines()
    assert len(many) == 1 + 50 + 1 and many[-1] == "  ... 50 more"
    wide = describe({"k": "x" * 10_000}).splitlines()
    assert all(len(line) <= D.DESCRIBE_WIDTH for line in wide)
    assert describe(3.5) == "3.5"
    assert describe(torch.arange(3.)).startswith("tensor[3] f32 x∈[0.000, 2.000]")
