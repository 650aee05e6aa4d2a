"""sattn.torch against PyTorch 2.x: scaled_dot_product_attention's outputs and gradients against torch's own SDPA and
torch autograd (masks, GQA, both causal alignments, scale, key padding, dropout with sattn's keep decisions),
gradcheck in float64, opcheck on every operator, torch.compile (fullgraph, dynamic), torch.export, autocast,
half precision, errors; sparse_attention, flash_attn_varlen_func, MultiheadAttention and use_sattn."""
import math

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch not importable: sattn.torch NOT tested")

import torch.nn.functional as F  # noqa: E402

import sattn  # noqa: E402
import sattn.torch as st  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_one_thread")


@pytest.fixture(scope="module")
def torch_one_thread():
    """Small problems: one thread each for torch and sattn (thread-count independence is tested below)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).abs().max() / max(1.0, b.abs().max().item())).item()


def leaves(*xs):
    return [x.detach().clone().requires_grad_(True) for x in xs]


def grads_of(fn, inputs, seed=0):
    """fn's output and the gradients of <out, g> for a fixed random g, for every input that requires grad."""
    out = fn(*inputs)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(out.dtype)
    grads = torch.autograd.grad(out, [x for x in inputs if x is not None and x.requires_grad], g)
    return out, grads


