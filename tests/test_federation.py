"""tests/test_federation.py - train.py --federation: sites training one model through
the central services, for real (CPU, gloo, 127.0.0.1).

What runs (the expensive part is two launches, ~2-3 minutes on 2 busy cores):
  - FederationRunTest: darl_server.py, fedmom_server.py (--darl) and blobstore.py as
    subprocesses on free loopback ports; the initial model from `train.py --export-init`;
    two sites as separate torchrun jobs: "alpha" (FSDP2, 2 ranks, inline transport, int4
    deltas with error feedback, --overlap --overlap-fold eager: it trains its next phase
    while a delta is in flight, from one local Nesterov step of its own delta with the
    aggregator's lr 0.7 and momentum 0.9, folds theta_global in on arrival, and is killed
    and resumed with a delta in flight and its estimate of the aggregator's momentum in
    its checkpoint; both jobs run --encode-on device: each rank
    encodes its own rows, keeps its own residual, and adds theta_global's int4 update to
    its rows, the host checking the digest behind) and "beta" (DDP, 1 rank, blob transport, top-k
    deltas, --throttle-ms: the slow one; --overlap --overlap-fold end, folding theta_global
    in at the end of the phase it arrived in);
    theta_global comes down as int4 updates (--down-wire).
    The scenario, each step waiting on a condition (never on a fixed sleep):
      both merge -> alpha SIGKILLed (once two of its checkpoints hold a non-zero momentum
      estimate), beta merges alone (membership 2 -> 1) -> alpha
      restarted with --resume auto (its leases and membership expire first) and merges
      with beta again (1 -> 2) -> fedmom_server SIGKILLed and restarted on the same
      port and state dir, the sites carry on -> DARL runs out of blocks, both exit 0.
    Then the books: every DARL block committed, per-cluster sums = total, nothing
    quarantined; the merged deltas carry exactly the corpus' training tokens and each
    lease once (no window merged twice or never); both sites' phases started before their
    previous delta's round trip ended, and their merged deltas named the round they merged
    into - 1 (the server's rule, unchanged under overlap); the loss falls; the compressed deltas
    crossed at their format's size, and alpha's error-feedback files (one per rank) came
    through the kill (used by the restarted job, or reset with the reason said), each job's
    log and rows naming the encoder it ran; alpha's restarted job restored, from the
    checkpoint it resumed at, the momentum estimate the killed job wrote there (the same
    step, round and non-zero norm); the updates came down
    at int4's size and each site's last theta is the aggregator's, bit for bit. Everything runs over
    TLS (a CA and certificate made with openssl, as central.sh makes them): the three
    servers serve https, FedMom and both sites check them against the CA file.
  - CarrierTest: one torchrun job of 2 ranks (this file's `worker` mode): FSDP2's
    per-tensor gather (the delta file) and scatter (theta_global) against the unsharded
    state, including unevenly sharded tensors; the int4 delta and residual encoded on the
    device (wire_torch, each rank its rows) bit for bit those of the host path; and a stale
    delta - the site's base round is overtaken before it sends - is refused (409), not
    merged, its lease released in DARL, and the site ends on the current theta_global.
  - DeviceCheckTest: one site in this process (--encode-on device on CPU torch, int4 both
    ways): the update added on the device is the aggregator's theta; then the host's file,
    read by the check behind (held at the fault point site.check), is damaged: the check
    fails loudly, the next delta is not sent, its lease goes back to the pool, and the
    site reloads theta_global whole.
  - cheap checks in-process: the ragged-step arithmetic, identity and flag errors, and
    --export-init's names.
"""
import dataclasses
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
import types
import unittest

import numpy as np

import block_space
import certs
import data
import dist_env
import durable
import fedphase
import fedsite
from testbed import harness
import httpc
import testhooks
import tokenize_corpus as tc
import train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KEEP = os.environ.get("PWW_TEST_KEEP")      # set: keep the temp dirs (logs, state) for a post-mortem


def log_of(tmp, name):
    return os.path.join(tmp, f"{name}.log")


def make_corpus(tmp, max_bytes):
    out = os.path.join(tmp, "tok")
    tc.tokenize(tc.TokenizeConfig(inputs=[], out=out, seq_len=64, max_files=40, max_bytes=max_bytes,
                                  heldout_windows=32, progress=False))
    return os.path.join(out, "manifest.json")


def export_init(t, manifest):
    """train.py --export-init of qwen3-tiny into t/init.safetensors -> its path."""
    init = os.path.join(t, "init.safetensors")
    subprocess.run([sys.executable, "train.py", "--export-init", init, "--model", "qwen3-tiny", "--data", manifest],
                   cwd=ROOT, env=harness.child_env(), check=True, capture_output=True, timeout=300)
    return init


# ---------------------------------------------------------------------------
# in-process: arithmetic, flags, identity, --export-init
# ---------------------------------------------------------------------------

