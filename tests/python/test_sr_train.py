"""SR trainer: a run interrupted and resumed from its checkpoint continues bit-identically (same schedule, data
order and RNG), on a tiny synthetic data set written as PNG."""
import os
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest

torch = pytest.importorskip("torch")

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAIN = os.path.join(REPO, "sr", "train", "train.py")


def write_png(path, rgb):
    h, w, _ = rgb.shape
    raw = b"".join(b"\x00" + rgb[y].tobytes() for y in range(h))
    chunk = lambda t, d: struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xFFFFFFFF)
    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def read_text(path):
    with open(path) as f:
        return f.read()


def make_data(root):
    rng = np.random.default_rng(0)
    for sub, n, size in (("train/T91", 2, 80), ("train/BSD200", 1, 72), ("test/Set5", 1, 36)):
        os.makedirs(os.path.join(root, sub))
        for i in range(n):
            yy, xx = np.mgrid[0:size, 0:size]
            img = (127 + 100 * np.sin(xx / (3 + i)) * np.cos(yy / 5.0))[:, :, None] + rng.normal(0, 5, (size, size, 3))
            write_png(os.path.join(root, sub, "%d.png" % i), np.clip(img, 0, 255).astype(np.uint8))


def run(root, ck, *extra):
    cmd = [sys.executable, TRAIN, "--scale", "2", "--steps", "6", "--batch", "2", "--patch", "32", "--dim", "8",
           "--warmup", "2", "--data", root, "--ckpt-dir", ck, "--threads", "1", "--log-every", "1",
           "--val-every", "100"] + list(extra)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
    return torch.load(os.path.join(ck, "x2_last.pt"), weights_only=False)  # the checkpoint holds RNG states


def test_resume_is_bit_identical(tmp_path):
    root = str(tmp_path / "data")
    make_data(root)
    straight = run(root, str(tmp_path / "a"))
    first = run(root, str(tmp_path / "b"), "--stop-after", "3")
    assert first["step"] == 3
    resumed = run(root, str(tmp_path / "b"), "--resume", "auto")
    assert straight["step"] == resumed["step"] == 6
    for k, v in straight["model"].items():
        assert torch.equal(v, resumed["model"][k]), k
    log = read_text(str(tmp_path / "b" / "x2_train.log"))
    assert "resumed" in log and "val step 6" in log


