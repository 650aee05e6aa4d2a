"""SATTN-SR: a lightweight SR transformer with content-adaptive window routing (CAMixer-style).

Layout (x: LR image [B, 3, H, W] in [0, 1]; H, W are reflect-padded to a multiple of `pad_multiple`):
  feat = conv3x3(x)                                   (3 -> C)
  body = feat; for each group: body = group(body)     (group = blocks, then dw3x3 -> conv1x1, plus group residual)
  body = conv3x3(body) + feat
  out  = pixel_shuffle(conv3x3(body) + repeat_interleave(x, s*s, dim=1), s)    (nearest-upsampled residual)
Block (channels-last tokens [B, H, W, C]):
  x = x + conv1x1(gelu(dwconv3x3(x)))                 (cheap path: every pixel)
  shifted blocks (cyclic shifted windows, Swin): x = roll(x, (-ws/2, -ws/2)); windows of ws x ws tokens, row-major
  windows, row-major tokens; the mask of shift_mask() (docs/sparse.md "Shifted windows": the same pairs as the
  non-wrapping sattn.WindowAttention2D(H, W, ws, ws // 2))
  gate g_w = sigmoid(router([mean_w(x), std_w(x)]))  (one score per window, std = population std; router =
                                                      linear 2C -> 1 then BatchNorm1d(1), folded at export)
  routed windows (all in dense mode; g_w > threshold in sparse mode):
      t = x_w + proj(attention(LN1(x_w)))             (heads h, head dim C/h, mask for shifted windows)
      t = t + fc2(gelu(fc1(LN2(t))))
      x_w = x_w + g_w * (t - x_w)
  other windows: unchanged (no LN, projections, attention or MLP computed)
Training relaxation: dense steps (every window weighted by its soft gate g) alternate with sparse steps (hard
threshold, computed only for kept windows); a sparsity loss pushes mean(g) below keep_ratio and g towards {0, 1}.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

LN_EPS = 1e-5


def default_config(scale):
    return dict(scale=scale, dim=40, heads=2, mlp_ratio=2.0,
                groups=[[8, 8], [8, 8], [16, 16]],   # window size of each block, per group (local -> wider)
                threshold=0.5, keep_ratio=0.4)


def check_config(cfg):
    """Raises ValueError naming the first key of an architecture configuration that cannot be built."""
    dim, heads = cfg.get("dim"), cfg.get("heads")
    if not isinstance(dim, int) or dim < 1:
        raise ValueError("dim: expected a positive integer, got %r" % (dim,))
    if not isinstance(heads, int) or heads < 1 or dim % heads:
        raise ValueError("heads: expected a positive integer dividing dim = %d, got %r" % (dim, heads))
    if not isinstance(cfg.get("mlp_ratio"), (int, float)) or int(dim * cfg["mlp_ratio"]) < 1:
        raise ValueError("mlp_ratio: expected a number with dim * mlp_ratio >= 1, got %r" % (cfg.get("mlp_ratio"),))
    groups = cfg.get("groups")
    if not isinstance(groups, list) or not groups or not all(isinstance(g, list) and g for g in groups):
        raise ValueError("groups: expected a non-empty list of non-empty lists of window sizes, got %r" % (groups,))
    for g in groups:
        for ws in g:
            if not isinstance(ws, int) or ws < 2 or ws % 2:
                raise ValueError("groups: window sizes must be even integers >= 2, got %r" % (ws,))
    if not isinstance(cfg.get("threshold"), (int, float)) or not 0.0 < cfg["threshold"] < 1.0:
        raise ValueError("threshold: expected a number in (0, 1), got %r" % (cfg.get("threshold"),))


def window_partition(x, ws):
    """[B, H, W, C] -> [B * nW, ws*ws, C]; windows in row-major order, tokens row-major inside a window."""
    b, h, w, c = x.shape
    x = x.view(b, h // ws, ws, w // ws, ws, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(b * (h // ws) * (w // ws), ws * ws, c)


def window_reverse(xw, ws, b, h, w):
    c = xw.shape[-1]
    x = xw.view(b, h // ws, w // ws, ws, ws, c).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(b, h, w, c)


def shift_mask(h, w, ws, device=None):
    """Additive mask [nW, L, L] (0 or -inf) for cyclic shifted windows (a roll by ws//2): tokens that came from
    different image regions (Swin's 3x3 region labelling) must not attend to each other."""
    s = ws // 2
    lab = torch.zeros(h, w)
    cnt = 0
    for hs in (slice(0, h - ws), slice(h - ws, h - s), slice(h - s, h)):
        for wsl in (slice(0, w - ws), slice(w - ws, w - s), slice(w - s, w)):
            lab[hs, wsl] = cnt
            cnt += 1
    lw = window_partition(lab[None, :, :, None], ws)[..., 0]        # [nW, L]
    diff = lw[:, None, :] != lw[:, :, None]
    return torch.zeros(diff.shape).masked_fill(diff, float("-inf")).to(device)


class WindowBlock(nn.Module):
    def __init__(self, dim, heads, ws, shift, mlp_ratio, router_norm=True):
        super().__init__()
        self.dim, self.heads, self.ws, self.shift = dim, heads, ws, shift
        self.dw = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)
        self.pw = nn.Conv2d(dim, dim, 1)
        self.router = nn.Linear(2 * dim, 1)
        self.norm1 = nn.LayerNorm(dim, eps=LN_EPS)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, eps=LN_EPS)
        hidden = int(dim * mlp_ratio)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)
        # BatchNorm on the router logit: in training the logits of a batch are standardised, so the gates always
        # spread over windows (no collapse of all gates to 0 or 1); at inference it is a fixed affine map that
        # export.py folds into router.weight / router.bias.
        self.router_norm = nn.BatchNorm1d(1) if router_norm else nn.Identity()
        if router_norm:
            nn.init.constant_(self.router_norm.weight, 2.0)
        self.threshold = 0.5
        self._mask_cache = {}

    def _mask(self, h, w, device):
        key = (h, w)
        if key not in self._mask_cache:
            self._mask_cache[key] = shift_mask(h, w, self.ws, device)
        return self._mask_cache[key]

    def gate_logits(self, xw):
        """xw [N, L, C] -> [N] router logits from the window's per-channel mean and population std."""
        mean = xw.mean(dim=1)
        std = (xw - mean[:, None, :]).pow(2).mean(dim=1).add(1e-6).sqrt()   # eps 1e-6 inside the sqrt
        return self.router_norm(self.router(torch.cat([mean, std], dim=-1)))[:, 0]

    def branch(self, xw, mask):
        """Attention + MLP on windows xw [n, L, C]; mask [n, L, L] or None. Returns t - xw."""
        n, L, c = xw.shape
        hd = c // self.heads
        y = self.norm1(xw)
        qkv = self.qkv(y).view(n, L, 3, self.heads, hd).permute(2, 0, 3, 1, 4)   # [3, n, h, L, d]
        q, k, v = qkv[0], qkv[1], qkv[2]
        att = torch.matmul(q, k.transpose(-1, -2)) * (hd ** -0.5)
        if mask is not None:
            att = att + mask[:, None]
        att = att.softmax(dim=-1)
        o = torch.matmul(att, v).transpose(1, 2).reshape(n, L, c)
        t = xw + self.proj(o)
        t = t + self.fc2(F.gelu(self.fc1(self.norm2(t))))
        return t - xw

    def forward(self, x, mode, stats):
        """x: NCHW features. mode: 'dense' | 'sparse'. stats: list collecting (gates, kept) for losses/logging."""
        x = x + self.pw(F.gelu(self.dw(x)))
        b, c, h, w = x.shape
        ws, s = self.ws, self.ws // 2
        t = x.permute(0, 2, 3, 1)
        if self.shift:
            t = torch.roll(t, shifts=(-s, -s), dims=(1, 2))
        xw = window_partition(t, ws)                       # [B*nW, L, C]
        nw = (h // ws) * (w // ws)
        g = torch.sigmoid(self.gate_logits(xw))            # [B*nW]
        mask = self._mask(h, w, x.device) if self.shift else None
        if mode == "dense":
            kept = torch.ones_like(g, dtype=torch.bool)
            m = mask.repeat(b, 1, 1) if mask is not None else None
            xw = xw + g[:, None, None] * self.branch(xw, m)
        else:
            kept = g > self.threshold                       # deterministic routing rule
            idx = kept.nonzero()[:, 0]
            if idx.numel():
                sel = xw.index_select(0, idx)
                m = mask.index_select(0, idx % nw) if mask is not None else None
                upd = sel + g.index_select(0, idx)[:, None, None] * self.branch(sel, m)
                xw = xw.index_copy(0, idx, upd)
        stats.append((g, kept))
        t = window_reverse(xw, ws, b, h, w)
        if self.shift:
            t = torch.roll(t, shifts=(s, s), dims=(1, 2))
        return t.permute(0, 3, 1, 2)


class Group(nn.Module):
    def __init__(self, dim, heads, windows, mlp_ratio, router_norm=True):
        super().__init__()
        self.blocks = nn.ModuleList(
            [WindowBlock(dim, heads, ws, shift=(i % 2 == 1), mlp_ratio=mlp_ratio, router_norm=router_norm)
             for i, ws in enumerate(windows)])
        self.dw = nn.Conv2d(dim, dim, 3, padding=1, groups=dim)
        self.pw = nn.Conv2d(dim, dim, 1)

    def forward(self, x, mode, stats):
        y = x
        for blk in self.blocks:
            y = blk(y, mode, stats)
        return x + self.pw(self.dw(y))


class SattnSR(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = dict(cfg)
        dim, s = cfg["dim"], cfg["scale"]
        self.scale = s
        self.head = nn.Conv2d(3, dim, 3, padding=1)
        # router_norm=False: the exported form, BatchNorm folded into the router linear (export.py)
        self.groups = nn.ModuleList([Group(dim, cfg["heads"], ws, cfg["mlp_ratio"], cfg.get("router_norm", True))
                                     for ws in cfg["groups"]])
        self.body_tail = nn.Conv2d(dim, dim, 3, padding=1)
        self.up = nn.Conv2d(dim, 3 * s * s, 3, padding=1)
        for m in self.modules():
            if isinstance(m, WindowBlock):
                m.threshold = cfg["threshold"]
        self.pad_multiple = max(max(g) for g in cfg["groups"])
        # start close to the nearest-neighbour residual: small output conv
        with torch.no_grad():
            self.up.weight.mul_(0.1)
            self.up.bias.zero_()

    def forward(self, x, mode="dense", stats=None):
        """x [B, 3, H, W] in [0, 1] -> [B, 3, sH, sW] (unclamped). Input is reflect-padded at bottom/right to a
        multiple of pad_multiple and the output cropped back."""
        if stats is None:
            stats = []
        b, _, h, w = x.shape
        pm = self.pad_multiple
        ph, pw = (-h) % pm, (-w) % pm
        xp = F.pad(x, (0, pw, 0, ph), mode="reflect") if (ph or pw) else x
        feat = self.head(xp)
        y = feat
        for grp in self.groups:
            y = grp(y, mode, stats)
        y = self.body_tail(y) + feat
        s = self.scale
        out = F.pixel_shuffle(self.up(y) + xp.repeat_interleave(s * s, dim=1), s)
        return out[:, :, : h * s, : w * s]


def window_cost(ws, dim, hidden):
    """Multiply-adds of one routed ws x ws window (L = ws^2 tokens): qkv, proj, fc1, fc2 (L (4 C^2 + 2 C hidden))
    plus QK^T and AV over all heads (2 L^2 C). A 16x16 window costs about 7.4x an 8x8 one at C = 40, hidden = 80.
    (flops.py counts the routed windows with it; train.py --sparsity-mean cost weights the gates by it.)"""
    L = ws * ws
    return L * (4 * dim * dim + 2 * dim * hidden) + 2 * L * L * dim


def param_count(model):
    return sum(p.numel() for p in model.parameters())


def grow_state(model, src):
    """Load the weights `src` of a smaller SattnSR into the larger `model` so that it computes the same function
    (function-preserving growth, as in Net2Net), then leaves the new parts free to train:
      - tensors with the same name and shape are copied;
      - a wider MLP (larger mlp_ratio): the old hidden units are copied into the first rows of fc1 / first columns
        of fc2, and fc2's new columns are zeroed, so the new hidden units start with no effect on the output;
      - a new group (appended after the old ones): its closing 1x1 conv `pw` is zeroed, so the group starts as the
        identity (x + pw(dw(y)) = x) while its blocks keep their random initialisation.
    Returns (copied, widened, zeroed) name lists. Raises ValueError for any other mismatch (e.g. a block added to an
    existing group, which would not preserve the function)."""
    own = model.state_dict()
    new = {}
    copied, widened, zeroed = [], [], []
    old_groups = 1 + max((int(k.split(".")[1]) for k in src if k.startswith("groups.")), default=-1)
    is_new_group = lambda name: name.startswith("groups.") and int(name.split(".")[1]) >= old_groups
    for name, t in own.items():
        s = src.get(name)
        if s is not None and s.shape == t.shape:
            new[name] = s.clone()
            copied.append(name)
        elif s is not None and s.dim() == t.dim() and all(a <= b for a, b in zip(s.shape, t.shape)) \
                and (name.endswith("fc1.weight") or name.endswith("fc1.bias") or name.endswith("fc2.weight")):
            w = t.clone()
            if name.endswith("fc2.weight"):
                w.zero_()
            w[tuple(slice(0, n) for n in s.shape)] = s
            new[name] = w
            widened.append(name)
        elif s is None and is_new_group(name) and name.split(".")[2] == "pw":
            new[name] = torch.zeros_like(t)
            zeroed.append(name)
        elif s is None and is_new_group(name):
            new[name] = t                                          # a new group's blocks: random init
        else:
            raise ValueError("grow_state: cannot grow %s from %s to %s" % (
                name, None if s is None else tuple(s.shape), tuple(t.shape)))
    model.load_state_dict(new)
    return copied, widened, zeroed