class LeasedPhaseTest(unittest.TestCase):
    def test_every_window_once_and_the_same_call_count_on_every_rank(self):
        for n, world, batch, accum in ((32, 2, 4, 1), (25, 2, 4, 1), (1, 2, 4, 1), (41, 3, 2, 2), (7, 4, 4, 2)):
            windows = np.arange(100, 100 + n)
            per_step = batch * world * accum
            phases = [data.LeasedPhase(1, 0, 4, windows, per_step, world, r, batch) for r in range(world)]
            seen = []
            for s in range(phases[0].steps):
                counts = {len(p.micro_batches(s)) for p in phases}
                self.assertEqual(len(counts), 1, f"ranks disagree on micro-batches: n={n} step {s}")
                self.assertLessEqual(counts.pop(), accum)
                for p in phases:
                    for mb in p.micro_batches(s):
                        self.assertLessEqual(len(mb), batch)
                        seen.extend(mb.tolist())
            self.assertEqual(sorted(seen), windows.tolist(), f"n={n}: every leased window exactly once")
            self.assertEqual(phases[0].steps, -(-n // per_step))

    def test_span_windows_are_the_blocks_samples_shuffled_alike(self):
        space = block_space.BlockSpace(100, 8, seed=3)
        a = data.span_windows(space, 2, 5, seed=0, lease=7)
        want = sorted(w for p in range(2, 5) for w in space.samples_of(space.block_at(p)))
        self.assertEqual(sorted(a.tolist()), want)
        self.assertEqual(a.tolist(), data.span_windows(space, 2, 5, seed=0, lease=7).tolist())
        self.assertNotEqual(a.tolist(), data.span_windows(space, 2, 5, seed=0, lease=8).tolist())
        self.assertEqual(data.blocks_per_phase(4, 8, 8), 4)
        self.assertEqual(data.blocks_per_phase(4, 6, 8), 3)    # 24 windows -> 3 blocks, no step dropped


    def test_a_phase_the_clock_ends_stops_on_a_block_boundary_and_names_only_what_it_trained(self):
        space = block_space.BlockSpace(num_samples=53, block_size=5, seed=3)    # the last block is short
        w, bounds, ends = data.span_windows_blocked(space, 7, 11, seed=0, lease=2)
        self.assertEqual(ends.tolist(), [8, 9, 10, 11])
        sizes = [len(space.samples_of(space.block_at(p))) for p in range(7, 11)]
        self.assertEqual(sorted(sizes), [3, 5, 5, 5])
        self.assertEqual(bounds.tolist(), np.cumsum(sizes).tolist())
        for i in range(4):       # every prefix ending on a bound is exactly the windows of its positions
            want = sorted(x for p in range(7, 8 + i) for x in space.samples_of(space.block_at(p)))
            self.assertEqual(sorted(w[:bounds[i]].tolist()), want)
        self.assertEqual(w.tolist(), data.span_windows_blocked(space, 7, 11, seed=0, lease=2)[0].tolist())
        ph = data.LeasedPhase(2, 7, 11, w, per_step=4, world=2, rank=0, batch=2, bounds=bounds, ends=ends)
        self.assertEqual(ph.steps, 5)
        b0, b1 = int(bounds[0]), int(bounds[1])
        # b0 - 1 windows trained: b0 is one step of 0.5 s away, the bound after it `need` s (>= 1 s);
        # with 0.6 s left the first bound is nearer the budget: the phase stops there (one short step
        # more); with need - 0.1 s left the next one overruns less than b0 falls short: go on
        need = -(-(b1 - b0 + 1) // 4) * 0.5
        self.assertGreaterEqual(need, 1.0)
        self.assertEqual(ph.cut_point(b0 - 1, 0.6, 0.5), b0)
        self.assertIsNone(ph.cut_point(b0 - 1, need - 0.1, 0.5))
        self.assertIsNone(ph.cut_point(b0 - 1, need, 0.5))          # time enough: go on
        self.assertIsNone(ph.cut_point(16, 0.0, 0.5))               # the span's last position: its end anyway
        self.assertEqual(ph.cut_at(b0), 8)                          # positions [7, 8) trained
        self.assertEqual((ph.steps, len(ph), ph.cut), (-(-b0 // 4), b0, True))
        with self.assertRaisesRegex(ValueError, "block boundary"):
            data.LeasedPhase(2, 7, 11, w, 4, 2, 0, 2, bounds=bounds, ends=ends).cut_at(b0 + 1)
        # runs of 4 positions mixed together, the last quarter single positions: a cut ends only
        # where a run ends, and a prefix to a bound is exactly the windows of its positions
        space = block_space.BlockSpace(num_samples=400, block_size=5, seed=1)
        w, bounds, ends = data.span_windows_blocked(space, 10, 30, seed=0, lease=3, group=4)
        self.assertEqual(ends.tolist(), [14, 18, 22, 25, 26, 27, 28, 29, 30])
        for b, e in zip(bounds, ends):
            want = sorted(x for p in range(10, int(e)) for x in space.samples_of(space.block_at(p)))
            self.assertEqual(sorted(w[:b].tolist()), want)
        first = w[:5].tolist()          # the first run's windows come from its 4 blocks, shuffled
        self.assertGreater(len({space.block_at(p) for p in range(10, 14)
                                for x in first if x in space.samples_of(space.block_at(p))}), 1)
        self.assertIsNone(data.LeasedPhase(2, 7, 11, w, 4, 2, 0, 2).cut_point(4, 0.0, 1.0))   # H steps: never


class FlagsTest(unittest.TestCase):
    def cfg(self, *extra, accel="cpu"):
        return train.parse_config(["--model", "qwen3-tiny", "--data", "x/manifest.json",
                                   "--federation", "http://127.0.0.1:1", "--darl-url", "http://127.0.0.1:2",
                                   *extra]).resolve(accel)

    def test_identity_and_refusals_name_the_flag(self):
        self.assertEqual(self.cfg("--site", "lumi").cluster, "lumi")
        self.assertEqual(self.cfg("--site", "lumi", "--replica", "b").cluster, "lumi-b")
        os.environ["PWW_SITE"] = "snellius"
        try:
            self.assertEqual(self.cfg().cluster, "snellius")
        finally:
            del os.environ["PWW_SITE"]
        self.cfg("--site", "lumi").validate()
        for extra, flag in ((["--diloco-replicas", "2"], "--replica"), (["--site", "a b"], "--site"),
                            (["--transport", "blob"], "--blob-url"), (["--model", "resnet18"], "qwen3"),
                            (["--wire", "int4", "--wire-block", "512"], "--wire-block 512"),
                            (["--wire", "topk", "--wire-topk-k", "5000"], "--wire-topk-k 5000"),
                            (["--wire", "topk", "--wire-feedback-decay", "0"], "--wire-feedback-decay 0"),
                            (["--wire", "int2", "--wire-feedback-decay", "1.5"], "--wire-feedback-decay 1.5")):
            with self.subTest(extra=extra), self.assertRaises(train.ConfigError) as e:
                self.cfg("--site", "lumi", *extra).validate()
            self.assertIn(flag, str(e.exception))
        self.assertEqual(self.cfg("--delta-dtype", "bf16").wire, "bf16")     # the flag's old name
        with tempfile.TemporaryDirectory() as d:                              # ... and an old config.yaml
            durable.write_text(os.path.join(d, "c.yaml"), "delta_dtype: bf16\nerror_feedback: false\n", fsync=False)
            cfg = self.cfg("--config", os.path.join(d, "c.yaml"))
            self.assertEqual((cfg.wire, cfg.error_feedback), ("bf16", False))
            durable.write_text(os.path.join(d, "c.yaml"), "error_feedback: maybe\n", fsync=False)
            with self.assertRaisesRegex(train.ConfigError, "--error-feedback"):
                self.cfg("--config", os.path.join(d, "c.yaml"))
        self.assertEqual(self.cfg("--wire", "topk", "--no-error-feedback").wire_codec().fmt, "topk")
        with self.assertRaisesRegex(train.ConfigError, "--darl-url"):
            train.parse_config(["--model", "qwen3-tiny", "--data", "x/manifest.json", "--federation",
                                "http://h:1", "--site", "s"]).resolve("cpu").validate()
        self.assertTrue(self.cfg("--site", "lumi", "--overlap").overlap)
        with self.assertRaisesRegex(train.ConfigError, "--overlap is for federated sites"):
            train.parse_config(["--model", "qwen3-tiny", "--data", "x/manifest.json", "--overlap"]
                               ).resolve("cpu").validate()

    def test_eager_takes_the_aggregators_outer_step_and_refuses_one_that_does_not_say_it(self):
        cfg = self.cfg("--site", "lumi", "--overlap", "--overlap-fold", "eager")
        said = []
        got = fedphase.eager_settings(cfg, {"lr": 0.7, "momentum": 0.9, "nesterov": True, "more": 1}, said.append)
        self.assertEqual(got, {"lr": 0.7, "momentum": 0.9, "nesterov": True})
        self.assertIn("Nesterov, lr 0.7, momentum 0.9", said[0])
        for old in (None, {}, {"lr": 0.7}, {"lr": 0.7, "momentum": 0.9}):     # an older fedmom_server.py
            with self.subTest(outer=old), self.assertRaises(train.ConfigError) as e:
                fedphase.eager_settings(cfg, old, said.append)
            self.assertIn("--overlap-fold eager", str(e.exception))
            self.assertIn("update fedmom_server.py", str(e.exception))
            self.assertIn("--overlap-fold arrival", str(e.exception))

    def test_encode_on_auto_picks_the_device_for_int8_int4_on_a_gpu_and_device_is_refused_elsewhere(self):
        # auto: wire_torch on the training device for int8/int4 on a GPU (ROCm is "cuda" to
        # torch), the numpy reference otherwise; on the CPU, auto is the host
        for wire, accel, want in (("int4", "cpu", "host"), ("int8", "cpu", "host"), ("int4", "cuda", "device"),
                                  ("int2", "cuda", "device"), ("int2", "cpu", "host"),
                                  ("int8", "rocm", "device"), ("f32", "cuda", "host"), ("bf16", "rocm", "host"),
                                  ("topk", "cuda", "host")):
            with self.subTest(wire=wire, accel=accel):
                cfg = self.cfg("--site", "lumi", "--wire", wire, accel=accel)
                cfg.validate()
                self.assertEqual(cfg.encode_on, want)
        # given, it is kept: device on the CPU is wire_torch on CPU torch, the host's bits (CarrierTest)
        for given, accel in (("device", "cpu"), ("host", "cuda")):
            cfg = self.cfg("--site", "lumi", "--wire", "int4", "--encode-on", given, accel=accel)
            cfg.validate()
            self.assertEqual(cfg.encode_on, given)
        for wire in ("f32", "bf16", "topk"):             # wire_torch encodes int8, int4 and int2 only
            with self.subTest(wire=wire), self.assertRaises(train.ConfigError) as e:
                self.cfg("--site", "lumi", "--wire", wire, "--encode-on", "device").validate()
            self.assertIn(f"--encode-on device encodes int8, int4 and int2 (wire_torch.py); --wire {wire}",
                          str(e.exception))
        local = ["--model", "qwen3-tiny", "--data", "x/manifest.json"]
        for given in ("device", "host"):                 # no --federation: no delta is encoded
            with self.subTest(given=given), self.assertRaises(train.ConfigError) as e:
                train.parse_config(local + ["--encode-on", given]).resolve("cuda").validate()
            self.assertIn(f"--encode-on {given} is for federated sites (--federation)", str(e.exception))
        cfg = train.parse_config(local).resolve("cuda")
        cfg.validate()
        self.assertEqual(cfg.encode_on, "auto", "inside one allocation auto stays auto: nothing is encoded")
        with tempfile.TemporaryDirectory() as d:         # from --config too, checked like the flag
            durable.write_text(os.path.join(d, "c.yaml"), "encode_on: device\n", fsync=False)
            with self.assertRaisesRegex(train.ConfigError, "--encode-on device encodes int8, int4 and int2"):
                self.cfg("--site", "lumi", "--config", os.path.join(d, "c.yaml")).validate()
            durable.write_text(os.path.join(d, "c.yaml"), "encode_on: gpu\n", fsync=False)
            with self.assertRaisesRegex(train.ConfigError, "'gpu' is not one of host, device, auto \\(--encode-on\\)"):
                self.cfg("--config", os.path.join(d, "c.yaml"))


# ---------------------------------------------------------------------------
# the carrier on 2 FSDP ranks (torchrun runs this file's worker mode)
# ---------------------------------------------------------------------------

def worker(manifest, darl_url, fedmom_url, out_dir):
    """Under torchrun, 2 ranks: per-tensor gather/scatter under FSDP2, then a stale delta."""
    import torch
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    import darl_client
    import diloco
    import fedmom_client
    import fedphase
    import models
    import tensorio
    d = dist_env.init_distributed("cpu")
    report = {}

    # 1. gather and scatter, one tensor at a time, against the unsharded state
    class Odd(torch.nn.Module):            # 5 rows over 2 ranks: an uneven Shard(0)
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleDict({"0": torch.nn.Linear(3, 5)})
            self.head = torch.nn.Linear(5, 7, bias=False)

        def init_weights(self, buffer_device=None):
            for p in self.parameters():
                torch.nn.init.normal_(p)
    for label, model in (("qwen3-tiny", models.parallelize(models.build_model("qwen3-tiny", 258, 64), "fsdp",
                                                            d.device)),
                         ("odd", models.parallelize(Odd().to("meta"), "fsdp", d.device))):
        names = [n for n, _ in model.named_parameters()]
        params = [p for _, p in model.named_parameters()]
        carrier = fedphase.FedMomCarrier(None, out_dir, "F32")
        carrier.delta_path = os.path.join(out_dir, f"delta-{label}.safetensors")
        carrier.theta_path = os.path.join(out_dir, f"theta-{label}.safetensors")
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        # gather: deltas hold theta - theta_i; the file must hold theta_i - theta = -delta, whole
        deltas = [-p.to_local().detach().clone() for p in params]
        carrier.write_delta(names, params, deltas)
        # scatter: rank 0 writes a known theta; every rank must end with its slice of it
        g = torch.Generator().manual_seed(5)
        known = {n: torch.randn(tuple(p.shape), generator=g) for n, p in zip(names, params)}
        if d.rank == 0:
            tensorio.save_torch(known, carrier.theta_path)
        dist.barrier()
        theta = [torch.empty_like(p.to_local()) for p in params]
        carrier.read_theta(names, params, theta)
        with torch.no_grad():
            for p, t in zip(params, theta):
                p.to_local().copy_(t)
        after = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
        if d.rank == 0:
            with tensorio.TensorReader(carrier.delta_path) as r:
                report[f"{label}_gather_names"] = r.names == names
                report[f"{label}_gather_max_err"] = max(
                    float((torch.from_numpy(r.read(n, as_float32=True)) - full[n]).abs().max()) for n in names)
            report[f"{label}_scatter_max_err"] = max(float((after[n] - known[n]).abs().max()) for n in names)
            report[f"{label}_uneven"] = any(p.shape[0] % 2 for p in params)
        # the same deltas in int4 with error feedback, and in int2 with a decayed one
        # (--wire-feedback-decay 0.95), encoded on the host (numpy) and on the device
        # (wire_torch, each rank its own rows): the same delta file and the same residual
        # (rank 0's file, or every rank's rows), two rounds (the second carries what is owed)
        files = {}
        for (fmt, decay), where in itertools.product((("int4", 1.0), ("int2", 0.95)), ("host", "device")):
            wd = os.path.join(out_dir, f"{label}-{fmt}-{where}")
            c = fedphase.FedMomCarrier(None, wd, fmt, fresh=True, encode_on=where, feedback_decay=decay)
            for rnd in (0, 1):
                c.round = rnd
                c.write_delta(names, params, [x * (rnd + 1) for x in deltas])
                dist.barrier()
                if d.rank == 0:
                    res = {}
                    for fn in sorted(os.listdir(wd)):
                        if fn.startswith("residual") and fn.endswith("next.safetensors"):
                            with tensorio.TensorReader(os.path.join(wd, fn)) as r:
                                rows = json.loads(r.metadata.get("layout", "{}"))
                                for n in r.names:
                                    a, whole = r.read(n), full[n].numpy()
                                    if rows.get(n, "whole") == "whole":
                                        res[n] = a
                                    else:
                                        res.setdefault(n, np.zeros(whole.shape, np.float32))[slice(*rows[n])] = a
                    with open(c.delta_path, "rb") as f:
                        files[(fmt, where, rnd)] = (f.read(), {n: res[n].tobytes() for n in names})
                dist.barrier()
                if c.residual is not None:
                    c.residual.settle(rnd, rnd + 1, "")
        if d.rank == 0:
            report[f"{label}_device_encode_same_files"] = all(
                files[(fmt, "host", rnd)] == files[(fmt, "device", rnd)] for fmt in ("int4", "int2") for rnd in (0, 1))

    # 2. a stale delta: the round moves on between our download and our send
    cfg = train.parse_config(["--model", "qwen3-tiny", "--data", manifest, "--federation", fedmom_url,
                              "--darl-url", darl_url, "--site", "stale", "--batch-size", "4", "--parallel", "fsdp",
                              "--diloco-inner-steps", "2"]).resolve("cpu")
    windows = data.TokenWindows(manifest)
    cfg.seq_len = windows.seq_len
    model, _, _ = train.make_model(cfg, d, windows.vocab_size)
    site = fedsite.FedSite(cfg, windows, 0, print) if d.rank == 0 else None
    block_size, seed, _, _, _ = fedphase.on_rank0(lambda: site.connect(cfg.batch_size * d.world_size))
    source = fedsite.LeasedSource(cfg, windows, block_size, seed, d.rank, d.world_size)
    carrier = fedphase.FedMomCarrier(site, out_dir, "F32")
    outer = diloco.DiLoCo(model, diloco.ReplicaLayout.plan(d.world_size, d.rank, 1),
                          diloco.DiLoCoConfig.fedavg(2), carrier)
    base = carrier.load_global(outer)
    phase = source.phase(*fedphase.on_rank0(lambda: site.next_span()))
    if d.rank == 0:                  # another site merges round base+1 while we train
        site.leave()
        other = fedmom_client.FedMomClient(fedmom_url, "other", "inc-other")
        other.join()
        other.download_theta(os.path.join(out_dir, "other-theta.safetensors"))
        with tensorio.TensorReader(os.path.join(out_dir, "other-theta.safetensors")) as r:
            zero = {n: np.full(r.specs[n][1], 0.01, np.float32) for n in r.names}
        tensorio.save_torch({n: torch.from_numpy(a) for n, a in zero.items()},
                            os.path.join(out_dir, "other-delta.safetensors"))
        darl_other = darl_client.LeaseClient(darl_url)    # under --darl every delta names its lease
        darl_other.register("other", "inc-other", darl_other.status()["digest"])
        lease = darl_other.acquire("other", "inc-other", blocks=1)["lease"]
        report["other_blocks"] = lease["end"] - lease["start"]
        other.send_delta(os.path.join(out_dir, "other-delta.safetensors"), base, 100,
                         [{"id": lease["id"], "start": lease["start"], "end": lease["end"]}], {})
        report["other_round"] = other.wait_round_after(base, timeout_s=120)
        other.leave()
        darl_other.close()
        fedphase.on_rank0(lambda: site.join())
        report["held_before"] = sorted(site.session.held())
    else:
        fedphase.on_rank0(lambda: None)
    with torch.no_grad():                    # some training: the delta is not zero
        for p in model.parameters():
            p.to_local().add_(0.001)
    # fedphase.end_phase as the federated loop calls it; the checkpoint notes whether the delta
    # file (written, then sent, by the carrier) does not exist yet
    checkpointed = []
    delta_file = os.path.join(out_dir, "delta.safetensors")
    run = types.SimpleNamespace(outer=outer, save=lambda step, rnd: checkpointed.append(not os.path.exists(delta_file)))
    outer.count_inner_step()
    _, result = fedphase.end_phase(run, carrier, fedsite.Handoff(tokens=len(phase) * windows.seq_len,
                                                                 metrics={"loss": 1.0}, step=1))
    assert result is not None and not carrier.in_flight, "no --overlap: the round trip ends inside the outer step"
    if d.rank == 0:
        report.update(last=dataclasses.asdict(result), checkpointed=checkpointed, lease=phase.lease,
                      held_after=sorted(site.session.held()), base=base)
        with tensorio.TensorReader(os.path.join(out_dir, "theta.safetensors")) as r:
            report["theta_round_file"] = r.metadata.get("round")
    # every rank: the model now holds the CURRENT theta_global (round base+1)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    if d.rank == 0:
        with tensorio.TensorReader(os.path.join(out_dir, "theta.safetensors")) as r:
            report["model_is_current_theta"] = max(
                float((torch.from_numpy(r.read(n, as_float32=True)) - full[n]).abs().max()) for n in r.names)
        fedphase.on_rank0(lambda: site.finish())
        with open(os.path.join(out_dir, "report.json"), "w") as f:
            json.dump(report, f)
    else:
        fedphase.on_rank0(lambda: None)
    dist.barrier()
    dist.destroy_process_group()


class CarrierTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix="fed-carrier-")
        cls.launcher = harness.Launcher()
        try:
            cls.start(cls.tmp.name)
        except BaseException:
            cls.tearDownClass()           # unittest skips tearDownClass after a failed setUpClass
            raise

    @classmethod
    def start(cls, t):
        cls.manifest = make_corpus(t, 12000)
        init = export_init(t, cls.manifest)
        L = cls.launcher
        _, cls.darl = harness.start_server(L, "darl", ["--manifest", cls.manifest, "--block-size", 4, "--state-dir", t,
                                                       "--default-ttl", 30, "--max-ttl", 30], log_of(t, "darl"), port=0)
        fed, cls.fedmom = harness.start_server(L, "fedmom", [
            "--state-dir", os.path.join(t, "fedmom"), "--init", init, "--darl", cls.darl,
            "--darl-retry-s", 1, "--member-timeout-s", 60], log_of(t, "fedmom"), port=0)
        out = os.path.join(t, "worker")
        os.makedirs(out)
        w = L.start("worker", harness.torchrun(2, os.path.join(ROOT, "tests", "test_federation.py"), "worker",
                                               cls.manifest, cls.darl, cls.fedmom, out), log_of(t, "worker"))
        rc = w.wait(timeout=600)
        if rc != 0:
            raise AssertionError(f"worker exited {rc}:\n" + "\n".join(w.tail(60)))
        with open(os.path.join(out, "report.json")) as f:
            cls.report = json.load(f)
        harness.expect(lambda: httpc.call(cls.fedmom, "GET", "/status")["pending_commits"] == 0,
                       "the aggregator's commits to reach DARL", [fed])
        cls.darl_status = httpc.call(cls.darl, "GET", "/status")
        cls.rounds = durable.read_jsonl(os.path.join(t, "fedmom", "rounds.jsonl"))

    @classmethod
    def tearDownClass(cls):
        cls.launcher.kill_all()
        cls.tmp.cleanup()

    def test_a_requeued_site_waits_out_its_previous_incarnation(self):
        """What a SIGKILLed and requeued job meets: the old incarnation still holds a
        lease at DARL and membership at FedMom; the new one waits, then takes over."""
        import darl_client
        import fedmom_client
        windows = data.TokenWindows(self.manifest)
        digest = block_space.BlockSpace(windows.train_windows, 4, 0, manifest_digest=windows.digest).digest()
        old = darl_client.LeaseClient(self.darl)
        self.addCleanup(old.close)
        old.register("twin", "old-inc", digest)
        self.assertEqual(old.acquire("twin", "old-inc", blocks=1)["status"], "ok")
        old_fed = fedmom_client.FedMomClient(self.fedmom, "twin", "old-inc")
        old_fed.join()
        cfg = train.parse_config(["--model", "qwen3-tiny", "--data", self.manifest, "--federation", self.fedmom,
                                  "--darl-url", self.darl, "--site", "twin"]).resolve("cpu")
        said = []
        site = fedsite.FedSite(cfg, windows, 0, said.append)
        gen = site.connect(8)

        def drive(until):
            for _ in range(600):
                try:
                    next(gen)
                except StopIteration as e:
                    return e.value
                if until():
                    return None
            self.fail(f"the site never got there: {said}")
        drive(lambda: any("previous incarnation's leases to expire" in m for m in said))
        old.release("twin", "old-inc", leave=True)             # the old job's leases are gone
        drive(lambda: any("still live as the previous incarnation" in m for m in said))
        old_fed.leave()                                          # ... and its membership
        self.assertEqual(drive(lambda: False), (4, 0, 200,      # K=4, seed 0, H=100 x 8 windows / 4
                                                {"lr": 0.7, "momentum": 0.9, "nesterov": True},   # the merge's step
                                                None))          # no --phase-s offered
        self.assertTrue(site.member)
        st = httpc.call(self.darl, "GET", "/status")
        self.assertEqual([c["incarnation"] for c in st["clusters"] if c["cluster"] == "twin"], [site.incarnation])
        for _ in site.finish():
            pass

    def test_fsdp_gather_and_scatter_equal_the_unsharded_state(self):
        r = self.report
        self.assertTrue(r["odd_uneven"], "the odd model must shard unevenly")
        for label in ("qwen3-tiny", "odd"):
            self.assertTrue(r[f"{label}_gather_names"], f"{label}: the delta file's names, in parameter order")
            self.assertEqual(r[f"{label}_gather_max_err"], 0.0, label)
            self.assertEqual(r[f"{label}_scatter_max_err"], 0.0, label)
            self.assertTrue(r[f"{label}_device_encode_same_files"],
                            f"{label}: encode_on='device' writes the host path's delta and residual bytes")

    def test_a_stale_delta_is_refused_not_merged_and_its_lease_released(self):
        r = self.report
        self.assertEqual(r["other_round"], r["base"] + 1)
        self.assertEqual(r["checkpointed"], [True], "the checkpoint comes before the send")
        self.assertIn(r["lease"], r["held_before"])
        last = r["last"]
        self.assertFalse(last["merged"])
        self.assertIn("stale", last["reason"])
        self.assertEqual((last["base_round"], last["round"]), (r["base"], r["base"] + 1))
        self.assertEqual(r["held_after"], [], "the stale span's lease is no longer held")
        self.assertEqual(r["model_is_current_theta"], 0.0, "the site ends on the current theta_global")
        # the aggregator merged one round, without us; DARL has our blocks back in the pool
        self.assertEqual([sorted(c.split("@")[0] for c in rec["clusters"]) for rec in self.rounds], [["other"]])
        st = self.darl_status
        n = r["other_blocks"]                                   # the other site's lease, merged and committed
        self.assertEqual((st["committed"], st["leased"], st["in_custody"], st["free"]), (n, 0, 0, st["num_blocks"] - n))
        self.assertIsNone(st["invariant_error"])


# ---------------------------------------------------------------------------
# --encode-on device: theta updated on the device, checked behind on the host
# ---------------------------------------------------------------------------

class DeviceCheckTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="fed-devcheck-")
        self.addCleanup(self.tmp.cleanup)
        self.launcher = harness.Launcher()
        self.addCleanup(self.launcher.kill_all)

    def test_a_theta_that_fails_its_check_behind_stops_the_next_send(self):
        import torch

        import diloco
        import fedphase
        import tensorio
        t = self.tmp.name
        manifest = make_corpus(t, 12000)
        g = torch.Generator().manual_seed(3)
        model = torch.nn.Module()
        model.w = torch.nn.Parameter(torch.randn(16, 256, generator=g))
        model.norm = torch.nn.Parameter(torch.randn(16, generator=g))
        init = os.path.join(t, "init.safetensors")
        tensorio.save_torch({n: p.detach() for n, p in model.named_parameters()}, init)
        L = self.launcher
        dproc, darl = harness.start_server(L, "darl", ["--manifest", manifest, "--block-size", 4, "--state-dir", t,
                                                       "--default-ttl", 30, "--max-ttl", 30], log_of(t, "darl"), port=0)
        fproc, fed = harness.start_server(L, "fedmom", [
            "--state-dir", os.path.join(t, "fedmom"), "--init", init, "--darl", darl, "--darl-retry-s", 1,
            "--member-timeout-s", 60, "--down-wire", "int4"], log_of(t, "fedmom"), port=0)
        faults = os.path.join(t, "faults")
        os.makedirs(faults)
        os.environ[testhooks.FAULT_DIR_ENV] = faults
        self.addCleanup(os.environ.pop, testhooks.FAULT_DIR_ENV)
        # the check behind is the path of an update downloaded after the round (a followed
        # one was added and checked on the host during the merge): no following here
        os.environ["PWW_FOLLOW_UPDATE"] = "0"
        self.addCleanup(os.environ.pop, "PWW_FOLLOW_UPDATE")
        cfg = train.parse_config(["--model", "qwen3-tiny", "--data", manifest, "--federation", fed, "--darl-url",
                                  darl, "--site", "dev", "--diloco-inner-steps", "2"]).resolve("cpu")
        said = []
        site = fedsite.FedSite(cfg, data.TokenWindows(manifest), 0, said.append)
        self.addCleanup(site.abort)
        fedphase.on_rank0(lambda: site.connect(8))
        work = os.path.join(t, "site")
        carrier = fedphase.FedMomCarrier(site, work, "int4", fresh=True, log=said.append, encode_on="device")
        outer = diloco.DiLoCo(model, diloco.ReplicaLayout.plan(1, 0, 1), diloco.DiLoCoConfig.fedavg(2), carrier)
        carrier.load_global(outer)

        def phase(step):
            span = fedphase.on_rank0(lambda: site.next_span())
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * step)
            outer.count_inner_step()
            _, result = outer.end_phase(fedsite.Handoff(tokens=100, metrics={"loss": 1.0}, step=step))
            return span, result

        # 1. merged; the int4 update of round 1 is added on the device, its check held at the fault point
        arm = os.path.join(faults, "site.check")
        with open(arm, "w") as f:
            f.write("0")
        span1, first = phase(1)
        self.assertTrue(first.merged, first)
        self.assertEqual((first.theta_via, first.round), ("update", 1))
        device_theta = {n: x.clone() for n, x in zip(outer.names, outer.theta)}
        harness.expect(lambda: os.path.exists(arm + ".hit"), "the check behind at site.check", [fproc, dproc])
        theta_file = os.path.join(work, "theta.safetensors")
        with tensorio.TensorReader(theta_file) as r:        # the host's file, round 0, damaged under the check
            arrays, meta = {n: r.read(n) for n in r.names}, dict(r.metadata)
        arrays["norm"][3] += np.float32(1.0)
        with tensorio.TensorWriter(theta_file, [(n, "F32", a.shape) for n, a in arrays.items()], meta) as w:
            for n, a in arrays.items():
                w.write(n, a)
        os.unlink(arm)

        # 2. the next phase's delta was trained from that theta: not sent, its lease released,
        # theta_global (still round 1: nothing else merged) downloaded whole
        span2, second = phase(2)
        self.assertFalse(second.merged)
        self.assertIn("not sent: it was trained from a theta_global that failed its check", second.reason)
        self.assertEqual((second.theta_via, second.round, second.update), ("full", 1, None))
        self.assertTrue(any(m.startswith("!!! theta_global as updated on the devices failed its check") for m in said),
                        said)
        self.assertEqual(httpc.call(fed, "GET", "/status")["round"], 1, "the delta of round 1 reached the aggregator")
        self.assertEqual(len(durable.read_jsonl(os.path.join(t, "fedmom", "rounds.jsonl"))), 1)
        harness.expect(lambda: httpc.call(fed, "GET", "/status")["pending_commits"] == 0, "round 1's commit",
                       [fproc])
        ds = httpc.call(darl, "GET", "/status")
        n1 = span1[2] - span1[1]
        self.assertEqual((ds["committed"], ds["leased"], ds["in_custody"]), (n1, 0, 0),
                         "phase 2's blocks are back in the pool")
        self.assertEqual(ds["free"], ds["num_blocks"] - n1)
        # what the device added in round 1 was the aggregator's theta, bit for bit: the whole
        # download of round 1 is the same, and the model holds it now
        with tensorio.TensorReader(theta_file) as r:
            self.assertEqual(r.metadata["round"], "1")
            for n in r.names:
                want = r.read(n)
                self.assertEqual(device_theta[n].numpy().tobytes(), want.tobytes(), n)
                self.assertEqual(dict(model.named_parameters())[n].detach().numpy().tobytes(), want.tobytes(), n)
        self.assertNotEqual(span2[0], span1[0])

        # 3. the next round trip runs as usual again: sent, merged, the update added on the device
        _, third = phase(3)
        self.assertTrue(third.merged, third)
        self.assertEqual(third.theta_via, "update")
        fedphase.on_rank0(lambda: site.join_check())
        self.assertIsNotNone(site.held, "the third update's check passed")


# ---------------------------------------------------------------------------
# two sites end to end, with a kill + resume and an aggregator restart
# ---------------------------------------------------------------------------

class ScenarioCase(unittest.TestCase):
    """A class whose run_scenario(tmp) sets up real processes once; its tests read what they left.
    PWW_TEST_KEEP keeps the temp dir."""
    PREFIX = "fed-"

    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory(prefix=cls.PREFIX)
        cls.launcher, cls.events = harness.Launcher(), {}
        try:
            cls.run_scenario(cls.tmp.name)
        except BaseException:
            cls.tearDownClass()
            raise

    @classmethod
    def tearDownClass(cls):
        cls.launcher.kill_all()
        if KEEP:
            kept = cls.tmp.name + "-kept"
            os.rename(cls.tmp.name, kept)
            print(f"kept {kept}")
        cls.tmp.cleanup()


class FederationRunTest(ScenarioCase):
    H = 4
    PREFIX = "fed-run-"

    @classmethod
    def site(cls, name, parallel, nproc, *extra):
        t = cls.tmp.name
        args = ["train.py", "--device", "cpu", "--model", "qwen3-tiny", "--data", cls.manifest,
                "--parallel", parallel, "--batch-size", "4", "--lr", "3e-3", "--diloco-inner-steps", str(cls.H),
                "--federation", cls.fedmom, "--darl-url", cls.darl, "--blob-url", cls.blob,
                "--token-file", cls.token, "--ca-file", cls.ca, "--site", name, "--runs-dir", os.path.join(t, "runs"),
                "--run-name", name, "--eval-windows", "16", "--eval-every", "4", "--log-every", "4",
                "--register-wait-s", "120", *extra]
        return cls.launcher.start(name, harness.torchrun(nproc, *args), log_of(t, name))

    @classmethod
    def records(cls):
        return durable.read_jsonl(os.path.join(cls.tmp.name, "central", "fedmom", "rounds.jsonl"))

    @classmethod
    def merged_by(cls, rec):
        """{cluster: incarnation} of the deltas merged in a round record."""
        return {o["cluster"]: o["incarnation"] for o in rec.get("outcomes", []) if o["outcome"] == "merged"}

    @classmethod
    def incarnation(cls, name, after=0):
        """The incarnation a site's log announced (the newest one after byte `after`)."""
        with open(os.path.join(cls.tmp.name, f"{name}.log"), errors="replace") as f:
            f.seek(after)
            got = [line.split("(incarnation ")[1].split(")")[0] for line in f if "(incarnation " in line]
        return got[-1] if got else None

    @classmethod
    def eager_lines(cls, verb, after, before=None):
        """(step, round, norm) of alpha's "--overlap-fold eager: the checkpoint of step S <verb>
        the estimate ..." lines between byte offsets `after` and `before` of its log."""
        with open(os.path.join(cls.tmp.name, "alpha.log"), errors="replace") as f:
            text = f.read()[after:before]
        return re.findall(rf"checkpoint of step (\d+) {verb} the estimate of the aggregator's momentum at "
                          r"round (\d+), norm (\S+)", text)

    @classmethod
    def run_scenario(cls, t):
        # Margins for a loaded 2-core machine. Leases live 15-20 s (heartbeats every third:
        # a site may stall ~13 s) and members 20 s (heartbeats every 5 s); the restarted
        # alpha waits those out, and meanwhile only the round stalled on the dead alpha
        # keeps beta from eating the corpus. 40 kB = 800 training windows: a joint round
        # takes 48, beta alone 16 per >= 2.4 s (--throttle-ms 600 x H=4), so alpha's
        # restart may take ~2 minutes before the corpus runs short of the rounds after it.
        cls.manifest = make_corpus(t, 40000)
        cls.windows = data.TokenWindows(cls.manifest)
        cls.token = os.path.join(t, "token")
        with open(cls.token, "w") as f:
            f.write("test-token-0123456789\n")
        init = export_init(t, cls.manifest)
        central = os.path.join(t, "central")
        cls.ca, cert, key = certs.make_tls(t)
        common = ["--token-file", cls.token, "--tls-cert", cert, "--tls-key", key]
        L = cls.launcher
        darl, cls.darl = harness.start_server(L, "darl", [
            "--manifest", cls.manifest, "--block-size", 8, "--state-dir", central, "--min-ttl", 15,
            "--default-ttl", 20, "--max-ttl", 20, "--max-attempts", 0, *common], log_of(t, "darl"), port=0, ca_file=cls.ca)
        blob, cls.blob = harness.start_server(L, "blob", ["--root", os.path.join(central, "blobs"), *common],
                                              log_of(t, "blob"), port=0, ca_file=cls.ca)
        fed_args = ["--state-dir", os.path.join(central, "fedmom"), "--init", init, "--darl", cls.darl,
                    "--blob-url", cls.blob, "--darl-retry-s", 1, "--member-timeout-s", 20,
                    "--round-deadline-s", 120, "--ca-file", cls.ca, "--down-wire", "int4", *common]
        fed, cls.fedmom = harness.start_server(L, "fedmom", fed_args, log_of(t, "fedmom"), port=0, ca_file=cls.ca)
        services = [darl, blob]

        # 1. both sites merge together
        # alpha's jobs encode their int4 deltas on the device (--encode-on device, CPU torch
        # here: each rank its own rows, error feedback per rank) and add theta_global's int4
        # updates there, the host checking each behind; beta (DDP, topk) on the host
        alpha = cls.site("alpha", "fsdp", 2, "--transport", "inline", "--wire", "int4", "--overlap",
                         "--overlap-fold", "eager", "--encode-on", "device")
        beta = cls.site("beta", "ddp", 1, "--transport", "blob", "--wire", "topk", "--throttle-ms", "600",
                        "--overlap", "--overlap-fold", "end")
        harness.expect(lambda: any(len(cls.merged_by(r)) == 2 for r in cls.records()),
                       "a round merged from both sites", [alpha, beta, fed, *services])
        # 2. alpha dies (SIGKILL: a node failure) once a checkpoint holds an estimate of the
        # aggregator's momentum (--overlap-fold eager) from a merged round; beta merges alone
        # (two such lines: each is said before its save, so the first one's save has ended)
        harness.expect(lambda: sum(float(n) > 0 for _, _, n in cls.eager_lines("holds", 0)) >= 2,
                       "two checkpoints of alpha holding a non-zero momentum estimate", [alpha, beta, fed, *services])
        alpha.kill()
        cls.events["killed_after_round"] = cls.records()[-1]["round"]
        fb = os.path.join(t, "runs", "alpha", "federation")          # what error feedback left behind
        cls.events["residual_at_kill"] = ("in flight" if os.path.exists(os.path.join(fb, "residual-rank0-next.safetensors"))
                                          else "owed" if os.path.exists(os.path.join(fb, "residual-rank0.safetensors"))
                                          else None)
        harness.expect(lambda: any(set(cls.merged_by(r)) == {"beta"} and r["round"] > cls.events["killed_after_round"]
                                   for r in cls.records()), "a round merged by beta alone", [beta, fed, *services])
        # 3. alpha comes back (same cluster id, new incarnation, --resume auto) and merges with beta
        mark = os.path.getsize(alpha.log_path)
        alpha2 = cls.site("alpha", "fsdp", 2, "--transport", "inline", "--wire", "int4", "--overlap",
                          "--overlap-fold", "eager", "--resume", "auto", "--encode-on", "device")
        cls.events["alpha2_log_from"] = mark
        new_inc = harness.expect(lambda: cls.incarnation("alpha", mark), "alpha's new incarnation", [alpha2])
        cls.events["alpha2_incarnation"] = new_inc
        harness.expect(lambda: any(cls.merged_by(r).get("alpha") == new_inc and "beta" in cls.merged_by(r)
                                   for r in cls.records()), "a round merged from the restarted alpha and beta",
                       [alpha2, beta, fed, *services])
        # 4. the aggregator dies mid-run and comes back on the same port and state
        fed.kill()
        cls.events["fedmom_killed_at_round"] = cls.records()[-1]["round"]
        fed, _ = harness.start_server(L, "fedmom", fed_args, log_of(t, "fedmom"), port=httpc.split_url(cls.fedmom)[2],
                                      ca_file=cls.ca)
        harness.expect(lambda: len(cls.merged_by(cls.records()[-1])) > 0 and
                       cls.records()[-1]["round"] > cls.events["fedmom_killed_at_round"] + 1,
                       "merged rounds after the aggregator's restart", [alpha2, beta, fed, *services])
        # 5. DARL runs out of blocks: both sites finish by themselves
        for p in (alpha2, beta):
            harness.expect(lambda: not p.alive(), f"{p.name} to finish", [fed, *services])
            if p.poll() != 0:
                raise AssertionError(f"{p.name} exited {p.poll()}:\n" + "\n".join(p.tail(40)))
        assert cls.darl.startswith("https://") and cls.fedmom.startswith("https://") and cls.blob.startswith("https://")
        cls.darl_status = httpc.call(cls.darl, "GET", "/status", token="test-token-0123456789", ca_file=cls.ca)
        cls.fed_status = httpc.call(cls.fedmom, "GET", "/status", token="test-token-0123456789", ca_file=cls.ca)
        cls.rows = {n: durable.read_jsonl(os.path.join(t, "runs", n, "metrics.jsonl")) for n in ("alpha", "beta")}

    def test_every_block_committed_exactly_once(self):
        st = self.darl_status
        self.assertIsNone(st["invariant_error"])
        self.assertEqual((st["committed"], st["free"], st["leased"], st["quarantined"]),
                         (st["num_blocks"], 0, 0, 0))
        self.assertTrue(st["complete"])
        self.assertEqual(sum(c["committed"] for c in st["clusters"]), st["num_blocks"])
        self.assertEqual(st["space"]["num_samples"], self.windows.train_windows, "DARL leases training windows only")

    def test_the_global_model_saw_every_training_window_once(self):
        recs = self.records()
        self.assertEqual([r["round"] for r in recs], list(range(1, len(recs) + 1)), "no round lost or repeated")
        merged = [o for r in recs for o in r["outcomes"] if o["outcome"] == "merged"]
        self.assertEqual(sum(o["tokens"] for o in merged), self.windows.train_windows * self.windows.seq_len)
        leases = [l["id"] for o in merged for l in o["leases"]]
        self.assertEqual(len(leases), len(set(leases)), "a lease merged twice")
        keys = [(o["cluster"], o["incarnation"], o["base_round"]) for o in merged]
        self.assertEqual(len(keys), len(set(keys)), "a delta merged twice")
        self.assertEqual(self.fed_status["pending_commits"], 0)

    def test_membership_two_one_two(self):
        recs = self.records()
        k = self.events["killed_after_round"]
        first_alpha = {self.merged_by(r).get("alpha") for r in recs if r["round"] <= k} - {None}
        self.assertTrue(any(len(self.merged_by(r)) == 2 for r in recs if r["round"] <= k))
        self.assertTrue(any(set(self.merged_by(r)) == {"beta"} for r in recs if r["round"] > k))
        back = [r for r in recs if self.merged_by(r).get("alpha") == self.events["alpha2_incarnation"]]
        self.assertTrue(back and all(r["round"] > k for r in back))
        self.assertNotIn(self.events["alpha2_incarnation"], first_alpha, "a requeue is a new incarnation")
        with open(os.path.join(self.tmp.name, "alpha.log"), errors="replace") as f:
            f.seek(self.events["alpha2_log_from"])
            log = f.read()
        self.assertRegex(log, r"resumed at step \d+")

    def test_sites_carry_on_through_an_aggregator_restart(self):
        recs = self.records()
        k = self.events["fedmom_killed_at_round"]
        self.assertTrue([r for r in recs if r["round"] > k + 1 and self.merged_by(r)])
        for name in ("alpha", "beta"):
            fed = [r for r in self.rows[name] if r["split"] == "federation"]
            self.assertTrue(any(r["base_round"] > k for r in fed), f"{name} merged nothing after the restart")

    def test_theta_comes_down_as_updates_and_every_site_holds_the_servers_bits(self):
        n = sum(int(np.prod(s)) for s in self.names_shapes().values())
        for name in ("alpha", "beta"):
            fed = [r for r in self.rows[name] if r["split"] == "federation"]
            via = [r["theta_via"] for r in fed]
            # followed: the update came down while it was merged, adopted once durable
            self.assertIn("followed", via, f"{name} never got theta_global as an update followed")
            per = [r["down_bytes"] / n for r in fed if r["theta_via"] in ("update", "followed")]
            self.assertTrue(all(0 < b < 0.6 for b in per), f"{name}: int4 update bytes/param {per}")
            self.assertTrue(all(r["down_bytes"] / n > 3.9 for r in fed if r["theta_via"] == "full"))
        # the end: each site's last theta (fetched after DARL ran out, by update or whole) is
        # the aggregator's final theta_global, bit for bit
        import outer_state
        import tensorio
        outer = outer_state.load_outer(os.path.join(self.tmp.name, "central", "fedmom"))   # the server stopped
        want = {k: a.view(np.uint32).copy() for k, a in outer.theta.items()}
        for name in ("alpha", "beta"):
            with tensorio.TensorReader(os.path.join(self.tmp.name, "runs", name, "federation",
                                                    "theta.safetensors")) as r:
                got = {k: r.read(k).reshape(-1).view(np.uint32).copy() for k in r.names}
            self.assertEqual(sorted(got), sorted(want))
            self.assertTrue(all(np.array_equal(got[k], want[k]) for k in want), f"{name}'s theta differs")

    def test_compressed_deltas_and_error_feedback_through_the_kill(self):
        n = sum(int(np.prod(s)) for s in self.names_shapes().values())
        # qwen3-tiny's ~0.1M parameters pay for the header (three parts per tensor, the shapes)
        # and for its short norm tensors, kept whole by topk: ~0.05 B/param more than a real model
        for name, fmt, most in (("alpha", "int4", 0.6), ("beta", "topk", 0.2)):
            fed = [r for r in self.rows[name] if r["split"] == "federation"]
            self.assertTrue(fed and all(r["wire"] == fmt for r in fed))
            per = [r["wire_bytes"] / n for r in fed]
            self.assertTrue(all(0 < b <= most for b in per), f"{name}: {fmt} bytes/param {per}")
            self.assertTrue(all(r["residual_norm"] > 0 for r in fed), f"{name}: error feedback kept nothing")
        with open(os.path.join(self.tmp.name, "alpha.log"), errors="replace") as f:
            f.seek(self.events["alpha2_log_from"])
            log = f.read()
        # killed with a residual owed, the restarted job adds it to its first delta; killed
        # while a delta was in flight (its outcome unknown to the job), it resets and says why
        reset = "error feedback reset (nothing owed from now on): after a restart" in log
        first_use = re.search(r"error feedback: the delta of round (\d+) carries the residual left by "
                              r"the merged delta of round (\d+)", log)
        at_kill = self.events["residual_at_kill"]
        self.assertIn(at_kill, ("owed", "in flight"), "alpha was killed before any merged round")
        if at_kill == "owed":
            self.assertFalse(reset, log)
            self.assertTrue(first_use and int(first_use[2]) < self.events["killed_after_round"], log)
        else:
            self.assertTrue(reset, log)
        fb = os.path.join(self.tmp.name, "runs", "alpha", "federation")
        self.assertEqual(sorted(f for f in os.listdir(fb) if f.startswith("residual")),
                         ["residual-rank0.safetensors", "residual-rank1.safetensors"], "one file per rank")

    def test_each_job_names_its_delta_encoder_in_its_log_and_rows(self):
        with open(os.path.join(self.tmp.name, "alpha.log"), errors="replace") as f:
            log = f.read()
        first, second = log[:self.events["alpha2_log_from"]], log[self.events["alpha2_log_from"]:]
        for job in (first, second):
            self.assertIn("deltas in int4, encoded on the device (wire_torch) (--encode-on)", job)
        self.assertNotIn("failed its check", log, "a theta updated on the devices is the aggregator's")
        fed = [r for r in self.rows["alpha"] if r["split"] == "federation"]
        self.assertTrue(fed and all(r["encode_on"] == "device" for r in fed), fed)
        self.assertIn(self.events["alpha2_incarnation"], {r["incarnation"] for r in fed},
                      "the restarted alpha wrote no federation row")
        beta = [r for r in self.rows["beta"] if r["split"] == "federation"]
        self.assertTrue(beta and all(r["encode_on"] == "host" for r in beta), "topk is encoded on the host")

    @classmethod
    def names_shapes(cls):
        import tensorio
        with tensorio.TensorReader(os.path.join(cls.tmp.name, "init.safetensors")) as r:
            return {k: r.specs[k][1] for k in r.names}

    def test_overlapped_sites_trained_on_while_their_delta_was_in_flight(self):
        # Both sites run --overlap: each phase starts right after its delta left, on the same base,
        # and the delta's federation row is written when its theta_global was folded in (fold_step:
        # on arrival for alpha, --overlap-fold eager; at the next phase's end for beta, --overlap-fold
        # end), after at least one step of the next phase. Train rows written before that row (file
        # order) and after the delta's phase are still on the sent delta's base round.
        for name, fold in (("alpha", "eager"), ("beta", "end")):
            rows = [r for r in self.rows[name] if r["split"] in ("train", "federation")]
            fed = [i for i, r in enumerate(rows) if r["split"] == "federation"]
            self.assertTrue(fed and all(rows[i]["overlap"] and rows[i]["settle_s"] >= 0 for i in fed), name)
            ahead = [rows[i] for i in fed if rows[i].get("round_at_next_phase") is not None]
            if name == "alpha":          # its rounds wait for beta's throttled phases: many seconds in flight
                self.assertTrue(ahead, f"{name}: no phase started while its delta was in flight")
            for i in fed:
                r = rows[i]
                if r.get("round_at_next_phase") is not None:
                    self.assertGreater(r["fold_step"], r["step"], (name, r))
                before = [t for t in rows[:i] if t["split"] == "train" and t["incarnation"] == r["incarnation"]
                          and t["step"] > r["step"]]
                self.assertTrue(all(t["round"] == r["base_round"] for t in before), (name, r, before))
                if fold == "end" and r.get("round_at_next_phase") is not None:
                    self.assertTrue(before, f"alpha: no train row of the next phase before the fold: {r}")
            # the server's rule is the same under overlap: each merged delta named the round it merged into - 1
            merged = [(rec["round"], o["base_round"]) for rec in self.records() for o in rec["outcomes"]
                      if o["outcome"] == "merged" and o["cluster"] == name]
            self.assertTrue(merged and all(b == r - 1 for r, b in merged), (name, merged))

    def test_eager_state_came_through_the_kill(self):
        # alpha (--overlap-fold eager) learned the aggregator's outer step from its join answer,
        # and its estimate of the aggregator's momentum rides in its checkpoints: the restarted
        # job restored, from the checkpoint it resumed at, the estimate the killed job had there
        # (the same step, round and norm, non-zero: rounds had been merged)
        with open(os.path.join(self.tmp.name, "alpha.log"), errors="replace") as f:
            log = f.read()
        mark = self.events["alpha2_log_from"]
        for job in (log[:mark], log[mark:]):
            self.assertIn("the aggregator's outer step is Nesterov, lr 0.7, momentum 0.9", job)
        saved, restored = self.eager_lines("holds", 0, mark), self.eager_lines("restored", mark)
        self.assertEqual(len(restored), 1, log[mark:][-3000:])
        self.assertIn(restored[0], saved, "the restarted job's estimate is the one the killed job checkpointed")
        self.assertGreater(float(restored[0][2]), 0.0, restored)

    def test_loss_falls_and_rows_are_written(self):
        recs = [r for r in self.records() if r.get("loss") is not None]
        first = sum(r["loss"] for r in recs[:2]) / 2
        last = sum(r["loss"] for r in recs[-2:]) / 2
        self.assertLess(last, first - 1.0, f"merged-round losses {[round(r['loss'], 3) for r in recs]}")
        peaks = [c.get("peak_mem_gib") for r in recs for c in r["clusters"].values()]
        self.assertTrue(peaks and all(isinstance(v, float) and v > 0 for v in peaks),
                        f"each delta's peak memory reaches the aggregator as peak_mem_gib: {peaks[:4]}")
        for name in ("alpha", "beta"):
            fed = [r for r in self.rows[name] if r["split"] == "federation"]
            self.assertTrue(fed and all({"round", "base_round", "tokens", "loss", "merged"} <= set(r) for r in fed))
            final = [r for r in self.rows[name] if r["split"] == "eval" and r.get("final")]
            self.assertEqual(len(final), 1, f"{name}: one final eval of theta_global")
            self.assertEqual(final[0]["round"], recs[-1]["round"], "the final eval is of the last round")
        self.assertTrue(any(r["split"] == "eval" and not r.get("final") for r in self.rows["alpha"]))

    def test_rows_carry_cumulative_tokens_and_the_incarnation(self):
        for name in ("alpha", "beta"):
            rows = [r for r in self.rows[name] if r["split"] in ("train", "federation", "eval")]
            self.assertTrue(all("tokens_total" in r and r.get("incarnation") for r in rows), name)
            by_inc = {}
            for r in rows:
                by_inc.setdefault(r["incarnation"], []).append(r["tokens_total"])
            for inc, totals in by_inc.items():
                self.assertEqual(totals, sorted(totals), f"{name} {inc}: tokens_total went down")
            first = [r for r in self.rows[name] if r["split"] == "eval" and r.get("first")]
            self.assertEqual([(r["step"], r["tokens_total"]) for r in first], [(0, 0)],
                             f"{name}: one held-out loss before any training")
        self.assertEqual(len({r["incarnation"] for r in self.rows["alpha"]}), 2, "alpha was requeued once")
        self.assertIn(self.events["alpha2_incarnation"], {r["incarnation"] for r in self.rows["alpha"]})
        fed = [r for r in self.rows["beta"] if r["split"] == "federation"]
        self.assertEqual(fed[-1]["tokens_total"], sum(r["tokens"] for r in fed), "beta: tokens_total = its phases")
        reported = [c for r in self.records() for c in r["clusters"].values() if "heldout_loss" in c]
        self.assertTrue(reported, "no site reported its held-out loss with a delta (--eval-every)")
        self.assertTrue(all(c["heldout_loss"] > 0 and c["heldout_round"] >= 0 for c in reported))


if __name__ == "__main__":
    if sys.argv[1:2] == ["worker"]:
        worker(*sys.argv[2:6])
    else:
        unittest.main()


# ---------------------------------------------------------------------------
# phases measured in time: sites of different speeds, one cadence
# ---------------------------------------------------------------------------

class PhasesInTimeRunTest(ScenarioCase):
    """Two sites whose steps differ about 1:3 in time (--throttle-ms) train one model on the
    cadence the aggregator offers (fedmom_server.py --phase-s): alpha (FSDP2, 2 ranks, rank 1's
    clock running 5x fast: $PWW_TEST_PHASE_CLOCK_RATE) and beta (DDP, 1 rank). Every round
    that merged both holds a different step count from each; every phase of alpha ended on
    the same step on both ranks although they disagree on the time; some phases were ended
    by the clock (their lease's tail given back to DARL); the run audit passes: every block
    inside exactly one merged delta."""
    T = 2.5
    PREFIX = "fed-timed-"

    @classmethod
    def run_scenario(cls, t):
        cls.manifest = make_corpus(t, 60000)
        init = export_init(t, cls.manifest)
        L = cls.launcher
        svc = cls.svc = harness.start_services(
            L, t, cls.manifest, init, block_size=4, default_ports=False,
            darl_args=["--min-ttl", 15, "--default-ttl", 20, "--max-ttl", 20],
            fedmom_args=["--darl-retry-s", 1, "--member-timeout-s", 30, "--round-deadline-s", 120,
                         "--phase-s", cls.T])
        common = ["--model", "qwen3-tiny", "--batch-size", "2", "--lr", "3e-3", "--diloco-inner-steps", "8", "--eval-windows", "16",
                  "--eval-every", "0", "--log-every", "4", "--register-wait-s", "120"]
        runs = os.path.join(t, "runs")
        env = {**harness.child_env(), testhooks.PHASE_CLOCK_RATE_ENV: "1:5"}
        alpha = L.start("alpha", harness.site_command("alpha", svc, cls.manifest, nproc=2, parallel="fsdp",
                                                      runs_dir=runs, train_args=[*common, "--throttle-ms", "40"]),
                        log_of(t, "alpha"), env=env)
        beta = L.start("beta", harness.site_command("beta", svc, cls.manifest, nproc=1, parallel="ddp",
                                                    runs_dir=runs, train_args=[*common, "--throttle-ms", "300"]),
                       log_of(t, "beta"))
        for p in (alpha, beta):
            harness.expect(lambda: not p.alive(), f"{p.name} to finish", list(svc.procs.values()), timeout_s=600)
            if p.poll() != 0:
                raise AssertionError(f"{p.name} exited {p.poll()}:\n" + "\n".join(p.tail(40)))
        for p in svc.procs.values():
            p.stop(20)
        cls.records = durable.read_jsonl(os.path.join(svc.state_dir, "fedmom", "rounds.jsonl"))
        cls.rows = {n: durable.read_jsonl(os.path.join(runs, n, "metrics.jsonl")) for n in ("alpha", "beta")}
        with open(log_of(t, "alpha"), errors="replace") as f:
            cls.alpha_log = f.read()

    def test_the_audit_passes(self):
        import audit
        report = audit.audit(self.svc.state_dir, manifest=self.manifest)
        self.assertTrue(report.ok, "\n".join(report.lines))

    def test_both_sites_step_counts_differ_in_every_joint_round(self):
        joint = [r for r in self.records if {"alpha", "beta"} <= set(r["clusters"])]
        self.assertGreaterEqual(len(joint), 3, [sorted(r["clusters"]) for r in self.records])
        for r in joint:
            if "data" in (r["clusters"]["alpha"]["ended_by"], r["clusters"]["beta"]["ended_by"]):
                continue            # the corpus's last blocks decided that phase's length, not the clock
            a, b = r["clusters"]["alpha"]["steps"], r["clusters"]["beta"]["steps"]
            self.assertNotEqual(a, b, f"round {r['round']}: both sites ran {a} steps")
        # the faster site does more steps in a round, not the same H
        self.assertGreater(sum(r["clusters"]["alpha"]["steps"] for r in joint),
                           2 * sum(r["clusters"]["beta"]["steps"] for r in joint))

    def test_the_phases_were_planned_from_the_offered_cadence_and_some_ended_by_the_clock(self):
        for name in ("alpha", "beta"):
            phases = [r for r in self.rows[name] if r.get("split") == "phase"]
            self.assertTrue(phases, name)
            self.assertTrue(all(r["ended_by"] in ("clock", "lease", "data") for r in phases), phases)
            self.assertTrue(all(0 < r["budget_s"] <= self.T for r in phases), phases)
        ends = [r["ended_by"] for n in ("alpha", "beta") for r in self.rows[n] if r.get("split") == "phase"]
        self.assertIn("clock", ends)
        self.assertIn("phases measured in time: 2.5 s a round (the aggregator's --phase-s)", self.alpha_log)

    def test_ranks_that_disagree_on_the_clock_end_every_phase_on_the_same_step(self):
        said = re.findall(r"phase clock: rank (\d) ends the phase after (\d+) steps, (\d+) windows \(cut: (\w+)\)",
                          self.alpha_log)
        by_rank = {r: [x[1:] for x in said if x[0] == r] for r in ("0", "1")}
        phases = [r for r in self.rows["alpha"] if r.get("split") == "phase"]
        self.assertEqual(len(by_rank["0"]), len(phases))
        self.assertEqual(by_rank["0"], by_rank["1"])
        self.assertEqual([int(s) for s, _, _ in by_rank["0"]], [r["steps"] for r in phases])
        self.assertIn("True", [c for _, _, c in by_rank["0"]], "no phase of alpha was cut by the clock")