def qkv(B=2, Hq=4, Hkv=4, Lq=33, Lk=47, E=16, Ev=12, dtype=torch.float32, seed=0, lead=None):
    gen = torch.Generator().manual_seed(seed)
    lead = (B,) if lead is None else lead
    q = torch.randn(*lead, Hq, Lq, E, generator=gen, dtype=torch.float64).to(dtype)
    k = torch.randn(*lead, Hkv, Lk, E, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(*lead, Hkv, Lk, Ev, generator=gen, dtype=torch.float64).to(dtype)
    return q, k, v


# ---- scaled_dot_product_attention against torch's SDPA ------------------------------------------------------------

MASKS = ["none", "bool_2d", "float_2d", "float_bcast_lk", "float_4d", "bool_4d_bcast"]


def make_mask(kind, B, H, Lq, Lk, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    if kind == "none":
        return None
    if kind == "bool_2d":
        m = torch.rand(Lq, Lk, generator=gen) > 0.3
        m[:, 0] = True  # no fully masked rows: torch's math path would differ in the gradient only by NaN handling
        return m
    if kind == "float_2d":
        return torch.randn(Lq, Lk, generator=gen, dtype=torch.float64).to(dtype)
    if kind == "float_bcast_lk":
        return torch.randn(H, Lq, 1, generator=gen, dtype=torch.float64).to(dtype)
    if kind == "float_4d":
        return torch.randn(B, H, Lq, Lk, generator=gen, dtype=torch.float64).to(dtype)
    m = torch.rand(B, 1, Lq, Lk, generator=gen) > 0.3
    m[..., 0] = True
    return m


# torch refuses is_causal with attn_mask (sattn intersects them: tested against the manual oracle below).
SDPA_CASES = [(m, gqa, causal, scale) for m in MASKS
              for gqa, causal, scale in [(False, False, None), (True, False, 0.3), (False, True, None),
                                         (True, True, 0.7)] if not (causal and m != "none")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mask_kind,gqa,causal,scale", SDPA_CASES)
def test_sdpa_matches_torch(dtype, mask_kind, gqa, causal, scale):
    q, k, v = qkv(Hq=4, Hkv=2 if gqa else 4, dtype=dtype)
    mask = make_mask(mask_kind, 2, 4, 33, 47, dtype)
    ins = leaves(q, k, v) + ([mask.requires_grad_(True)] if mask is not None and mask.is_floating_point()
                             else [])
    m = ins[3] if len(ins) == 4 else mask
    kw = dict(attn_mask=m, is_causal=causal, scale=scale, enable_gqa=gqa)
    out, g = grads_of(lambda *a: st.scaled_dot_product_attention(*a[:3], **kw), ins)
    ref, gr = grads_of(lambda *a: F.scaled_dot_product_attention(*a[:3], **kw), ins)
    tol = 2e-6 if dtype == torch.float32 else 1e-12
    assert out.dtype == dtype and rel_err(out, ref) <= tol
    for name, a, b in zip(["dq", "dk", "dv", "dmask"], g, gr):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert rel_err(a, b) <= 4 * tol, (name, rel_err(a, b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask_kind", ["float_2d", "float_bcast_lk", "float_4d"])
def test_half_precision_masks_match_their_float32_values(dtype, mask_kind):
    """A bf16 / float16 attn_mask (torch's own SDPA takes it in the query's dtype) reaches the kernels as it is: the
    same output and q/k/v gradients as its values in float32, and its gradient in its own dtype, the float32 one
    rounded (within a unit of the last place). Keys masked with -inf stay masked."""
    q, k, v = qkv(Lq=70, Lk=90, dtype=dtype)
    mask = make_mask(mask_kind, 2, 4, 70, 90, torch.float32)
    if mask.shape[-1] > 1:
        mask[..., 5::7] = float("-inf")
    half = mask.to(dtype)
    runs = {}
    for name, m in (("half", half), ("wide", half.float())):
        ins = leaves(q, k, v) + [m.clone().requires_grad_(True)]
        runs[name] = grads_of(lambda *a: st.scaled_dot_product_attention(*a[:3], attn_mask=a[3]), ins)
    (out, g), (out32, g32) = runs["half"], runs["wide"]
    assert torch.equal(out, out32)
    for a, b in zip(g[:3], g32[:3]):
        assert torch.equal(a, b)
    dmask, dmask32 = g[3].double(), g32[3].double()
    assert g[3].dtype == dtype and g[3].shape == half.shape
    ulp = 2.0 ** -8 if dtype == torch.bfloat16 else 2.0 ** -11
    assert torch.all((dmask - dmask32).abs() <= ulp * dmask32.abs() + 2.0 ** -24)
    assert (dmask32 != 0).double().mean() > 0.5
    if mask.shape[-1] > 1:
        assert torch.all(dmask32[..., 5::7] == 0)
    # torch's SDPA on the same half-precision inputs agrees to half precision
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=half)
    assert rel_err(out, ref) <= (2e-2 if dtype == torch.bfloat16 else 4e-3)
    if dtype == torch.float16:  # numpy float16 masks too
        o16 = sattn.scaled_dot_product_attention(q.numpy(), k.numpy(), v.numpy(), attn_mask=half.numpy())
        o32 = sattn.scaled_dot_product_attention(q.numpy(), k.numpy(), v.numpy(), attn_mask=half.float().numpy())
        assert np.array_equal(o16, o32)


def manual_attention(q, k, v, bias=None, scale=None, keep=None, p=0.0):
    """float64 attention by torch autograd: the oracle for sattn's extensions. Rows with no allowed key give 0."""
    g = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(g, -3), v.repeat_interleave(g, -3)
    s = q @ k.transpose(-2, -1) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if bias is not None:
        s = s + bias
    live = torch.isfinite(s).any(-1, keepdim=True)
    w = torch.softmax(torch.where(live, s, torch.zeros_like(s)), -1) * live
    if keep is not None:
        w = w * keep / (1 - p)
    return w @ v


def causal_bias(Lq, Lk, alignment):
    diag = 0 if alignment == "top_left" else Lk - Lq
    return torch.zeros(Lq, Lk, dtype=torch.float64).masked_fill(
        ~torch.ones(Lq, Lk, dtype=torch.bool).tril(diag), float("-inf"))


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("Lq,Lk", [(33, 47), (47, 33), (1, 64)])
def test_causal_alignments_padding_and_mask_intersection(alignment, Lq, Lk):
    q, k, v = qkv(Lq=Lq, Lk=Lk, dtype=torch.float64, seed=3)
    mask = torch.randn(Lq, Lk, dtype=torch.float64)
    kpm = torch.zeros(2, Lk, dtype=torch.bool)
    kpm[1, Lk // 2:] = True
    ins = leaves(q, k, v, mask)
    out, g = grads_of(lambda *a: st.scaled_dot_product_attention(
        *a[:3], attn_mask=a[3], is_causal=True, causal_alignment=alignment, key_padding_mask=kpm), ins)
    bias = causal_bias(Lq, Lk, alignment) + torch.where(kpm, float("-inf"), 0.0).double()[:, None, None, :]
    ref, gr = grads_of(lambda *a: manual_attention(*a[:3], bias=bias + a[3]), ins)
    assert rel_err(out, ref) <= 1e-12
    for a, b in zip(g, gr):
        assert rel_err(a, b) <= 1e-11


def test_leading_dims_and_unbatched_forms():
    q, k, v = qkv(lead=(2, 3), Hq=2, Hkv=2, Lq=5, Lk=6, E=4, Ev=4, dtype=torch.float64)
    mask = torch.randn(3, 1, 5, 6, dtype=torch.float64, requires_grad=True)
    out = st.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert out.shape == (2, 3, 2, 5, 4) and rel_err(out, ref) <= 1e-12
    (dm,) = torch.autograd.grad(out.sum(), mask)
    (dr,) = torch.autograd.grad(ref.sum(), mask)
    assert rel_err(dm, dr) <= 1e-11
    for x in ((q[0, 0], k[0, 0], v[0, 0]), (q[0, 0, 0], k[0, 0, 0], v[0, 0, 0])):  # 3-D and 2-D
        assert rel_err(st.scaled_dot_product_attention(*x), F.scaled_dot_product_attention(*x)) <= 1e-12


def test_fully_masked_rows_give_zero_like_torch():
    q, k, v = qkv(Lq=4, Lk=5, dtype=torch.float32)
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[1] = False
    ins = leaves(q, k, v)
    out, g = grads_of(lambda *a: st.scaled_dot_product_attention(*a, attn_mask=mask), ins)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.all(out[:, :, 1] == 0) and torch.all(ref[:, :, 1] == 0)
    assert rel_err(out, ref) <= 2e-6
    assert all(torch.isfinite(x).all() for x in g) and torch.all(g[0][:, :, 1] == 0)


@pytest.mark.parametrize("p", [0.2, 0.6])
def test_dropout_follows_torch_seed_and_backward_uses_the_same_mask(p):
    """The seed comes from torch's default generator: manual_seed reproduces a call; the keep decisions are
    sattn's Philox(seed; b, h, i, j), read back through the numpy API with the seed the wrapper drew."""
    q, k, v = qkv(Lq=20, Lk=30, dtype=torch.float64, seed=5)
    ins = leaves(q, k, v)
    torch.manual_seed(123)
    out, g = grads_of(lambda *a: st.scaled_dot_product_attention(*a, dropout_p=p), ins)
    torch.manual_seed(123)
    out2 = st.scaled_dot_product_attention(q, k, v, dropout_p=p)
    assert torch.equal(out.detach(), out2)
    torch.manual_seed(124)
    assert not torch.equal(out.detach(), st.scaled_dot_product_attention(q, k, v, dropout_p=p))
    torch.manual_seed(123)
    seed = int(torch.randint(0, 2**62, (), dtype=torch.int64))  # what the wrapper drew
    w0 = sattn.attention_weights(q.numpy(), k.numpy())
    w = sattn.attention_weights(q.numpy(), k.numpy(), dropout_p=p, seed=seed)
    keep = torch.from_numpy(w != 0)
    assert abs(keep.double().mean().item() - (1 - p)) < 0.05 and np.all(w0 != 0)
    ref, gr = grads_of(lambda *a: manual_attention(*a, keep=keep, p=p), ins)
    assert rel_err(out, ref) <= 1e-12
    for a, b in zip(g, gr):
        assert rel_err(a, b) <= 1e-11


def test_gradcheck_float64():
    q, k, v = qkv(B=1, Hq=2, Hkv=1, Lq=5, Lk=7, E=4, Ev=3, dtype=torch.float64, seed=6)
    mask = torch.randn(2, 5, 1, dtype=torch.float64)
    ins = leaves(q, k, v, mask)
    assert torch.autograd.gradcheck(lambda a, b, c, m: st.scaled_dot_product_attention(
        a, b, c, attn_mask=m, is_causal=True, causal_alignment="bottom_right", enable_gqa=True), ins)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_keeps_its_dtype(dtype, monkeypatch):
    q, k, v = qkv(Lq=40, Lk=40, E=32, Ev=32, dtype=dtype, seed=7)
    ins = leaves(q, k, v)
    seen = []  # the dtypes that reach the native entry points: half precision, no float32 copies of the inputs

    def spy(name):
        native = getattr(st._core, name)

        def call(*args):
            seen.append((name, [a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]))
            return native(*args)
        monkeypatch.setattr(st._core, name, call)
    spy("_torch_sdpa_forward")
    spy("_torch_sdpa_backward")
    out, g = grads_of(lambda *a: st.scaled_dot_product_attention(*a, is_causal=True), ins)
    assert out.dtype == dtype and all(x.dtype == dtype for x in g)
    assert [n for n, _ in seen] == ["_torch_sdpa_forward", "_torch_sdpa_backward"]
    fwd, bwd = seen[0][1], seen[1][1]
    # q, k, v; out in float32 (the backward's Di reads it unrounded; the caller gets it rounded), lse
    assert fwd == [dtype] * 3 + [torch.float32] * 2
    assert bwd == [dtype] * 4 + [torch.float32] * 2 + [dtype] * 3  # dout, q, k, v; out, lse; dq, dk, dv
    monkeypatch.undo()
    ref, gr = grads_of(lambda *a: st.scaled_dot_product_attention(*a, is_causal=True), leaves(
        *(x.float() for x in (q, k, v))))
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-3  # the float32 computation rounded once (forward)
    assert rel_err(out, ref) <= tol
    for a, b in zip(g, gr):
        assert rel_err(a, b) <= 4 * tol


def test_autocast_runs_in_bfloat16_like_torch():
    q, k, v = qkv(Lq=16, Lk=16, E=16, Ev=16, seed=8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = st.scaled_dot_product_attention(q, k, v, is_causal=True)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.dtype == ref.dtype == torch.bfloat16
    assert rel_err(out, ref) <= 2e-2


def test_thread_counts_give_identical_results():
    q, k, v = qkv(B=1, Hq=4, Hkv=4, Lq=300, Lk=300, E=32, Ev=32, seed=9)
    outs = []
    for n in (1, 2, 3):
        ins = leaves(q, k, v)
        outs.append(grads_of(lambda *a: st.scaled_dot_product_attention(*a, is_causal=True, num_threads=n), ins))
    for out, g in outs[1:]:
        assert torch.equal(out, outs[0][0]) and all(torch.equal(a, b) for a, b in zip(g, outs[0][1]))


def test_errors_name_the_argument():
    q, k, v = qkv(Lq=4, Lk=4, E=4, Ev=4)
    meta = torch.empty(2, 4, 4, 4, device="meta")
    with pytest.raises(NotImplementedError, match="device 'meta'"):
        st.scaled_dot_product_attention(meta, meta, meta)
    with pytest.raises(TypeError, match="query: expected float32, float64, bfloat16 or float16, got int64"):
        st.scaled_dot_product_attention(q.long(), k, v)
    with pytest.raises(TypeError, match="key/value: expected the dtype of query"):
        st.scaled_dot_product_attention(q, k.double(), v)
    with pytest.raises(ValueError, match="enable_gqa=True"):
        st.scaled_dot_product_attention(q, k[:, :2], v[:, :2])
    with pytest.raises(ValueError, match=r"attn_mask: shape \[3, 4\] does not broadcast"):
        st.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(3, 4))
    with pytest.raises(TypeError, match="attn_mask: expected bool"):
        st.scaled_dot_product_attention(q, k, v, attn_mask=torch.zeros(4, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="dropout_p"):
        st.scaled_dot_product_attention(q, k, v, dropout_p=1.0)
    with pytest.raises(ValueError, match="causal_alignment"):
        st.scaled_dot_product_attention(q, k, v, is_causal=True, causal_alignment="diagonal")
    with pytest.raises(ValueError, match="key: expected embedding size E = 4"):
        st.scaled_dot_product_attention(q, k[..., :3], v)
    for exc in (sattn.Error,):
        with pytest.raises(exc):
            st.scaled_dot_product_attention(q, k, v, key_padding_mask=torch.zeros(2, 3, dtype=torch.bool))


def test_double_backward_raises():
    ins = leaves(*qkv(Lq=4, Lk=4, E=4, Ev=4, dtype=torch.float64))
    out = st.scaled_dot_product_attention(*ins)
    (gq,) = torch.autograd.grad(out.sum(), ins[0], create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        gq.sum().backward()


# ---- operators: opcheck ---------------------------------------------------------------------------------------------

def _sdpa_op_args(dtype=torch.float32, mask=True, dropout=0.0):
    q, k, v = leaves(*qkv(B=1, Hq=2, Hkv=1, Lq=5, Lk=7, E=8, Ev=4, dtype=dtype, seed=10))
    m = torch.randn(2, 5, 7, dtype=dtype, requires_grad=True) if mask else None
    seed = torch.tensor(99, dtype=torch.int64) if dropout else None
    return (q, k, v, m, None, "bottom_right", None, dropout, seed, 1)


@pytest.mark.parametrize("args", [dict(), dict(mask=False, dropout=0.3), dict(dtype=torch.float64)])
def test_opcheck_sdpa(args):
    a = _sdpa_op_args(**args)
    torch.library.opcheck(torch.ops.sattn.sdpa_forward.default, a)
    out, lse, _ = torch.ops.sattn.sdpa_forward(*a)
    bwd = (torch.randn_like(out), *(x.detach() if x is not None and x.dtype.is_floating_point else x
                                     for x in a[:3]), out.detach(), lse, *a[3:], a[3] is not None)
    bwd = bwd[:6] + ((a[3].detach() if a[3] is not None else None),) + bwd[7:]
    torch.library.opcheck(torch.ops.sattn.sdpa_backward.default, bwd)


def test_opcheck_sparse_and_varlen():
    q, k, v = leaves(*qkv(B=1, Hq=2, Hkv=2, Lq=40, Lk=40, E=8, Ev=8, seed=11))
    bias = torch.randn(40, 40, requires_grad=True)
    for spec in ("SlidingWindow(4, 0)", "TopK(6)"):
        args = (q, k, v, spec, None, False, None, 16, None, 0.0, bias if spec.startswith("S") else None, None, 1)
        torch.library.opcheck(torch.ops.sattn.sparse_forward.default, args)
        out, lse, idx, _ = torch.ops.sattn.sparse_forward(*args)
        bwd = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse, idx, spec, None, False,
               None, 16, None, 0.0, args[10].detach() if args[10] is not None else None, None, 1)
        torch.library.opcheck(torch.ops.sattn.sparse_backward.default, bwd)
    # float32_precision given (the schemas' defaulted last argument), forward and backward
    args = (q, k, v, "SlidingWindow(4, 0)", None, False, None, 16, None, 0.0, None, None, 1, "bf16")
    torch.library.opcheck(torch.ops.sattn.sparse_forward.default, args)
    out, lse, idx, _ = torch.ops.sattn.sparse_forward(*args)
    bwd = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse, idx, args[3], None, False,
           None, 16, None, 0.0, None, None, 1, "bf16")
    torch.library.opcheck(torch.ops.sattn.sparse_backward.default, bwd)
    lens = [3, 9, 5]
    cu = torch.tensor([0, 3, 12, 17], dtype=torch.int32)
    gen = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(17, 2, 8, generator=gen, requires_grad=True) for _ in range(3))
    args = (q, k, v, cu, cu, max(lens), max(lens), True, None, 1)
    torch.library.opcheck(torch.ops.sattn.varlen_forward.default, args)
    out, lse, _ = torch.ops.sattn.varlen_forward(*args)
    torch.library.opcheck(torch.ops.sattn.varlen_backward.default,
                          (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out.detach(), lse, cu, cu, 9, 9,
                           True, None, 1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_opcheck_float32_out(dtype):
    """float32_out=True (the operators' last argument, given where a gradient may be needed): half-precision inputs
    get out in their dtype and, as the last output, the same out in float32 before its rounding; other dtypes an
    empty last output. The backward of the operator's autograd formula reads the float32 one."""
    q, k, v = leaves(*qkv(B=1, Hq=2, Hkv=2, Lq=40, Lk=40, E=8, Ev=8, seed=13, dtype=dtype))
    cu = torch.tensor([0, 3, 40], dtype=torch.int32)
    calls = ((torch.ops.sattn.sdpa_forward.default, (q, k, v, None, None, "top_left", None, 0.0, None, 1)),
             (torch.ops.sattn.sparse_forward.default, (q, k, v, "SlidingWindow(4, 0)", None, False, None, 16, None,
                                                       0.0, None, None, 1)),
             (torch.ops.sattn.varlen_forward.default, (q[0].transpose(0, 1), k[0].transpose(0, 1),
                                                       v[0].transpose(0, 1), cu, cu, 37, 37, True, None, 1)))
    for op, args in calls:
        args = args + ("highest", True)
        torch.library.opcheck(op, args)
        outputs = op(*args)
        out, out_float32 = outputs[0], outputs[-1]
        assert out.dtype == dtype
        if dtype == torch.float32:
            assert out_float32.shape == (0,)
        else:
            assert out_float32.dtype == torch.float32 and torch.equal(out_float32.to(dtype), out)
            assert not torch.equal(out_float32, out.float())  # unrounded
        out.backward(torch.ones_like(out))


# ---- the eager route and the operators ----------------------------------------------------------------------------

class RecordOps(torch.utils._python_dispatch.TorchDispatchMode):
    """A dispatch mode that records the sattn operators reaching torch's dispatcher."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "sattn":
            self.ops.append(func.__name__)
        return func(*args, **(kwargs or {}))


def _varlen_call(q, k, v, m):
    cu = torch.tensor([0, 3, 12, 17], dtype=torch.int32)
    return st.flash_attn_varlen_func(q, k, v, cu, cu, 9, 9, causal=True)


ROUTED = {  # each public function, its inputs (the last one a float mask / bias with a gradient, or None)
    "sdpa": (lambda q, k, v, m: st.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True),
             lambda: (*qkv(B=2, Hq=4, Hkv=2, Lq=9, Lk=11, E=8, Ev=6, seed=31), torch.randn(4, 9, 11))),
    "sparse": (lambda q, k, v, m: st.sparse_attention(q, k, v, "SlidingWindow(3, 2)", bias=m, block=4),
               lambda: (*qkv(B=1, Hq=2, Hkv=2, Lq=20, Lk=20, E=8, Ev=8, seed=32), torch.randn(20, 20))),
    "varlen": (_varlen_call, lambda: (*(torch.randn(17, 2, 8, generator=torch.Generator().manual_seed(33 + i))
                                        for i in range(3)), None)),
}


@pytest.mark.parametrize("name", sorted(ROUTED))
def test_eager_route_equals_the_operators_bit_for_bit(name):
    """Plain eager calls run the operators' bodies without the dispatcher (an autograd.Function); under a dispatch
    mode the same call goes through sattn's operators. Outputs and gradients are the same bits."""
    fn, make = ROUTED[name]
    ins = leaves(*(x for x in make() if x is not None))
    call = (lambda *a: fn(*a[:3], a[3] if len(a) > 3 else None))
    out, grads = grads_of(call, ins)
    assert type(out.grad_fn).__name__ == {"sdpa": "SdpaFunctionBackward", "sparse": "SparseFunctionBackward",
                                          "varlen": "VarlenFunctionBackward"}[name]
    with RecordOps() as seen:
        ref, ref_grads = grads_of(call, leaves(*ins))
    assert seen.ops == [f"{name}_forward.default", f"{name}_backward.default"], seen.ops
    assert torch.equal(out, ref)
    assert len(grads) == len(ref_grads) == len(ins)
    for a, b in zip(grads, ref_grads):
        assert torch.equal(a, b)
    with torch.no_grad():  # no gradient needed: the body alone, same bits
        assert torch.equal(call(*ins), ref) and call(*ins).grad_fn is None


SHORT_CALLS = [  # (qkv keywords, call keywords, mask maker): the forms of the common call (4-D, no dropout)
    (dict(), dict(), None),
    (dict(dtype=torch.bfloat16), dict(is_causal=True), None),
    (dict(Hq=4, Hkv=2), dict(enable_gqa=True, is_causal=True, causal_alignment="bottom_right", scale=0.3), None),
    (dict(dtype=torch.float64, Lq=1), dict(num_threads=2), None),
    (dict(dtype=torch.float16), dict(float32_precision="bf16"), None),
    (dict(), dict(), lambda B, H, Lq, Lk: torch.arange(Lk).expand(B, 1, 1, Lk) < torch.tensor([Lk, 9])[:, None, None,
                                                                                                     None]),
    (dict(Hq=4, Hkv=2), dict(enable_gqa=True, is_causal=True),
     lambda B, H, Lq, Lk: torch.randn(Lq, Lk, generator=torch.Generator().manual_seed(5))),
    (dict(dtype=torch.bfloat16), dict(),
     lambda B, H, Lq, Lk: torch.randn(1, H, Lq, 1, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)),
]


@pytest.mark.parametrize("shapes,kw,make_mask", SHORT_CALLS)
def test_common_calls_take_the_short_route_with_the_same_bits(shapes, kw, make_mask, monkeypatch):
    """The common eager call (plain 4-D tensors, at most a 4-D mask, no dropout) skips the wrapper's checks (the
    kernels make them) and, when it needs no gradient, the log-sum-exp. Its output, and its gradients where it needs
    them, have the bits of the operators' route (under a dispatch mode)."""
    q, k, v = qkv(**shapes)
    k = k.transpose(2, 3).contiguous().transpose(2, 3)  # strided inputs take it too
    mask = None if make_mask is None else make_mask(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    float_mask = mask is not None and mask.is_floating_point()
    ins = leaves(q, k, v, *([mask] if float_mask else []))

    def call(a, b, c, m=mask):
        return st.scaled_dot_product_attention(a, b, c, attn_mask=m, **kw)

    with RecordOps() as seen:
        ref, ref_grads = grads_of(call, leaves(*ins))
    assert seen.ops == ["sdpa_forward.default", "sdpa_backward.default"]
    taken, inference = [], st._sdpa_inference
    monkeypatch.setattr(st, "_sdpa_inference", lambda *a: taken.append(1) or inference(*a))
    out = call(q, k, v)
    assert taken and torch.equal(out, ref) and out.dtype == q.dtype and out.stride() == ref.stride()
    with torch.no_grad():
        assert torch.equal(call(*ins), ref) and len(taken) == 2
    out, grads = grads_of(call, ins)  # a gradient needed: the autograd.Function, no lse skipped
    assert type(out.grad_fn).__name__ == "SdpaFunctionBackward" and len(taken) == 2
    assert torch.equal(out, ref) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    assert len(grads) == len(ins)
    taken.clear()  # the calls that must not take it
    call(q[0], k[0], v[0], None if mask is None else mask[0] if mask.dim() == 4 else mask)
    st.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.5, **kw)
    with RecordOps() as seen:
        call(q, k, v)
    assert not taken and seen.ops == ["sdpa_forward.default"]


def test_key_padding_mask_takes_the_short_route_with_the_same_bits(monkeypatch):
    q, k, v = qkv(Hq=4, Hkv=2, seed=9)
    kpm = torch.arange(k.shape[2]) >= torch.tensor([47, 30])[:, None]  # [B, Lk], True = padding

    def call(a, b, c):
        return st.scaled_dot_product_attention(a, b, c, key_padding_mask=kpm, enable_gqa=True, is_causal=True)

    with RecordOps() as seen:
        ref, ref_grads = grads_of(call, leaves(q, k, v))
    assert seen.ops == ["sdpa_forward.default", "sdpa_backward.default"]
    taken, inference = [], st._sdpa_inference
    monkeypatch.setattr(st, "_sdpa_inference", lambda *a: taken.append(1) or inference(*a))
    assert torch.equal(call(q, k, v), ref) and taken
    out, grads = grads_of(call, leaves(q, k, v))
    assert torch.equal(out, ref) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
    with pytest.raises(ValueError, match=r"key_padding_mask: expected shape \[2, 47\] \(query's batch dimensions, Lk\)"):
        st.scaled_dot_product_attention(q, k, v, key_padding_mask=kpm[:, :5], enable_gqa=True)


def test_features_that_must_see_the_operators_get_them():
    q, k, v = leaves(*qkv(B=3, Hq=2, Hkv=2, Lq=6, Lk=6, E=4, Ev=4, seed=34))
    with torch.profiler.profile() as prof:
        st.scaled_dot_product_attention(q, k, v).sum().backward()
    names = {e.name for e in prof.events()}
    assert {"sattn::sdpa_forward", "sattn::sdpa_backward"} <= names

    class Tagged(torch.Tensor):  # a subclass: its __torch_function__ sees the operator
        pass
    out = st.scaled_dot_product_attention(q.as_subclass(Tagged), k, v)
    assert type(out) is Tagged
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert st.scaled_dot_product_attention(q, k, v).dtype == torch.bfloat16
    with torch.no_grad(), pytest.warns(UserWarning, match="batching rule"):  # torch's per-sample fallback
        batched = torch.func.vmap(st.scaled_dot_product_attention)(q, k, v)
        assert torch.equal(batched, torch.stack([st.scaled_dot_product_attention(*x) for x in zip(q, k, v)]))


def _query_layouts(B=2, H=3, L=20, E=8, dtype=torch.float32):
    """q, k, v [B, H, L, E] views of the memory layouts transformers make: contiguous, a fused projection's [B, L, 3,
    H, E] (batch first), and [L, B, 3, H, E] (sequence first, as nn.MultiheadAttention); and a q stored by columns."""
    g = torch.Generator().manual_seed(5)
    yield "contiguous", tuple(torch.randn(B, H, L, E, generator=g, dtype=dtype) for _ in range(3))
    packed = torch.randn(B, L, 3, H, E, generator=g, dtype=dtype)
    yield "batch first", tuple(packed[:, :, i].transpose(1, 2) for i in range(3))
    packed = torch.randn(L, B, 3, H, E, generator=g, dtype=dtype)
    yield "sequence first", tuple(packed[:, :, i].permute(1, 2, 0, 3) for i in range(3))
    q = torch.randn(B, H, E, L, generator=g, dtype=dtype).transpose(2, 3)  # columns of unit stride: out contiguous
    yield "columns", (q, *(torch.randn(B, H, L, E, generator=g, dtype=dtype) for _ in range(2)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("grad", [False, True])
def test_out_has_the_query_layout_as_torch_sdpa(dtype, grad):
    """The output takes the query's memory layout, as torch's own SDPA makes it: from a fused projection's q the
    usual next step, out.transpose(1, 2).reshape(B, L, H * E), is a view, not a copy. Eager (both routes) and
    compiled (the operator's fake output has the real strides: inductor checks them) alike."""
    for name, (q, k, v) in _query_layouts(dtype=dtype):
        q, k, v = (t.requires_grad_(grad) for t in (q, k, v))
        ref = F.scaled_dot_product_attention(q, k, v)
        out = st.scaled_dot_product_attention(q, k, v)
        assert out.stride() == ref.stride(), name
        assert rel_err(out, ref) <= (1e-5 if dtype == torch.float32 else 1e-2), name
        if name == "batch first":
            B, H, L, E = out.shape
            assert out.transpose(1, 2).reshape(B, L, H * E).data_ptr() == out.data_ptr()
        with RecordOps() as seen:  # the operators' route (a dispatch mode): the same layout and values
            via_op = st.scaled_dot_product_attention(q, k, v)
        assert seen.ops[0] == "sdpa_forward.default" and via_op.stride() == ref.stride(), name
        assert torch.equal(via_op, out), name
    q, k, v = (t.requires_grad_(grad) for t in next(t for n, t in _query_layouts(dtype=dtype) if n == "batch first"))
    compiled = torch.compile(lambda a, b, c: st.scaled_dot_product_attention(a, b, c).transpose(1, 2).flatten(-2) * 2,
                             fullgraph=True)
    eager = st.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(-2) * 2
    assert torch.equal(compiled(q, k, v), eager)


# ---- torch.compile and torch.export -------------------------------------------------------------------------------

class TinyAttention(torch.nn.Module):
    def __init__(self, dim=32, heads=2, dropout=0.0):
        super().__init__()
        self.qkv, self.out, self.heads, self.dropout = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim), \
            heads, dropout

    def forward(self, x, mask):
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        o = st.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout)
        return self.out(o.transpose(1, 2).flatten(-2))


def _step(model, x, mask):
    model.zero_grad()
    mask = mask.detach().requires_grad_(True)
    y = model(x, mask)
    y.square().sum().backward()
    return y.detach(), [p.grad.clone() for p in model.parameters()] + [mask.grad.clone()]


def test_compile_fullgraph_matches_eager():
    torch.manual_seed(13)
    model, x, mask = TinyAttention(), torch.randn(2, 24, 32), torch.randn(24, 24)
    y0, g0 = _step(model, x, mask)
    compiled = torch.compile(model, fullgraph=True)  # the default backend, inductor
    y1, g1 = _step(compiled, x, mask)
    assert rel_err(y1, y0) <= 1e-6
    for a, b in zip(g1, g0):
        assert rel_err(a, b) <= 1e-6
    # Dropout under inductor: the seed tensor is drawn by the compiled graph from torch's generator, so
    # manual_seed reproduces compiled runs (which differ from eager ones, as any random op under inductor).
    model.dropout = 0.25
    runs = []
    for s in (1, 2, 1):
        torch.manual_seed(s)
        runs.append(_step(compiled, x, mask))
    assert torch.equal(runs[0][0], runs[2][0]) and all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[2][1]))
    assert not torch.equal(runs[0][0], runs[1][0])


def test_compile_fullgraph_half_precision_gives_eager_bits():
    """bf16 calls that need a gradient compute out in float32 and round it inside the operator: under
    torch.compile(fullgraph=True) with inductor the outputs that feed the next operation and the gradients are bit
    for bit eager's (a rounding outside the operator is a cast that inductor fuses away)."""
    g = torch.Generator().manual_seed(15)
    q, k, v = (torch.randn(1, 4, 96, 32, generator=g).bfloat16().requires_grad_() for _ in range(3))

    def f(q, k, v):
        return st.scaled_dot_product_attention(q, k, v, is_causal=True) + st.sparse_attention(q, k, v,
                                                                                            "SlidingWindow(16, 0)")
    eager = f(q, k, v)
    compiled = torch.compile(f, fullgraph=True)(q, k, v)
    assert compiled.dtype == torch.bfloat16 and torch.equal(compiled, eager)
    for a, b in zip(torch.autograd.grad(compiled.float().sum(), (q, k, v)),
                    torch.autograd.grad(eager.float().sum(), (q, k, v))):
        assert torch.equal(a, b)


def test_compile_fullgraph_and_export_sparse_attention_match_eager():
    """sparse_attention under torch.compile(fullgraph=True): no graph break (the pattern as a spec string or a
    sattn.Pattern), forward and backward, with float32_precision given ('bf16': the bf16 products where the CPU has
    them) or left to torch's setting; the same gradients as eager. torch.export keeps the operator."""
    g = torch.Generator().manual_seed(14)
    q, k, v = (torch.randn(1, 2, 40, 16, generator=g, requires_grad=True) for _ in range(3))
    for precision, pattern in (("bf16", "SlidingWindow(8, 0)"), (None, sattn.SlidingWindow(8, 0))):
        def loss(q, k, v):
            out = st.sparse_attention(q * 2.0, k, v, pattern, block=16, float32_precision=precision)
            return out.square().sum()
        eager = torch.autograd.grad(loss(q, k, v), (q, k, v))
        compiled = torch.compile(loss, fullgraph=True)
        got = torch.autograd.grad(compiled(q, k, v), (q, k, v))
        for a, b in zip(got, eager):
            assert rel_err(a, b) <= 1e-6, precision

    def selection(q, k, v):  # the indices' shape comes from the spec, a constant too
        return st.sparse_attention(q, k, v, "TopK(5)", return_indices=True)[1]

    args = tuple(x.detach() for x in (q, k, v))
    assert torch.equal(torch.compile(selection, fullgraph=True)(*args), selection(*args))

    class Sparse(torch.nn.Module):
        def forward(self, q, k, v):
            return st.sparse_attention(q, k, v, sattn.SlidingWindow(8, 0), block=16)

    exported = torch.export.export(Sparse(), args)
    assert "sattn.sparse_forward" in exported.graph_module.code
    assert torch.equal(exported.module()(*args), Sparse()(*args))


def test_compile_dynamic_compiles_once_and_dropout_reproduces():
    from torch._dynamo.testing import CompileCounterWithBackend
    torch._dynamo.reset()
    model = TinyAttention(dropout=0.25)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, dynamic=True, backend=counter)
    outs, frames = {}, []
    for L in (17, 29, 17):
        x, mask = torch.randn(1, L, 32, generator=torch.Generator().manual_seed(L)), torch.zeros(L, L)
        torch.manual_seed(L)
        y, g = _step(compiled, x, mask)
        if L in outs:  # manual_seed reproduces the compiled run (its own sequence of seeds)
            assert torch.equal(y, outs[L][0]) and all(torch.equal(a, b) for a, b in zip(g, outs[L][1]))
        outs[L] = (y, g)
        frames.append(counter.frame_count)
    # One compilation serves both lengths (dynamo may restart its analysis of the first call, which the backend
    # counter sees as a second frame; a recompilation for the new length would add to it).
    assert frames[0] >= 1 and frames == [frames[0]] * 3, frames


def test_export_matches_eager():
    torch.manual_seed(14)
    model, x, mask = TinyAttention(), torch.randn(2, 24, 32), torch.randn(24, 24)
    ep = torch.export.export(model, (x, mask))
    assert any("sattn.sdpa_forward" in str(n.target) for n in ep.graph.nodes)
    assert rel_err(ep.module()(x, mask), model(x, mask)) <= 1e-6


# ---- sparse_attention ---------------------------------------------------------------------------------------------

SPARSE_CASES = [
    ("SlidingWindow(5, 3)", {}),
    ("Dilated(3, 2)", dict(enable_gqa=True)),
    ("BlockLocal(16)", dict(softcap=5.0)),
    ("GlobalTokens([0, 9], SlidingWindow(2, 2))", dict(alibi_slopes=[0.5, 0.25])),
    ("BigBird(8, 3, 1, 2, seed=4)", dict(scale=0.2)),
    ("Neighborhood2D(8, 8, 3)", dict(key_padding_mask=True)),
    ("WindowAttention2D(8, 8, 4, shift=2)", dict(rel_pos_bias=True)),
    ("SlidingWindow(4, 0) | Dilated(2, 3)", dict(bias=True)),
    ("Full()", dict(bias=True)),
    ("TopK(6)", {}),
    ("BlockTopK(16, 2)", {}),
    ("ReLUAttention()", {}),
    ("MixedAttention((0.5, -0.5))", {}),
]


@pytest.mark.parametrize("spec,kw", SPARSE_CASES, ids=[c[0] for c in SPARSE_CASES])
def test_sparse_attention_matches_the_numpy_api(spec, kw):
    """The torch op runs the same kernels as sattn.sparse_attention: results and gradients (q, k, v and the bias
    tensors) are identical to the numpy API's, which tests/python/test_sparse.py checks against a float64 oracle."""
    Hkv = 1 if kw.get("enable_gqa") else 2
    q, k, v = qkv(B=1, Hq=2, Hkv=Hkv, Lq=64, Lk=64, E=8, Ev=8, seed=15)
    kw = dict(kw)
    extra = []
    if kw.pop("bias", False):
        kw["bias"] = torch.randn(64, 64, requires_grad=True)
        extra.append("bias")
    if kw.pop("rel_pos_bias", False):
        kw["rel_pos_bias"] = torch.randn(49, 2, requires_grad=True)
        extra.append("rel_pos_bias")
    if kw.pop("key_padding_mask", False):
        kw["key_padding_mask"] = torch.arange(64)[None] >= 60
    ins = leaves(q, k, v)
    out, lse = st.sparse_attention(*ins, spec, return_lse=True, block=16, **kw)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, ins + [kw[n] for n in extra], g)
    npkw = {n: (x.detach().numpy() if isinstance(x, torch.Tensor) else x) for n, x in kw.items()}
    pattern = sattn.parse_pattern(spec)
    ref_out, ref_lse = sattn.sparse_attention(q.numpy(), k.numpy(), v.numpy(), pattern, return_lse=True, block=16,
                                              **npkw)
    assert torch.equal(out, torch.from_numpy(ref_out)) and torch.equal(lse, torch.from_numpy(ref_lse))
    rq, rk, rv, rextra = sattn.sparse_attention_backward(g.numpy(), q.numpy(), k.numpy(), v.numpy(), ref_out,
                                                         ref_lse, pattern, block=16, **npkw)
    for a, b in zip(grads, [rq, rk, rv] + [rextra[n] for n in extra]):
        assert torch.equal(a, torch.from_numpy(b))


def test_sparse_attention_against_torch_dense_masked_attention():
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Lq=50, Lk=50, E=8, Ev=8, dtype=torch.float64, seed=16)
    bias = torch.randn(50, 50, dtype=torch.float64)
    spec = "SlidingWindow(6, 2) | GlobalTokens([0], Full())"
    allowed = torch.from_numpy(sattn.parse_pattern(spec).dense_mask(50))
    ins = leaves(q, k, v, bias)
    out, g = grads_of(lambda *a: st.sparse_attention(*a[:3], spec, bias=a[3]), ins)
    ref, gr = grads_of(lambda *a: F.scaled_dot_product_attention(
        *a[:3], attn_mask=a[3].masked_fill(~allowed, float("-inf"))), ins)
    assert rel_err(out, ref) <= 2e-6  # the sparse engine computes in float32
    for a, b in zip(g, gr):
        assert rel_err(a, b) <= 1e-5


def test_sparse_attention_indices_and_errors():
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Lq=32, Lk=32, E=8, Ev=8, seed=17)
    out, idx = st.sparse_attention(q, k, v, sattn.TopK(4), return_indices=True)
    assert idx.dtype == torch.int64 and idx.shape == (1, 2, 32, 4)
    with pytest.raises(ValueError, match="return_indices"):
        st.sparse_attention(q, k, v, "SlidingWindow(2, 2)", return_indices=True)
    with pytest.raises(ValueError):
        st.sparse_attention(q, k, v, "SlidingWindow(2,")
    with pytest.raises(TypeError, match="pattern"):
        st.sparse_attention(q, k, v, 3)


