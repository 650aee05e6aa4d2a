"""Train SattnSR on T91 + BSD200 (CPU, resumable, seeded).

  python3 sr/train/train.py --scale 2 --steps 12000 --resume auto
The cosine schedule length is --steps (fix it up front; a resumed run continues the same schedule). A checkpoint
(model + Adam state + step + RNG states + config) is written atomically to <ckpt-dir>/x<s>_last.pt every
--save-minutes and at the end; --resume auto picks it up. --stop-after N ends this run after N more steps;
--reschedule with --resume changes the schedule length to --steps (to fit a run into the time left).
--ema D keeps an exponential moving average of the weights (decay D per step) beside them; the checkpoint stores it
as "model_ema", and export.py / evaluate.py use it when present (the training weights stay in "model" for resuming).
--loss mse fine-tunes on the squared error that PSNR measures (L1 stays in the log for comparison).
--device cuda trains on a GPU (checkpoints stay loadable on the CPU). --time-budget M fits the schedule to a
wall-clock budget: after 200 timed steps, and again half-way, the schedule length is set so that this run ends about
M minutes after its first step (the cosine recomputed as with --reschedule; the new length is logged).
Memory: glibc's heap can grow without bound here (--patch 96 --batch 8 reached 12.3 GiB) and spends a quarter of
the CPU time on page faults. Run the trainer under jemalloc with purging off (Debian libjemalloc2):
  LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libjemalloc.so.2 MALLOC_CONF=dirty_decay_ms:-1,muzzy_decay_ms:-1 python3 ...
(1.5-1.8 GiB per trainer, no kernel time, faster; sr/README.md). MALLOC_MMAP_THRESHOLD_=1048576 also bounds the
memory but is slower.
--sparsity-mean cost (with --keep-ratio R) bounds the fraction of the dense window work the gates keep (each gate
weighted by its window's multiply-adds, window_cost) instead of the plain mean gate: the mean gate lets the few, 7x
dearer 16x16 windows stay routed while the many cheap 8x8 ones are pruned (sr/README.md). --sparsity-per image
applies the hinge to each image's mean instead of the batch's (a batch mean lets textured images route far more).
--arch JSON starts a fresh model from the default configuration with these overrides (dim, heads, mlp_ratio, groups,
threshold), e.g. '{"dim": 64, "heads": 4, "groups": [[8, 8], [16, 16], [16, 16], [8, 8]]}'.
--autocast bf16 runs the forward and backward under torch.autocast(dtype=torch.bfloat16) with float32 master weights
(only worth it where the CPU has bf16 matrix instructions; sr/README.md has the measured step times).
--grow JSON with --init builds a larger model than the --init one and loads it function-preservingly
(model.grow_state): '{"groups": [...]}' appends groups, '{"mlp_ratio": R}' widens the MLPs.
"""
import argparse
import atexit
import json
import math
import os
import random
import signal
import sys
import time


def _size_thread_pools_from_argv():
    """OpenBLAS (which Debian's torch calls for its matmuls) and OpenMP size their pools when they load, one worker
    per core unless told otherwise. With --threads 1 the extra workers spin beside torch: two trainers on 2 cores
    measured 0.9-1.3 s/step with ~300 k context switches/s, 0.5 s/step with the pools at 1. So the pools get the
    --threads count (unless the environment already sets them) before numpy and torch are imported."""
    n = "2"  # --threads' default
    for i, arg in enumerate(sys.argv):
        if arg == "--threads" and i + 1 < len(sys.argv):
            n = sys.argv[i + 1]
        elif arg.startswith("--threads="):
            n = arg.split("=", 1)[1]
    if n.isdigit() and int(n) > 0:
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(var, n)


_size_thread_pools_from_argv()

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import imgio  # noqa: E402
import imresize as R  # noqa: E402
import model as MD  # noqa: E402
import evaluate as EV  # noqa: E402

REPO = os.path.dirname(os.path.dirname(HERE))