def test_reschedule_changes_the_schedule_length_on_resume(tmp_path):
    root = str(tmp_path / "data")
    make_data(root)
    ck = str(tmp_path / "c")
    assert run(root, ck, "--stop-after", "3")["step"] == 3
    # without --reschedule the checkpoint's 6-step schedule is kept
    kept = run(root, ck, "--resume", "auto", "--steps", "9", "--stop-after", "1")
    assert kept["step"] == 4 and kept["hparams"]["steps"] == 6
    longer = run(root, ck, "--resume", "auto", "--steps", "9", "--reschedule")
    assert longer["step"] == 9 and longer["hparams"]["steps"] == 9
    log = read_text(os.path.join(ck, "x2_train.log"))
    assert "rescheduled: 6 -> 9 steps" in log and "stopped at step 9 of 9" in log
    # a length that is not past the current step is refused with a message
    bad = subprocess.run([sys.executable, TRAIN, "--scale", "2", "--steps", "5", "--reschedule", "--resume", "auto",
                          "--data", root, "--ckpt-dir", ck, "--threads", "1"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0 and "must exceed the checkpoint's step 9" in bad.stderr


def test_ema_weights_resume_bit_identically_and_are_the_shipped_ones(tmp_path):
    root = str(tmp_path / "data")
    make_data(root)
    straight = run(root, str(tmp_path / "a"), "--ema", "0.5")
    assert run(root, str(tmp_path / "b"), "--ema", "0.5", "--stop-after", "3")["step"] == 3
    resumed = run(root, str(tmp_path / "b"), "--resume", "auto")   # the EMA decay comes from the checkpoint
    assert straight["hparams"]["ema"] == resumed["hparams"]["ema"] == 0.5
    for k, v in straight["model_ema"].items():
        assert torch.equal(v, resumed["model_ema"][k]), k
    assert any(not torch.equal(v, straight["model"][k]) for k, v in straight["model_ema"].items())
    sys.path.insert(0, os.path.join(REPO, "sr", "train"))
    import evaluate
    assert evaluate.shipped_weights(straight) is straight["model_ema"]
    assert "model_ema" not in run(root, str(tmp_path / "c")) and \
        evaluate.shipped_weights({"model": straight["model"]}) is straight["model"]
    log = read_text(str(tmp_path / "b" / "x2_train.log"))
    assert "val step 6 EMA Set5" in log
    bad = subprocess.run([sys.executable, TRAIN, "--scale", "2", "--steps", "5", "--ema", "1.5", "--data", root,
                          "--ckpt-dir", str(tmp_path / "d"), "--threads", "1"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0 and "--ema must be in [0, 1)" in bad.stderr


def test_ema_update_is_the_moving_average():
    sys.path.insert(0, os.path.join(REPO, "sr", "train"))
    import train
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    w0, w1 = a.weight.detach().clone(), b.weight.detach().clone()
    train.update_ema(a, b, 0.75)
    assert torch.allclose(a.weight, 0.75 * w0 + 0.25 * w1)


def test_fit_to_budget_uses_the_measured_speed():
    sys.path.insert(0, os.path.join(REPO, "sr", "train"))
    import train
    # 200 steps in 25 s (0.125 s/step), 100 s budget with a 3 % margin: (97 - 25) / 0.125 = 576 more steps
    assert train.fit_to_budget(200, 0, 25.0, 100.0, 100) == 776
    # a resumed run counts from its own first step
    assert train.fit_to_budget(1200, 1000, 25.0, 100.0, 100) == 1776
    # over budget already: stop after the next step, but never inside the warmup
    assert train.fit_to_budget(200, 0, 90.0, 60.0, 100) == 201
    assert train.fit_to_budget(200, 0, 90.0, 60.0, 500) == 501


def test_time_budget_sets_the_schedule_length(tmp_path):
    root = str(tmp_path / "data")
    make_data(root)
    ck = run(root, str(tmp_path / "t"), "--steps", "100000", "--time-budget", "0.02")
    log = read_text(str(tmp_path / "t" / "x2_train.log"))
    fitted = [l for l in log.splitlines() if "time budget 0.0 min" in l]
    assert len(fitted) == 1, log                        # fitted once at step 200 (half-way lies behind it)
    assert "at step 200 " in fitted[0]
    n = int(fitted[0].rsplit("-> ", 1)[1].split()[0])
    assert 200 < n < 100000 and ck["step"] == ck["hparams"]["steps"] == n
    assert "stopped at step %d of %d" % (n, n) in log


@pytest.mark.parametrize("args,msg", [(["--time-budget", "-1"], "--time-budget must be > 0"),
                                      (["--device", "gpu0"], "--device 'gpu0'")]
                         + ([] if torch.cuda.is_available() else [(["--device", "cuda"], "sees no CUDA GPU")]))
def test_bad_device_or_budget_is_refused_with_a_message(tmp_path, args, msg):
    bad = subprocess.run([sys.executable, TRAIN, "--scale", "2", "--steps", "5", "--data", str(tmp_path),
                          "--ckpt-dir", str(tmp_path / "d"), "--threads", "1"] + args, capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and msg in bad.stderr, bad.stderr


def test_mse_loss_trains_differently_and_resumes_with_the_checkpoints_loss(tmp_path):
    root = str(tmp_path / "data")
    make_data(root)
    l1 = run(root, str(tmp_path / "l1"))
    mse = run(root, str(tmp_path / "m"), "--loss", "mse")
    assert l1["hparams"]["loss"] == "l1" and mse["hparams"]["loss"] == "mse"
    assert any(not torch.equal(v, mse["model"][k]) for k, v in l1["model"].items())
    # the loss belongs to the schedule: a resume without --loss continues with the checkpoint's mse, bit-identically
    run(root, str(tmp_path / "r"), "--loss", "mse", "--stop-after", "3")
    resumed = run(root, str(tmp_path / "r"), "--resume", "auto")
    assert resumed["hparams"]["loss"] == "mse"
    for k, v in mse["model"].items():
        assert torch.equal(v, resumed["model"][k]), k


def _random_model(cfg, seed):
    sys.path.insert(0, os.path.join(REPO, "sr", "train"))
    import model as MD
    torch.manual_seed(seed)
    m = MD.SattnSR(cfg)
    with torch.no_grad():
        for name, t in m.state_dict().items():       # every tensor non-trivial, BatchNorm statistics included
            if t.is_floating_point():
                t.copy_(torch.rand_like(t) * 0.4 + 0.3 if "running_var" in name else torch.randn_like(t) * 0.2)
    return MD, m.eval()


@pytest.mark.parametrize("grow", [{"groups": [[8, 8], [16, 16], [8, 8]]}, {"mlp_ratio": 4.0},
                                  {"groups": [[8, 8], [16, 16], [16, 16]], "mlp_ratio": 3.0}])
def test_grow_state_preserves_the_function(grow):
    small_cfg = dict(scale=2, dim=8, heads=2, mlp_ratio=2.0, groups=[[8, 8], [16, 16]], threshold=0.5,
                     keep_ratio=0.4)
    MD, small = _random_model(small_cfg, 0)
    big = MD.SattnSR(dict(small_cfg, **grow)).eval()
    copied, widened, zeroed = MD.grow_state(big, small.state_dict())
    assert MD.param_count(big) > MD.param_count(small)
    assert len(widened) == (3 * 4 if "mlp_ratio" in grow else 0)     # fc1 weight + bias, fc2 weight; 4 old blocks
    assert len(zeroed) == (2 if "groups" in grow else 0)
    x = torch.rand(2, 3, 19, 37)
    with torch.no_grad():
        for mode in ("dense", "sparse"):
            sa, sb = [], []
            ya, yb = small(x, mode, sa), big(x, mode, sb)
            assert torch.allclose(ya, yb, atol=1e-6, rtol=0), mode
            for (ga, ka), (gb, kb) in zip(sa, sb):      # the old blocks route the same windows
                assert torch.equal(ka, kb)
    # and the grown model is not frozen there: the new parameters get gradients
    big.train()
    big(x, "dense").abs().mean().backward()
    new = [n for n in zeroed] or [n for n in widened if n.endswith("fc2.weight")]
    grads = dict(big.named_parameters())
    assert all(grads[n].grad is not None and grads[n].grad.abs().sum() > 0 for n in new)


def test_grow_state_refuses_other_changes():
    cfg = dict(scale=2, dim=8, heads=2, mlp_ratio=2.0, groups=[[8, 8]], threshold=0.5, keep_ratio=0.4)
    MD, small = _random_model(cfg, 1)
    with pytest.raises(ValueError, match="cannot grow"):
        MD.grow_state(MD.SattnSR(dict(cfg, dim=12)), small.state_dict())
    with pytest.raises(ValueError, match="cannot grow"):                # fewer hidden units: not a growth
        MD.grow_state(MD.SattnSR(dict(cfg, mlp_ratio=1.0)), small.state_dict())
    with pytest.raises(ValueError, match="cannot grow"):                # a block added inside an old group
        MD.grow_state(MD.SattnSR(dict(cfg, groups=[[8, 8, 8]])), small.state_dict())


def test_grow_from_a_checkpoint_on_the_command_line(tmp_path):
    root = str(tmp_path / "data")
    make_data(root)
    base = run(root, str(tmp_path / "a"), "--stop-after", "2")
    init = str(tmp_path / "a" / "x2_last.pt")
    grown = run(root, str(tmp_path / "g"), "--init", init, "--grow", '{"groups": [[8,8],[8,8],[16,16],[8,8]]}',
                "--stop-after", "1")
    assert grown["config"]["groups"] == [[8, 8], [8, 8], [16, 16], [8, 8]]
    assert "groups.3.pw.weight" in grown["model"] and "groups.3.pw.weight" not in base["model"]
    log = read_text(str(tmp_path / "g" / "x2_train.log"))
    assert "grown from %s: 156 tensors copied, 0 widened, 2 zeroed, 48 new" % init in log
    for bad, msg in (("{groups", "not JSON"), ('{"dim": 16}', "expected an object with keys")):
        r = subprocess.run([sys.executable, TRAIN, "--scale", "2", "--steps", "2", "--init", init, "--grow", bad,
                            "--data", root, "--ckpt-dir", str(tmp_path / "x"), "--threads", "1"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and msg in r.stderr, r.stderr
    r = subprocess.run([sys.executable, TRAIN, "--scale", "2", "--steps", "2", "--grow", '{"mlp_ratio": 4}',
                        "--data", root, "--ckpt-dir", str(tmp_path / "y"), "--threads", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--grow needs --init" in r.stderr
    # --init alone continues the architecture it starts from (4 groups here, all tensors), not the default 3 groups
    cont = run(root, str(tmp_path / "c"), "--init", str(tmp_path / "g" / "x2_last.pt"), "--stop-after", "1")
    assert cont["config"]["groups"] == [[8, 8], [8, 8], [16, 16], [8, 8]]
    log = read_text(str(tmp_path / "c" / "x2_train.log"))
    assert "initialised %d/%d tensors" % (len(grown["model"]), len(grown["model"])) in log


def test_cost_weighted_sparsity_loss():
    sys.path.insert(0, os.path.join(REPO, "sr", "train"))
    import train
    # multiply-adds of one window at C = 40, hidden = 80: L (4 C^2 + 2 C hidden) + 2 L^2 C
    assert train.window_cost(8, 40, 80) == 64 * (4 * 1600 + 2 * 40 * 80) + 2 * 64 * 64 * 40 == 1146880
    assert train.window_cost(16, 40, 80) == 8519680
    g8 = torch.tensor([0.9, 0.1, 0.1, 0.1], requires_grad=True)     # cheap block: 4 windows of cost 1
    g16 = torch.tensor([0.9], requires_grad=True)                   # dear block: 1 window of cost 6
    stats = [(g8, g8 > 0.5), (g16, g16 > 0.5)]
    binar = 0.5 * float((torch.cat([g8, g16]) * (1 - torch.cat([g8, g16]))).mean().detach())
    # count: plain mean gate 2.1 / 5 = 0.42; cost: (1.2 + 5.4) / 10 = 0.66 of the work; kept 2/5 windows, 7/10 work
    loss, gmean, kept, kept_work = train.sparsity_loss(stats, 0.3)
    assert abs(float(loss.detach()) - (0.42 - 0.3 + binar)) < 1e-6 and abs(gmean - 0.42) < 1e-6
    assert abs(kept - 0.4) < 1e-6 and abs(kept_work - 0.4) < 1e-6
    loss, gmean, kept, kept_work = train.sparsity_loss(stats, 0.3, [1.0, 6.0])
    assert abs(float(loss.detach()) - (0.66 - 0.3 + binar)) < 1e-6 and abs(gmean - 0.42) < 1e-6
    assert abs(kept - 0.4) < 1e-6 and abs(kept_work - 0.7) < 1e-6
    # below the bound only the binarising term remains; the hinge's gradient per gate is proportional to its cost
    loss, *_ = train.sparsity_loss(stats, 0.7, [1.0, 6.0])
    assert abs(float(loss.detach()) - binar) < 1e-6
    hinge, *_ = train.sparsity_loss([(g8, g8 > 0.5), (g16, g16 > 0.5)], 0.3, [1.0, 6.0])
    hinge.backward()
    d8 = g8.grad[1] - 0.5 * (1 - 2 * 0.1) / 5                       # minus the binarising term's gradient
    d16 = g16.grad[0] - 0.5 * (1 - 2 * 0.9) / 5
    assert abs(float(d8) - 0.1) < 1e-6 and abs(float(d16) - 0.6) < 1e-6
    with pytest.raises(ValueError, match="2 costs for 1 blocks"):
        train.sparsity_loss(stats[:1], 0.3, [1.0, 6.0])


def test_per_image_sparsity_hinge():
    sys.path.insert(0, os.path.join(REPO, "sr", "train"))
    import train
    # 2 images; block A (cost 1) has 2 windows per image, block B (cost 2) 1 window per image
    ga = torch.tensor([0.9, 0.9, 0.1, 0.1], requires_grad=True)
    gb = torch.tensor([0.8, 0.0], requires_grad=True)
    stats = [(ga, ga > 0.5), (gb, gb > 0.5)]
    g = torch.cat([ga, gb]).detach()
    binar = 0.5 * float((g * (1 - g)).mean())
    # image 0 keeps (0.9 + 0.9 + 2 * 0.8) / 4 = 0.85 of its work, image 1 0.2 / 4 = 0.05; the batch 0.45
    batch, *_ = train.sparsity_loss(stats, 0.5, [1.0, 2.0])
    assert abs(float(batch.detach()) - binar) < 1e-6                # the batch mean is under the bound
    loss, gmean, kept, kept_work = train.sparsity_loss(stats, 0.5, [1.0, 2.0], images=2)
    assert abs(float(loss.detach()) - ((0.85 - 0.5) / 2 + binar)) < 1e-6
    assert abs(gmean - 2.8 / 6) < 1e-6 and abs(kept - 3 / 6) < 1e-6 and abs(kept_work - 4 / 8) < 1e-6
    loss.backward()
    # only image 0's gates feel the hinge: d/dg = cost / (4 * 2 images), plus the binarising term
    bin_grad = lambda t, i: 0.5 * (1 - 2 * float(t[i].detach())) / 6
    assert abs(float(ga.grad[0]) - bin_grad(ga, 0) - 1 / 8) < 1e-6
    assert abs(float(gb.grad[0]) - bin_grad(gb, 0) - 2 / 8) < 1e-6
    assert abs(float(ga.grad[2]) - bin_grad(ga, 2)) < 1e-6 and abs(float(gb.grad[1]) - bin_grad(gb, 1)) < 1e-6
    with pytest.raises(ValueError, match="not a multiple of 3 images"):
        train.sparsity_loss(stats, 0.5, [1.0, 2.0], images=3)


def test_sparsity_mean_and_keep_ratio_options(tmp_path):
    root = str(tmp_path / "data")
    make_data(root)
    ck = run(root, str(tmp_path / "c"), "--sparsity-mean", "cost", "--keep-ratio", "0.25", "--sparsity-per", "image")
    assert ck["hparams"]["sparsity_mean"] == "cost" and ck["config"]["keep_ratio"] == 0.25
    assert ck["hparams"]["sparsity_per"] == "image"
    log = read_text(str(tmp_path / "c" / "x2_train.log"))
    assert " work " in log
    plain = run(root, str(tmp_path / "p"))
    assert plain["hparams"]["sparsity_mean"] == "count" and plain["config"]["keep_ratio"] == 0.4
    assert plain["hparams"]["sparsity_per"] == "batch"
    bad = subprocess.run([sys.executable, TRAIN, "--scale", "2", "--steps", "5", "--data", root, "--ckpt-dir",
                          str(tmp_path / "b"), "--threads", "1", "--keep-ratio", "1.5"], capture_output=True,
                         text=True, timeout=120)
    assert bad.returncode == 2 and "--keep-ratio must be in (0, 1]" in bad.stderr, bad.stderr


def test_arch_builds_a_fresh_model_and_refuses_bad_configurations(tmp_path):
    root = str(tmp_path / "data")
    make_data(root)
    ck = run(root, str(tmp_path / "a"), "--arch", '{"dim": 12, "heads": 3, "groups": [[8, 8], [16, 16]]}',
             "--stop-after", "2")
    assert ck["config"]["dim"] == 12 and ck["config"]["heads"] == 3
    assert ck["config"]["groups"] == [[8, 8], [16, 16]] and ck["step"] == 2
    assert ck["model"]["groups.1.blocks.0.qkv.weight"].shape == (36, 12)
    # the checkpoint resumes with its own architecture
    resumed = run(root, str(tmp_path / "a"), "--resume", "auto")
    assert resumed["config"] == ck["config"] and resumed["step"] == 6
    for bad, msg in (("{dim", "not JSON"), ('{"scale": 4}', "expected an object with keys"),
                     ('{"dim": 12, "heads": 5}', "heads: expected a positive integer dividing dim = 12, got 5"),
                     ('{"groups": [[8, 7]]}', "window sizes must be even integers >= 2, got 7"),
                     ('{"groups": []}', "groups: expected a non-empty list"),
                     ('{"threshold": 1.5}', "threshold: expected a number in (0, 1), got 1.5")):
        r = subprocess.run([sys.executable, TRAIN, "--scale", "2", "--steps", "2", "--arch", bad, "--data", root,
                            "--ckpt-dir", str(tmp_path / "x"), "--threads", "1"],
                           capture_output=True, text=True, timeout=120)
        assert r.returncode != 0 and msg in r.stderr, r.stderr
    r = subprocess.run([sys.executable, TRAIN, "--scale", "2", "--steps", "2", "--arch", '{"dim": 16}', "--init",
                        str(tmp_path / "a" / "x2_last.pt"), "--data", root, "--ckpt-dir", str(tmp_path / "y"),
                        "--threads", "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--arch describes a fresh model" in r.stderr


def test_bf16_autocast_trains_with_float32_master_weights(tmp_path):
    root = str(tmp_path / "data")
    make_data(root)
    plain = run(root, str(tmp_path / "a"), "--stop-after", "3")
    mixed = run(root, str(tmp_path / "b"), "--stop-after", "3", "--autocast", "bf16")
    assert mixed["hparams"]["autocast"] == "bf16" and mixed["step"] == 3
    assert all(v.dtype == torch.float32 for v in mixed["model"].values() if v.is_floating_point())
    # the same seeds and data: the bf16 products change the weights, but not far from the float32 run's
    diffs = [float((mixed["model"][k] - v).abs().max()) for k, v in plain["model"].items() if v.is_floating_point()]
    assert 0 < max(diffs) < 0.05
    log = read_text(str(tmp_path / "b" / "x2_train.log"))
    assert "'autocast': 'bf16'" in log and "step 3 " in log
