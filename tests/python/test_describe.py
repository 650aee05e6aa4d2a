"""sattn.describe: a call checked by shapes and dtypes only, with the messages of the kernels' own validation. The
numpy API, sattn.torch and describe report the same mistake in the same words."""
import numpy as np
import pytest

import sattn

torch = pytest.importorskip("torch")
import sattn.torch as st  # noqa: E402

Q, K, V = np.zeros((3, 2, 4, 5, 8), np.float32), np.zeros((3, 2, 2, 6, 8), np.float32), np.zeros((3, 2, 2, 6, 7),
                                                                                                    np.float32)


def test_describe_folds_leading_dims():
    d = sattn.describe(Q, K, V, enable_gqa=True, attn_mask=np.zeros((2, 1, 5, 6), bool))
    assert d.batch_dims == (3, 2) and d.batch == 6
    assert (d.heads_q, d.heads_kv, d.len_q, d.len_k, d.head_dim, d.head_dim_v) == (4, 2, 5, 6, 8, 7)
    assert d.scale == pytest.approx(8 ** -0.5)
    assert "B=6 Hq=4 Hkv=2 Lq=5 Lk=6 D=8 Dv=7" in d.problem and "mask=bool" in d.problem
    d2 = sattn.describe(Q[0, 0, 0], K[0, 0, 0], V[0, 0, 0])  # 2-D: one batch entry, one head
    assert (d2.batch_dims, d2.batch, d2.heads_q, d2.len_q) == ((), 1, 1, 5)


def test_describe_takes_torch_meta_tensors():
    q, k, v = (torch.empty(s, device="meta", dtype=torch.bfloat16) for s in ((2, 4, 5, 8), (2, 4, 6, 8), (2, 4, 6, 3)))
    d = sattn.describe(q, k, v, is_causal=True, causal_alignment="bottom_right")
    assert d.batch == 2 and "bfloat16" in d.problem and "causal=bottom_right" in d.problem
    with pytest.raises(ValueError, match=r"key: expected embedding size E = 8 \(from query \[2, 4, 5, 8\]\)"):
        sattn.describe(q, k[..., :7], v)


MISTAKES = {
    "E": dict(key=K[..., :7]),
    "value length": dict(value=V[..., :5, :]),
    "batch": dict(key=K[:1], value=V[:1]),
    "heads without enable_gqa": dict(enable_gqa=False),
    "heads not a multiple": dict(key=K[:, :, :1].repeat(3, axis=2), value=V[:, :, :1].repeat(3, axis=2)),
    "dtypes": dict(key=K.astype(np.float64)),
    "integer query": dict(query=Q.astype(np.int32)),
    "mask shape": dict(attn_mask=np.zeros((4, 4, 6), bool)),
    "mask dtype": dict(attn_mask=np.zeros((5, 6), np.int64)),
    "padding shape": dict(key_padding_mask=np.zeros((3, 6), bool)),
    "padding dtype": dict(key_padding_mask=np.zeros((3, 2, 6), np.uint8)),
    "dropout": dict(dropout_p=1.5),
    "scale": dict(scale=float("inf")),
}


@pytest.mark.parametrize("name", list(MISTAKES))
def test_one_message_from_every_entry_point(name):
    args = dict(query=Q, key=K, value=V, enable_gqa=True)
    args.update(MISTAKES[name])
    messages = []
    for call in (sattn.describe, sattn.scaled_dot_product_attention):
        with pytest.raises(sattn.Error) as info:
            call(**args)
        messages.append(str(info.value))
    torch_args = {n: torch.from_numpy(np.ascontiguousarray(a)) if isinstance(a, np.ndarray) else a
                  for n, a in args.items()}
    with pytest.raises(sattn.Error) as info:
        st.scaled_dot_product_attention(**torch_args)
    messages.append(str(info.value))
    assert messages[0] == messages[1] == messages[2], messages


def test_fake_implementation_checks_the_operator_call():
    """The operator's fake implementation (what torch.compile and torch.export run) makes the same checks on its
    4-D arguments, with no data."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k, v = torch.zeros(2, 4, 5, 8), torch.zeros(2, 4, 6, 8), torch.zeros(2, 4, 6, 3)
        out, lse, _ = torch.ops.sattn.sdpa_forward(q, k, v, None, None, "none", None, 0.0, None, 1)
        assert out.shape == (2, 4, 5, 3) and lse.shape == (2, 4, 5)
        with pytest.raises(ValueError, match=r"key: expected embedding size E = 8 \(from query \[2, 4, 5, 8\]\)"):
            torch.ops.sattn.sdpa_forward(q, k[..., :7], v, None, None, "none", None, 0.0, None, 1)
        with pytest.raises(ValueError, match=r"attn_mask: shape \[3, 6\] does not broadcast"):
            torch.ops.sattn.sdpa_forward(q, k, v, torch.zeros(3, 6), None, "none", None, 0.0, None, 1)