def load_train_set(root, scale, log):
    """[(hr_u8, lr_u8)] for every image in root/T91 and root/BSD200, LR made once with the MATLAB bicubic."""
    data, t0 = [], time.time()
    for sub in ("T91", "BSD200"):
        for p in imgio.list_images(os.path.join(root, sub)):
            hr = R.mod_crop(imgio.read_image(p), scale)
            data.append((hr, R.downscale(hr, scale)))
    log("loaded %d training images in %.1f s" % (len(data), time.time() - t0))
    return data


def drop_small(data, patch, log):
    """Images whose LR side is below the patch cannot give a crop (some T91 images at x4): leave them out."""
    kept = [d for d in data if min(d[1].shape[:2]) >= patch]
    if len(kept) < len(data):
        log("left out %d images with an LR side < %d" % (len(data) - len(kept), patch))
    if not kept:
        raise SystemExit("no training image has an LR side >= --patch %d" % patch)
    return kept


def sample_batch(data, rng, batch, patch, scale):
    """Random LR crops of patch x patch (+ aligned HR), random h/v flip and 90-degree rotation."""
    lrs, hrs = [], []
    for _ in range(batch):
        hr, lr = data[rng.integers(len(data))]
        h, w = lr.shape[:2]
        i, j = rng.integers(h - patch + 1), rng.integers(w - patch + 1)
        l = lr[i:i + patch, j:j + patch]
        g = hr[i * scale:(i + patch) * scale, j * scale:(j + patch) * scale]
        if rng.random() < 0.5:
            l, g = l[:, ::-1], g[:, ::-1]
        if rng.random() < 0.5:
            l, g = l[::-1], g[::-1]
        if rng.random() < 0.5:
            l, g = l.transpose(1, 0, 2), g.transpose(1, 0, 2)
        lrs.append(np.ascontiguousarray(l))
        hrs.append(np.ascontiguousarray(g))
    f = lambda a: torch.from_numpy(np.stack(a)).permute(0, 3, 1, 2).float().div_(255.0)
    return f(lrs), f(hrs)


def lr_at(step, total, base, warmup, floor):
    if step < warmup:
        return base * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return floor + 0.5 * (base - floor) * (1.0 + math.cos(math.pi * min(1.0, t)))


window_cost = MD.window_cost   # multiply-adds of one routed window (model.py)


def sparsity_loss(stats, keep_ratio, costs=None, images=None):
    """Hinge on the mean gate above keep_ratio + a push of every gate towards 0 or 1 (g(1-g)).

    stats: one (gates, kept) per block, in forward order. costs=None: the mean over all gates (every window counts
    the same, so the many cheap 8x8 windows dominate it); costs = one window_cost per block: the mean weighted by
    each window's cost, i.e. the fraction of the dense window work that the gates keep (--sparsity-mean cost).
    images=None: one hinge on the mean over the whole batch; images=B: the gates of each block are B images' windows
    in order, and the loss is the mean over images of each image's own hinge, so a textured image above the bound
    is pushed down even when flat images in its batch leave the batch mean below it (--sparsity-per image).
    Returns (loss, mean gate, kept fraction of windows, kept fraction of the window work)."""
    if costs is not None and len(costs) != len(stats):
        raise ValueError("sparsity_loss: %d costs for %d blocks" % (len(costs), len(stats)))
    if images is not None and any(s[0].numel() % images for s in stats):
        raise ValueError("sparsity_loss: a block's gate count is not a multiple of %d images" % images)
    g = torch.cat([s[0] for s in stats])
    w = costs if costs is not None else [1.0] * len(stats)
    den = sum(c * s[0].numel() for c, s in zip(w, stats))
    kept = [float(s[1].sum()) for s in stats]
    kept_work = sum(c * k for c, k in zip(w, kept)) / den
    if images is None:
        hinge = F.relu(sum(c * s[0].sum() for c, s in zip(w, stats)) / den - keep_ratio)
    else:
        per_image = sum(c * s[0].view(images, -1).sum(1) for c, s in zip(w, stats)) / (den / images)
        hinge = F.relu(per_image - keep_ratio).mean()
    return hinge + 0.5 * (g * (1 - g)).mean(), float(g.detach().mean()), sum(kept) / g.numel(), kept_work