# ---- flash_attn_varlen_func ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal", [False, True])
def test_flash_attn_varlen_func_matches_torch_per_sequence(causal):
    lens_q, lens_k = [3, 9, 5], [7, 9, 2]
    gen = torch.Generator().manual_seed(18)
    q = torch.randn(sum(lens_q), 4, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(sum(lens_k), 2, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(sum(lens_k), 2, 6, generator=gen, dtype=torch.float64)
    cq = torch.tensor([0, 3, 12, 17], dtype=torch.int32)
    ck = torch.tensor([0, 7, 16, 18], dtype=torch.int32)
    ins = leaves(q, k, v)
    out, g = grads_of(lambda *a: st.flash_attn_varlen_func(*a, cq, ck, 9, 9, causal=causal), ins)

    def per_sequence(q, k, v):
        outs = []
        for s in range(3):
            qs, ks, vs = (x[c[s]:c[s + 1]].transpose(0, 1) for x, c in ((q, cq), (k, ck), (v, ck)))
            bias = causal_bias(qs.shape[1], ks.shape[1], "bottom_right") if causal else None
            outs.append(manual_attention(qs, ks, vs, bias=bias).transpose(0, 1))
        return torch.cat(outs)
    ref, gr = grads_of(per_sequence, ins)
    assert rel_err(out, ref) <= 2e-6  # float64 inputs run the float32 fused kernel
    for a, b in zip(g, gr):
        assert rel_err(a, b) <= 1e-5
    with pytest.raises(NotImplementedError, match="dropout_p"):
        st.flash_attn_varlen_func(q, k, v, cq, ck, 9, 9, dropout_p=0.1)


# ---- MultiheadAttention -------------------------------------------------------------------------------------------

MHA_CASES = [
    dict(),
    dict(batch_first=True),
    dict(kdim=6, vdim=10),
    dict(add_bias_kv=True, add_zero_attn=True),
    dict(bias=False),
]


def _mha_pair(seed, **ctor):
    torch.manual_seed(seed)
    ref = torch.nn.MultiheadAttention(16, 4, **ctor)
    ours = st.MultiheadAttention(16, 4, **ctor)
    ours.load_state_dict(ref.state_dict())
    assert list(ours.state_dict()) == list(ref.state_dict())
    return ours, ref


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask and attn_mask is deprecated")
@pytest.mark.parametrize("ctor", MHA_CASES, ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "default")
@pytest.mark.parametrize("masks", ["none", "bool", "float", "kpm_float_attn_bool"])
@pytest.mark.parametrize("need_weights", [False, True])
@pytest.mark.parametrize("inputs", ["distinct", "self", "shared_kv"])
def test_multihead_attention_matches_torch(ctor, masks, need_weights, inputs):
    """Outputs, weights and the gradients of the parameters and inputs against torch's, for distinct query, key and
    value, one tensor for all three (self-attention: one packed in-projection) and one for key and value."""
    if inputs != "distinct" and "kdim" in ctor:
        pytest.skip("key and value of different sizes cannot be one tensor")
    ours, ref = _mha_pair(19, **ctor)
    L, S, N = 6, 6 if inputs == "self" else 9, 2
    bf = ctor.get("batch_first", False)
    shape = (lambda n, s, e: (n, s, e)) if bf else (lambda n, s, e: (s, n, e))
    gen = torch.Generator().manual_seed(20)
    query = torch.randn(*shape(N, L, 16), generator=gen, requires_grad=True)
    key = torch.randn(*shape(N, S, ctor.get("kdim", 16)), generator=gen, requires_grad=True)
    value = torch.randn(*shape(N, S, ctor.get("vdim", 16)), generator=gen, requires_grad=True)
    if inputs == "self":
        key = value = query
    elif inputs == "shared_kv":
        value = key
    leaves = list({id(t): t for t in (query, key, value)}.values())
    kw = {}
    if masks == "bool":
        kw["attn_mask"] = torch.rand(L, S, generator=gen) > 0.7
        kw["key_padding_mask"] = torch.zeros(N, S, dtype=torch.bool)
        kw["key_padding_mask"][1, -2:] = True
    elif masks == "float":
        kw["attn_mask"] = torch.randn(N * 4, L, S, generator=gen)
    elif masks == "kpm_float_attn_bool":
        kw["attn_mask"] = torch.rand(L, S, generator=gen) > 0.7
        kw["key_padding_mask"] = torch.randn(N, S, generator=gen)
    if masks in ("bool", "kpm_float_attn_bool"):
        kw["attn_mask"][:, 0] = False  # every row keeps a key: torch's need_weights path gives NaN otherwise
    out, w = ours(query, key, value, need_weights=need_weights, **kw)
    rout, rw = ref(query, key, value, need_weights=need_weights, **kw)
    assert rel_err(out, rout) <= 2e-6
    assert (w is None) == (rw is None) and (w is None or rel_err(w, rw) <= 2e-6)
    g = torch.randn_like(out)
    gs = torch.autograd.grad(out, list(ours.parameters()) + leaves, g)
    rgs = torch.autograd.grad(rout, list(ref.parameters()) + leaves, g)
    names = [name for name, _ in ours.named_parameters()] + [f"input {i}" for i in range(len(leaves))]
    for name, a, b in zip(names, gs, rgs):
        assert rel_err(a, b) <= 1e-5, name


def test_multihead_attention_forms_and_torch_rules():
    ours, ref = _mha_pair(21)
    x = torch.randn(5, 16)  # unbatched
    causal = torch.nn.Transformer.generate_square_subsequent_mask(5)
    for kw in (dict(), dict(attn_mask=causal, is_causal=True, need_weights=False), dict(average_attn_weights=False)):
        out, w = ours(x, x, x, **kw)
        rout, rw = ref(x, x, x, **kw)
        assert rel_err(out, rout) <= 2e-6 and (w is None or rel_err(w, rw) <= 2e-6)
    with pytest.raises(ValueError, match="is_causal"):
        ours(x, x, x, is_causal=True)
    with pytest.raises(TypeError, match="attn_mask: expected bool"):
        ours(x, x, x, attn_mask=torch.zeros(5, 5, dtype=torch.uint8))
    ours.eval()
    ref.eval()
    xb = torch.randn(5, 2, 16)
    with torch.no_grad():
        assert rel_err(ours(xb, xb, xb)[0], ref(xb, xb, xb)[0]) <= 2e-6


# ---- use_sattn ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("train", [True, False])
def test_use_sattn_runs_transformer_layers_on_sattn(train):
    torch.manual_seed(22)
    layer = torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, dropout=0.0, batch_first=True)
    layer.train(train)
    x = torch.randn(2, 10, 32)
    kpm = torch.zeros(2, 10, dtype=torch.bool)
    kpm[1, 7:] = True
    with torch.no_grad() if not train else torch.enable_grad():
        ref = layer(x, src_key_padding_mask=kpm)
        fast = torch.backends.mha.get_fastpath_enabled()
        with torch.profiler.profile() as prof, st.use_sattn(strict=True):
            assert not torch.backends.mha.get_fastpath_enabled()
            out = layer(x, src_key_padding_mask=kpm)
        assert torch.backends.mha.get_fastpath_enabled() == fast
    names = {e.name for e in prof.events()}
    assert "sattn::sdpa_forward" in names, sorted(n for n in names if "attention" in n or "sattn" in n)
    live = ~kpm[:, :, None].expand_as(out) if not train else torch.ones_like(out, dtype=torch.bool)
    assert rel_err(out[live], ref[live]) <= 2e-6  # eval: torch's fast path leaves padded rows unspecified
    if train:
        out.sum().backward()
        assert all(p.grad is not None for p in layer.parameters())


def test_use_sattn_falls_back_or_raises_with_the_reason():
    q, k, v = qkv(Lq=4, Lk=4, E=4, Ev=4)
    mask = torch.ones(4, 4, dtype=torch.bool)
    with st.use_sattn():
        out = F.scaled_dot_product_attention(q.long().double(), k.double(), v.double())  # runs on sattn
        assert out.dtype == torch.float64
        with pytest.raises(RuntimeError):  # torch's own error: is_causal with attn_mask
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
    with st.use_sattn(strict=True), pytest.raises(NotImplementedError, match="is_causal"):
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
    with st.use_sattn(strict=True), pytest.raises(NotImplementedError, match="dtype torch.int64"):
        F.scaled_dot_product_attention(q.long(), k.long(), v.long())


def test_gradient_of_a_broadcast_float_mask_is_accurate():
    """A float mask broadcast along the queries and heads ([Lk]: one bias per key) gets a gradient that sums
    H * Lq = 16384 terms per element at Lq = Lk = 4096; its median relative error against float64 stays within
    1.5e-6 (torch's: ~4e-7; summed one by one in float32: 2e-6). The float64 reference is computed in row chunks."""
    H, L, D = 4, 4096, 64
    gen = torch.Generator().manual_seed(30)
    q, k, v, dout = (torch.randn(1, H, L, D, generator=gen) for _ in range(4))
    mask = torch.randn(L, generator=gen).requires_grad_()
    out = st.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    (got,) = torch.autograd.grad(out, mask, dout)
    # dmask_j = sum_{h,i} dS_hij, dS = P * (dP - rowsum(P * dP)), dP = dO V^T, P = softmax(q k^T / sqrt(D) + mask)
    q64, k64, v64, do64, m64 = (x.detach().double()[0] if x.dim() == 4 else x.detach().double()
                                 for x in (q, k, v, dout, mask))
    ref = torch.zeros(L, dtype=torch.float64)
    for i in range(0, L, 512):
        p = torch.softmax(q64[:, i:i + 512] @ k64.transpose(-1, -2) / math.sqrt(D) + m64, dim=-1)
        dp = do64[:, i:i + 512] @ v64.transpose(-1, -2)
        ref += (p * (dp - (p * dp).sum(-1, keepdim=True))).sum((0, 1))
    err = ((got.double() - ref).abs() / ref.abs()).median().item()
    assert err <= 1.5e-6, err


@pytest.mark.parametrize("huge", [-1e30, torch.finfo(torch.float32).min])
def test_rows_with_a_huge_bias_on_every_key_get_exact_gradients(huge):
    """Rows whose keys all carry the same huge finite bias (a "masked" value) have a uniform softmax; in float32 the
    log-sum-exp rounds to the bias, and a backward that forms exp(s - lse) makes those rows' gradients Lk times too
    large (torch's CPU flash backward does). sattn's match the float64 computation."""
    q, k, v = qkv(B=1, Hq=2, Hkv=2, Lq=70, Lk=100, E=16, Ev=16, seed=31)
    mask = torch.randn(70, 100, dtype=torch.float64)
    mask[5:20] = huge
    mask[40, :50] = huge
    out, g = grads_of(lambda *a: st.scaled_dot_product_attention(*a[:3], attn_mask=a[3]),
                      leaves(q, k, v, mask.float()))
    ref, gr = grads_of(lambda *a: F.scaled_dot_product_attention(*a[:3], attn_mask=a[3]),
                       leaves(*(x.double() for x in (q, k, v)), mask))
    assert rel_err(out, ref) <= 2e-6
    for name, a, b in zip(["dq", "dk", "dv", "dmask"], g, gr):
        assert rel_err(a, b) <= 1e-5, (name, rel_err(a, b))