@torch.no_grad()
def update_ema(ema, model, decay):
    """ema <- decay * ema + (1 - decay) * model, parameters and float buffers alike."""
    for e, m in zip(ema.state_dict().values(), model.state_dict().values()):
        if e.is_floating_point():
            e.mul_(decay).add_(m, alpha=1.0 - decay)
        else:
            e.copy_(m)


BUDGET_PROBE_STEPS = 200   # --time-budget: steps timed before the first fit


def fit_to_budget(step, first_step, elapsed, budget_s, warmup):
    """Schedule length that ends about budget_s after the first step, at the speed measured so far (3 % margin)."""
    rate = elapsed / max(1, step - first_step)                  # seconds per step, validation included
    return max(step + 1, warmup + 1, step + int((0.97 * budget_s - elapsed) / rate))


def save_atomic(obj, path):
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def config_overrides(ap, flag, text, keys):
    """The JSON object `text` given to `flag`, whose keys must come from `keys` (else ap.error names them)."""
    try:
        over = json.loads(text)
    except ValueError as e:
        ap.error("%s %r: not JSON (%s)" % (flag, text, e))
    if not isinstance(over, dict) or not set(over) <= set(keys):
        ap.error("%s %r: expected an object with keys from %s" % (flag, text, ", ".join(keys)))
    return over


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scale", type=int, default=2, choices=(2, 4))
    ap.add_argument("--steps", type=int, required=True, help="total schedule length (fixed across resumes)")
    ap.add_argument("--resume", default=None, help="checkpoint path, or 'auto' for <ckpt-dir>/x<s>_last.pt")
    ap.add_argument("--init", default=None, help="initialise weights from another checkpoint (e.g. x2 for x4)")
    ap.add_argument("--grow", default=None, metavar="JSON",
                    help="with --init: a larger model than the --init one, as config overrides, e.g. "
                         "'{\"groups\": [[8,8],[8,8],[16,16],[16,16]]}' (a new group appended) or "
                         "'{\"mlp_ratio\": 4}' (wider MLPs); grown function-preservingly (model.grow_state)")
    ap.add_argument("--arch", default=None, metavar="JSON",
                    help="a fresh model: config overrides of the default, keys from dim, heads, mlp_ratio, groups, "
                         "threshold, e.g. '{\"dim\": 64, \"heads\": 4}' (not with --resume/--init)")
    ap.add_argument("--autocast", default="off", choices=("off", "bf16"),
                    help="bf16: forward and backward under torch.autocast (bfloat16), float32 master weights")
    ap.add_argument("--stop-after", type=int, default=None, help="stop this run after N steps")
    ap.add_argument("--reschedule", action="store_true",
                    help="on resume, replace the checkpoint's schedule length by --steps (the cosine is "
                         "recomputed for the new length from the current step on)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--patch", type=int, default=32, help="LR patch size")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--lr-floor", type=float, default=1e-5)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--dense-prob", type=float, default=0.5, help="probability of a dense (soft-gate) step")
    ap.add_argument("--loss", default="l1", choices=("l1", "mse"),
                    help="pixel loss: l1 (default), or mse to fine-tune for PSNR (its gradients are ~2|err| times "
                         "L1's, so scale --sparsity-weight down with it)")
    ap.add_argument("--sparsity-weight", type=float, default=0.02)
    ap.add_argument("--sparsity-mean", default="count", choices=("count", "cost"),
                    help="what the sparsity hinge bounds by keep_ratio: the plain mean gate (count, the default, "
                         "which the shipped weights were trained with) or the mean weighted by each window's "
                         "multiply-adds (cost: the fraction of the dense window work kept, so the deep 16x16 "
                         "blocks, 7x dearer per window, count 7x)")
    ap.add_argument("--sparsity-per", default="batch", choices=("batch", "image"),
                    help="where the hinge applies: to the batch's mean (batch, the default) or to each image's "
                         "own mean, averaged (image: textured images are held to the bound too)")
    ap.add_argument("--keep-ratio", type=float, default=None,
                    help="override the config's keep_ratio (the hinge's bound; stored in the config)")
    ap.add_argument("--ema", type=float, default=0.0, help="weight EMA decay per step (0: off), e.g. 0.999")
    ap.add_argument("--dim", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="torch device to train on: cpu (default), cuda, cuda:1, ...")
    ap.add_argument("--time-budget", type=float, default=None, metavar="MINUTES",
                    help="fit the schedule length to this wall-clock budget (measured after %d steps, re-fitted "
                         "half-way); overrides --steps for this run" % BUDGET_PROBE_STEPS)
    ap.add_argument("--data", default=os.path.join(REPO, "..", "shared", "data", "sr"))
    ap.add_argument("--ckpt-dir", default=os.path.join(REPO, "sr", "checkpoints"))
    ap.add_argument("--save-minutes", type=float, default=10.0)
    ap.add_argument("--val-every", type=int, default=300)
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--log", default=None, help="log file (default <ckpt-dir>/x<s>_train.log)")
    a = ap.parse_args()
    if not 0.0 <= a.ema < 1.0:
        ap.error("--ema must be in [0, 1) (0: off; e.g. 0.999), got %g" % a.ema)
    if a.time_budget is not None and a.time_budget <= 0:
        ap.error("--time-budget must be > 0 minutes, got %g" % a.time_budget)
    try:
        device = torch.device(a.device)
    except RuntimeError as e:
        ap.error("--device %r: %s" % (a.device, e))
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error("--device %s: this torch sees no CUDA GPU" % a.device)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True               # fixed patch shapes: let cuDNN pick its conv kernels
        torch.backends.cuda.matmul.allow_tf32 = True        # the attention's matmuls on TF32 tensor cores, as
        # cuDNN's convolutions already are by default (float32 weights, Adam and loss; the C++ evaluator scores)
    torch.set_num_threads(a.threads)
    os.makedirs(a.ckpt_dir, exist_ok=True)
    log_path = a.log or os.path.join(a.ckpt_dir, "x%d_train.log" % a.scale)
    logf = open(log_path, "a")
    atexit.register(logf.close)

    def log(msg):
        line = time.strftime("%Y-%m-%d %H:%M:%S ") + msg
        print(line, flush=True)
        logf.write(line + "\n")
        logf.flush()

    ckpt_path = os.path.join(a.ckpt_dir, "x%d_last.pt" % a.scale)
    resume = ckpt_path if a.resume == "auto" else a.resume
    if resume and not os.path.exists(resume):
        if a.resume != "auto":
            sys.exit("train.py: --resume %s does not exist" % resume)
        resume = None
    # weights_only=False: the checkpoints (this script's own) hold RNG states and hparams besides tensors, which
    # torch >= 2.6 refuses to unpickle by default
    ck = torch.load(resume, map_location="cpu", weights_only=False) if resume else None

    init_ck = torch.load(a.init, map_location="cpu", weights_only=False) if a.init and not ck else None
    if ck:
        cfg = ck["config"]
    elif init_ck is not None and "config" in init_ck:
        # the architecture of the weights it starts from (e.g. the grown 4-group x2 model), at this run's scale
        cfg = dict(init_ck["config"], scale=a.scale)
    else:
        cfg = MD.default_config(a.scale)
    if not ck and a.dim:
        cfg["dim"] = a.dim
    if a.arch is not None:
        if ck or a.init:
            ap.error("--arch describes a fresh model: not with a checkpoint to resume or --init")
        cfg.update(config_overrides(ap, "--arch", a.arch, ("dim", "heads", "mlp_ratio", "groups", "threshold")))
        try:
            MD.check_config(cfg)
        except ValueError as e:
            ap.error("--arch %r: %s" % (a.arch, e))
    if a.grow and not ck:
        if not a.init:
            ap.error("--grow needs --init (the weights to grow from)")
        cfg.update(config_overrides(ap, "--grow", a.grow, ("groups", "mlp_ratio")))
    if a.keep_ratio is not None:
        if not 0.0 < a.keep_ratio <= 1.0:
            ap.error("--keep-ratio must be in (0, 1], got %g" % a.keep_ratio)
        if ck and cfg.get("keep_ratio") != a.keep_ratio:
            log("note: --keep-ratio %g ignored, the checkpoint's config has %g" % (a.keep_ratio, cfg["keep_ratio"]))
        elif not ck:
            cfg["keep_ratio"] = a.keep_ratio
    torch.manual_seed(a.seed)
    model = MD.SattnSR(cfg).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=a.lr, betas=(0.9, 0.99))
    rng = np.random.default_rng(a.seed)
    step = 0
    hp = dict(vars(a))
    if ck:
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        step = ck["step"]
        rng.bit_generator.state = ck["rng_numpy"]
        torch.set_rng_state(ck["rng_torch"])
        random.setstate(ck["rng_python"])
        hp = ck["hparams"]                      # the schedule is fixed by the first run
        if a.reschedule and a.steps != hp["steps"]:
            if a.steps <= step:
                sys.exit("train.py: --steps %d with --reschedule must exceed the checkpoint's step %d" % (a.steps, step))
            log("rescheduled: %d -> %d steps (cosine recomputed from step %d)" % (hp["steps"], a.steps, step))
            hp["steps"] = a.steps
        elif a.steps != hp["steps"]:
            log("note: --steps %d ignored, the checkpoint's schedule has %d steps" % (a.steps, hp["steps"]))
        log("resumed %s at step %d" % (resume, step))
    elif a.init:
        src = EV.shipped_weights(init_ck)
        own = model.state_dict()
        if a.grow:
            try:
                copied, widened, zeroed = MD.grow_state(model, src)
            except ValueError as e:
                sys.exit("train.py: --grow: %s" % e)
            log("grown from %s: %d tensors copied, %d widened, %d zeroed, %d new" % (
                a.init, len(copied), len(widened), len(zeroed), len(own) - len(copied) - len(widened) - len(zeroed)))
        else:
            ok = {k: v for k, v in src.items() if k in own and own[k].shape == v.shape}
            model.load_state_dict(ok, strict=False)
            log("initialised %d/%d tensors from %s" % (len(ok), len(own), a.init))
    hp.setdefault("ema", 0.0)                   # checkpoints from before --ema
    hp.setdefault("loss", "l1")                 # checkpoints from before --loss
    hp.setdefault("sparsity_mean", "count")     # checkpoints from before --sparsity-mean
    hp.setdefault("autocast", "off")            # checkpoints from before --autocast
    hp.setdefault("sparsity_per", "batch")      # checkpoints from before --sparsity-per
    blocks = [blk for grp in model.groups for blk in grp.blocks]
    costs = ([window_cost(blk.ws, cfg["dim"], blk.fc1.out_features) for blk in blocks]
             if hp["sparsity_mean"] == "cost" else None)
    ema = None
    if hp["ema"] > 0:
        ema = MD.SattnSR(cfg).to(device)
        ema.load_state_dict(ck["model_ema"] if ck and "model_ema" in ck else model.state_dict())
        ema.eval()
        for p_ in ema.parameters():
            p_.requires_grad_(False)
    log("config %s params %d hparams %s device %s" % (cfg, MD.param_count(model), hp, device))

    data = drop_small(load_train_set(os.path.join(a.data, "train"), a.scale, log), hp["patch"], log)
    val = EV.load_pairs(os.path.join(a.data, "test", "Set5"), a.scale)

    def checkpoint():
        state = dict(model=model.state_dict(), optimizer=opt.state_dict(), step=step, config=cfg,
                     hparams=hp, rng_numpy=rng.bit_generator.state, rng_torch=torch.get_rng_state(),
                     rng_python=random.getstate())
        if ema is not None:
            state["model_ema"] = ema.state_dict()
        save_atomic(state, ckpt_path)
        log("checkpoint step %d -> %s" % (step, ckpt_path))

    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    signal.signal(signal.SIGINT, lambda *_: stop.update(flag=True))

    total, end = hp["steps"], hp["steps"]
    if a.stop_after is not None:
        end = min(end, step + a.stop_after)
    last_save, t_log, acc = time.time(), time.time(), []
    first_step, t_first = step, time.time()
    next_fit = first_step + BUDGET_PROBE_STEPS if a.time_budget is not None else None   # step of the next fit
    refit_halfway = True
    model.train()
    while step < end and not stop["flag"]:
        if next_fit is not None and step >= next_fit:
            elapsed = time.time() - t_first
            new_total = fit_to_budget(step, first_step, elapsed, a.time_budget * 60, hp["warmup"])
            log("time budget %.1f min: %.1f s elapsed at step %d (%.3f s/step); schedule %d -> %d steps" % (
                a.time_budget, elapsed, step, elapsed / (step - first_step), total, new_total))
            total = end = hp["steps"] = new_total
            if a.stop_after is not None:
                end = min(end, first_step + a.stop_after)
            half = first_step + (new_total - first_step) // 2
            next_fit = half if refit_halfway and half > step else None
            refit_halfway = False
        lr_now = lr_at(step, total, hp["lr"], hp["warmup"], hp["lr_floor"])
        for gp in opt.param_groups:
            gp["lr"] = lr_now
        x, y = sample_batch(data, rng, hp["batch"], hp["patch"], a.scale)
        x, y = x.to(device), y.to(device)
        mode = "dense" if rng.random() < hp["dense_prob"] else "sparse"
        stats = []
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=hp["autocast"] == "bf16"):
            out = model(x, mode=mode, stats=stats)
        out = out.float()
        stats = [(g.float(), kept) for g, kept in stats]
        l1 = F.l1_loss(out, y)                  # logged whatever the loss, so runs compare
        pixel = l1 if hp["loss"] == "l1" else F.mse_loss(out, y)
        sl, gmean, kept, kept_work = sparsity_loss(stats, cfg["keep_ratio"], costs,
                                                       hp["batch"] if hp["sparsity_per"] == "image" else None)
        loss = pixel + hp["sparsity_weight"] * sl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if ema is not None:
            update_ema(ema, model, hp["ema"])
        step += 1
        acc.append((float(l1.detach()), gmean, kept, mode == "dense", kept_work))
        if step % a.log_every == 0 or step == end:
            dt = (time.time() - t_log) / len(acc)
            sparse_steps = [q for q in acc if not q[3]]
            log("step %d lr %.2e l1 %.5f gate_mean %.3f kept %.3f work %.3f (%.2f s/step)" % (
                step, lr_now, np.mean([q[0] for q in acc]), np.mean([q[1] for q in acc]),
                np.mean([q[2] for q in sparse_steps] or [float("nan")]),
                np.mean([q[4] for q in sparse_steps] or [float("nan")]), dt))
            acc, t_log = [], time.time()
        if step % a.val_every == 0 or step == end:
            model.eval()
            for name, m in (("", model),) + ((("EMA ", ema),) if ema is not None else ()):
                rd, rs = EV.evaluate(val, a.scale, "dense", m), EV.evaluate(val, a.scale, "sparse", m)
                log("val step %d %sSet5 x%d PSNR dense %.3f sparse %.3f (windows routed %.3f)" % (
                    step, name, a.scale, rd["psnr"], rs["psnr"], rs["kept_fraction"]))
            model.train()
            t_log = time.time()
        if time.time() - last_save > a.save_minutes * 60:
            checkpoint()
            last_save = time.time()
    checkpoint()
    log("stopped at step %d of %d" % (step, total))


if __name__ == "__main__":
    main()
