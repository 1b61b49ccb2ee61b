"""wire_torch: the site's torch codec against wire.py's numpy one, bit for bit on the CPU
(bench/gpu_check.sh runs the same comparison on a GPU): the parts' bytes, the decoded
values, the update applied to theta, the file written from torch parts, and dim-0 shards.

ShardedShareTest: the site's share on its devices (fedphase.FedMomCarrier(encode_on="device"),
shard_wire.py) on real gloo groups of 2 and 3 CPU ranks under FSDP2 (fully_shard), uneven
and empty shards included, int4, int8 and int2 (its residual decayed, --wire-feedback-decay): the delta file and the error-feedback residual
(assembled from the per-rank files) equal, bit for bit, what the host path (numpy,
encode_on="host") writes over three rounds (nothing owed, owed, owed after a delta not
merged), and the update of theta_global added on the devices equals wire.apply_update's
bits and digest; a resume at another world size, or with the host path, resets the
residual and says so. (Spawned once per world size, ~30 s each on 2 busy cores.)
"""
import json
import os
import shutil
import tempfile
import time
import unittest

import numpy as np
import torch

import tensorio
import wire
import wire_torch
from fixtures import TmpDirTest, hard_values

SHAPES = [(7, 301), (5,), (3, 3, 3), (2, 9001), (), (0, 4), (4, 0), (3, 129), (64, 1024), (1, 127),
          (129, 65), (9, 1), (300, 256)]
CODECS = [wire.Codec("int4"), wire.Codec("int8"), wire.Codec("int4", block=64), wire.Codec("int4", block=65),
          wire.Codec("int8", block=256), wire.Codec("int2"), wire.Codec("int2", block=65)]


def same_parts(test, got, want):
    test.assertEqual(sorted(got), sorted(want))
    for k in want:
        test.assertEqual((got[k].dtype, got[k].shape), (want[k].dtype, want[k].shape), k)
        test.assertEqual(got[k].tobytes(), want[k].tobytes(), k)


class TorchCodecTest(TmpDirTest):
    def test_torch_encode_is_numpy_encode_bit_for_bit(self):
        rng = np.random.default_rng(50)
        for codec in CODECS:
            for shape in SHAPES:
                for kind in ("normal", "hard", "zeros"):
                    x = {"normal": lambda: rng.standard_normal(shape).astype(np.float32),
                         "hard": lambda: hard_values(rng, shape),
                         "zeros": lambda: np.zeros(shape, np.float32)}[kind]()
                    with self.subTest(codec=codec.fmt, block=codec.block, shape=shape, kind=kind):
                        want, want_sent = codec.encode(x, reference=True)
                        parts, sent = wire_torch.encode(codec, torch.from_numpy(x.copy()))
                        same_parts(self, wire_torch.to_numpy(parts), want)
                        self.assertEqual(sent.numpy().tobytes(), want_sent.tobytes())
                        # in passes of a few rows (a CPU's default for a large tensor): the same bits
                        chunked, chunked_sent = wire_torch.encode(codec, torch.from_numpy(x.copy()), chunk=300)
                        same_parts(self, wire_torch.to_numpy(chunked), want)
                        self.assertEqual(chunked_sent.numpy().tobytes(), want_sent.tobytes())
                        back = wire_torch.decode(codec, parts[""], parts["#scale"], shape)
                        self.assertEqual(back.numpy().tobytes(), want_sent.tobytes())
                        got = wire_torch.from_numpy(want)
                        self.assertEqual(wire_torch.decode(codec, got[""], got["#scale"], shape).numpy().tobytes(),
                                         want_sent.tobytes())

    def test_apply_on_torch_is_apply_update_bit_for_bit(self):
        rng = np.random.default_rng(51)
        shapes = {f"t{i}": s for i, s in enumerate(SHAPES)}
        theta = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
        upd = {n: hard_values(rng, s) for n, s in shapes.items()}
        with tensorio.TensorWriter(self.p("theta"), [(n, "F32", s) for n, s in shapes.items()]) as w:
            for n, a in theta.items():
                w.write(n, a)
        for codec in (wire.Codec("int4"), wire.Codec("int8", block=64), wire.Codec("int2")):
            with self.subTest(codec=codec.fmt):
                with wire.WireWriter(self.p("upd"), list(shapes.items()), codec) as w:
                    for n, a in upd.items():
                        w.write(n, a)
                d = wire.Digest()
                with wire.WireReader(self.p("upd")) as r:
                    for n, s in shapes.items():
                        parts = wire_torch.from_numpy({k[len(n):]: r.r.read(k) for k, _, _ in codec.parts(n, s)})
                        t = wire_torch.apply_(torch.from_numpy(theta[n].copy()), codec, parts[""], parts["#scale"])
                        d.add(n, t.numpy())
                # apply_update refuses anything but the digest of its own result: the torch one
                wire.apply_update(self.p("theta"), self.p("upd"), self.p("out"), d.hexdigest(), fsync=False)

    def test_a_file_from_torch_parts_is_the_file_wire_writer_writes(self):
        rng = np.random.default_rng(52)
        arrays = {f"t{i}": hard_values(rng, s) for i, s in enumerate(SHAPES)}
        specs = [(n, a.shape) for n, a in arrays.items()]
        for codec in (wire.Codec("int4"), wire.Codec("int2")):
            with wire.WireWriter(self.p("numpy"), specs, codec) as w:
                for n, a in arrays.items():
                    w.write(n, a)
            with wire.WireWriter(self.p("torch"), specs, codec) as w:
                for n, a in arrays.items():
                    w.write_parts(n, wire_torch.to_numpy(wire_torch.encode(codec, torch.from_numpy(a.copy()))[0]))
            with open(self.p("numpy"), "rb") as f, open(self.p("torch"), "rb") as g:
                self.assertEqual(f.read(), g.read(), codec.fmt)

    def test_dim0_shards_encode_to_their_part_of_the_whole(self):
        rng = np.random.default_rng(53)
        for codec, shape, cuts in ((wire.Codec("int4"), (64, 1024), (16, 40)), (wire.Codec("int8"), (33, 301), (5, 6)),
                                   (wire.Codec("int4"), (34, 301), (10, 24)), (wire.Codec("int2"), (36, 301), (8, 20))):
            x = torch.from_numpy(hard_values(rng, shape))
            whole, _ = wire_torch.encode(codec, x)
            shards = [x[a:b] for a, b in zip((0,) + cuts, cuts + (shape[0],))]
            self.assertTrue(all(wire_torch.shard_ok(codec, tuple(s.shape), shape) for s in shards))
            parts = [wire_torch.encode(codec, s)[0] for s in shards]
            for k in whole:
                with self.subTest(codec=codec.fmt, shape=shape, part=k):
                    self.assertTrue(torch.equal(torch.cat([p[k].reshape(-1) for p in parts]), whole[k].reshape(-1)))
        self.assertFalse(wire_torch.shard_ok(wire.Codec("int4"), (3, 301), (34, 301)))     # odd values
        self.assertTrue(wire_torch.shard_ok(wire.Codec("int4"), (3, 301), (34, 301), last=True))   # ... at the end
        x = torch.from_numpy(hard_values(rng, (7, 301)))          # 4 + 3 rows: an odd last shard
        whole, _ = wire_torch.encode(wire.Codec("int4"), x)
        parts = [wire_torch.encode(wire.Codec("int4"), s)[0] for s in (x[:4], x[4:])]
        self.assertTrue(torch.equal(torch.cat([p[""] for p in parts]), whole[""]))
        self.assertFalse(wire_torch.shard_ok(wire.Codec("int2"), (2, 301), (36, 301)))     # 602: not whole bytes
        self.assertTrue(wire_torch.shard_ok(wire.Codec("int2"), (4, 301), (36, 301)))

    def test_formats_it_does_not_encode_say_where_they_go(self):
        with self.assertRaisesRegex(ValueError, "topk goes through wire.py"):
            wire_torch.encode(wire.Codec("topk"), torch.zeros(4))


    def test_decode_rows_is_the_rows_of_the_whole_decode(self):
        rng = np.random.default_rng(54)
        for codec, shape in ((wire.Codec("int4"), (7, 3)), (wire.Codec("int4"), (5, 3, 129)),
                             (wire.Codec("int8", block=64), (9, 256)), (wire.Codec("int4", block=64), (4, 0)),
                             (wire.Codec("int2"), (7, 3)), (wire.Codec("int2", block=64), (5, 3, 129))):
            parts, sent = wire_torch.encode(codec, torch.from_numpy(hard_values(rng, shape)))
            for a, b in ((0, 1), (1, 2), (1, shape[0]), (3, 3), (shape[0] - 1, shape[0])):
                with self.subTest(codec=codec.fmt, shape=shape, rows=(a, b)):
                    got = wire_torch.decode_rows(codec, parts[""], parts["#scale"], shape, a, b)
                    self.assertEqual(got.numpy().tobytes(), sent[a:b].numpy().tobytes())
        with self.assertRaisesRegex(ValueError, "1-D tensor's blocks cross its rows"):
            wire_torch.decode_rows(wire.Codec("int4"), *wire_torch.encode(wire.Codec("int4"), torch.ones(8))[0].values(),
                                   (8,), 0, 4)
        # a 1-D shard's blocks are not its part of the whole's: never encoded per rank
        self.assertFalse(wire_torch.shard_ok(wire.Codec("int8"), (64,), (128,)))


# ---------------------------------------------------------------------------
# the site's share on real gloo groups under FSDP2
# ---------------------------------------------------------------------------

SHARE_SHAPES = {"embed": (37, 130), "wq": (16, 256), "odd": (5, 3), "few": (2, 6), "cube": (6, 4, 9),
                "norm": (7,), "int4_odd": (7, 3)}
SHARE_CODECS = {"int4": wire.Codec("int4"), "int8": wire.Codec("int8", block=64), "int2": wire.Codec("int2", block=64)}
SHARE_DECAY = {"int2": 0.95}          # int2's rounds with a decayed residual (--wire-feedback-decay)
SPAWN_DEADLINE_S = 600


class ShareModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        for n, s in SHARE_SHAPES.items():
            self.register_parameter(n, torch.nn.Parameter(torch.zeros(s)))

    def forward(self, x):
        return x


def _share_entry(rank, world, tmp):
    import torch.distributed as dist
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, f'store-{world}')}", rank=rank,
                            world_size=world)
    try:
        _share_worker(rank, world, tmp)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _assemble(wd, world, names, shapes):
    """The whole residual from the per-rank files of `wd` (each tensor's rows from its layout)."""
    whole = {}
    for r in range(world):
        with tensorio.TensorReader(os.path.join(wd, f"residual-rank{r}-next.safetensors")) as f:
            layout = json.loads(f.metadata["layout"])
            for n in f.names:
                a = f.read(n)
                if layout[n] == "whole":
                    whole[n] = a
                else:
                    whole.setdefault(n, np.zeros(shapes[n], np.float32))[layout[n][0]:layout[n][1]] = a
    return {n: whole[n] for n in names}


def _share_worker(rank, world, tmp):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, distribute_tensor

    import fedphase
    model = ShareModel()
    fully_shard(model)
    names = [n for n, _ in model.named_parameters()]
    params = [p for _, p in model.named_parameters()]
    shapes = {n: tuple(p.shape) for n, p in zip(names, params)}
    rng = np.random.default_rng(60)
    full = {n: torch.from_numpy(hard_values(rng, s)) for n, s in shapes.items()}   # the same on every rank
    local = {n: distribute_tensor(full[n], p.device_mesh, p.placements, src_data_rank=0).to_local()
             for n, p in zip(names, params)}
    said, report = [], {"uneven": any(p.to_local().shape[0] * world != p.shape[0] for p in params),
                        "empty": any(p.to_local().numel() == 0 for p in params)}
    log = said.append if rank == 0 else (lambda m: None)
    for label, codec in SHARE_CODECS.items():
        files = {}
        for where in ("host", "device"):
            wd = os.path.join(tmp, f"w{world}-{label}-{where}")
            c = fedphase.FedMomCarrier(None, wd, codec, fresh=True, log=log, encode_on=where,
                                       feedback_decay=SHARE_DECAY.get(label, 1.0))
            # round 0: nothing owed; 1: what 0 left (merged); 2: what 0 left still (1 was not merged)
            for rnd, scale, merged in ((0, 1.0, True), (1, 2.0, False), (2, -0.5, True)):
                c.round = rnd
                # DiLoCo's deltas are theta - theta_i, fp32 views of one buffer: the file holds -delta
                c.write_delta(names, params, [local[n] * scale for n in names])
                if rank == 0:
                    with open(c.delta_path, "rb") as f:
                        delta = f.read()
                    if where == "host":
                        with tensorio.TensorReader(os.path.join(wd, "residual-next.safetensors")) as f:
                            res = {n: f.read(n) for n in f.names}
                    else:
                        res = _assemble(wd, world, names, shapes)
                    files[where, rnd] = (delta, {n: a.tobytes() for n, a in res.items()}, c.residual_norm())
                dist.barrier()             # every rank's files read before any rank settles them
                if c.residual is not None:
                    c.residual.settle(rnd, rnd + 1 if merged else None, "" if merged else "stale: a test")
            if where == "device":
                report[f"{label}_per_rank"] = sorted(n for n, pl in zip(names, c.places) if pl.per_rank)
                report[f"{label}_whole"] = sorted(n for n, pl in zip(names, c.places) if not pl.per_rank)
        if rank == 0:
            report[f"{label}_same_delta"] = [files["host", r][0] == files["device", r][0] for r in range(3)]
            report[f"{label}_same_residual"] = [files["host", r][1] == files["device", r][1] for r in range(3)]
            report[f"{label}_norms"] = [(files["host", r][2], files["device", r][2]) for r in range(3)]
            report[f"{label}_owed_nonzero"] = any(
                np.frombuffer(b, np.float32).any() for b in files["host", 0][1].values())

    # theta_global's update added on the devices: the aggregator's bits and digest
    for label, codec in (("int4", wire.Codec("int4")), ("int8", wire.Codec("int8", block=64)),
                         ("int4b64", wire.Codec("int4", block=64)), ("int2", wire.Codec("int2"))):
        wd = os.path.join(tmp, f"w{world}-apply-{label}")
        c = fedphase.FedMomCarrier(None, wd, "int4", fresh=True, log=log, encode_on="device")
        c._prepare(names, params)
        theta_path, upd = os.path.join(wd, "theta.safetensors"), os.path.join(wd, "update.safetensors")
        step = {n: hard_values(rng, s) * np.float32(1e-3) for n, s in shapes.items()}
        if rank == 0:
            tensorio.save_torch(full, theta_path)
            want = wire.Digest()
            with wire.WireWriter(upd, list(shapes.items()), codec) as w:
                for n in names:
                    want.add(n, wire.add_update(full[n].numpy(), w.write(n, step[n])))
        dist.barrier()
        theta = [local[n].clone() for n in names]
        c.apply_update(names, params, theta, upd)
        got = {n: DTensor.from_local(t, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()).full_tensor()
               for n, t, p in zip(names, theta, params)}
        if rank == 0:
            have = wire.Digest()
            for n in names:
                have.add(n, got[n].numpy())
            report[f"apply_{label}_digest"] = have.hexdigest() == want.hexdigest()
            try:             # the host's check behind: the file's addition must give the same digest
                wire.apply_update(theta_path, upd, os.path.join(wd, "next.safetensors"), have.hexdigest(), fsync=False)
                report[f"apply_{label}_host_agrees"] = True
            except wire.WireError as e:
                report[f"apply_{label}_host_agrees"] = str(e)

    # a resume: the same layout keeps what is owed; another world size, or the host path, resets
    keep = os.path.join(tmp, "resume")
    if world == 2:
        c = fedphase.FedMomCarrier(None, keep, "int4", fresh=True, log=log, encode_on="device")
        c.round = 0
        c.write_delta(names, params, [local[n] for n in names])
        c.residual.settle(0, 1, "")
        dist.barrier()
        again = fedphase.FedMomCarrier(None, keep, "int4", log=log, encode_on="device")
        again._prepare(names, params)
        report["same_layout_kept"] = os.path.exists(again.residual.path)
        if rank == 0:
            report["said_w2"] = list(said)
    else:
        c = fedphase.FedMomCarrier(None, keep, "int4", log=log, encode_on="device")
        c._prepare(names, params)
        dist.barrier()                       # every rank has decided before any looks, or writes
        report["other_world_kept"] = [os.path.basename(f) for f in sorted(os.listdir(keep))
                                      if f.startswith("residual")]
        dist.barrier()
        if rank == 0:
            report["said_w3"] = list(said)
        c.round = 5
        c.write_delta(names, params, [local[n] for n in names])
        dist.barrier()
        if rank == 0:
            fedphase.FedMomCarrier(None, keep, "int4", log=log, encode_on="host")      # the host path after it
            report["said_host"] = said[-1]
            report["after_host"] = sorted(f for f in os.listdir(keep) if f.startswith("residual"))
    with open(os.path.join(tmp, f"report-w{world}-r{rank}.json"), "w") as f:
        json.dump(report, f)


class ShardedShareTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import torch.multiprocessing as mp
        cls.tmp = tempfile.mkdtemp(prefix="shard-share-")
        cls.reports = {}
        for world in (2, 3):                  # in this order: the 3-rank job resumes the 2-rank one's residual
            ctx = mp.start_processes(_share_entry, args=(world, cls.tmp), nprocs=world, join=False,
                                     start_method="spawn")
            end = time.monotonic() + SPAWN_DEADLINE_S
            try:
                while not ctx.join(timeout=1.0):
                    if time.monotonic() > end:
                        raise AssertionError(f"the {world}-rank group still runs after {SPAWN_DEADLINE_S} s")
            finally:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                        p.join(30)
            for r in range(world):
                with open(os.path.join(cls.tmp, f"report-w{world}-r{r}.json")) as f:
                    cls.reports[world, r] = json.load(f)

    @classmethod
    def tearDownClass(cls):
        shutil.rmtree(cls.tmp, ignore_errors=True)

    def test_the_delta_and_the_residual_are_the_host_paths_bit_for_bit(self):
        for world in (2, 3):
            r = self.reports[world, 0]
            self.assertTrue(r["uneven"], "some shards must be uneven")
            if world == 3:
                self.assertTrue(any(self.reports[3, k]["empty"] for k in range(3)), "a rank must hold an empty shard")
            for label in SHARE_CODECS:
                with self.subTest(world=world, codec=label):
                    self.assertEqual(r[f"{label}_same_delta"], [True] * 3)
                    self.assertEqual(r[f"{label}_same_residual"], [True] * 3)
                    self.assertTrue(r[f"{label}_owed_nonzero"], "round 0 left nothing owed: round 1 proves nothing")
                    for host, device in r[f"{label}_norms"]:
                        self.assertAlmostEqual(host, device, delta=1e-6 * host)
                    # 2-D+ tensors encode per rank; 1-D ones (blocks across the shards), and an
                    # odd int4 shard, whole on rank 0
                    # (int2: 19 of embed's 130-value rows are not whole bytes of codes: whole on rank 0)
                    self.assertIn("embed" if label != "int2" else "wq", r[f"{label}_per_rank"])
                    self.assertIn("cube", r[f"{label}_per_rank"])
                    self.assertIn("norm", r[f"{label}_whole"])
            # 7 x 3 over 2 ranks: 4 + 3 rows, the odd shard last; over 3: 3 + 3 + 1, an odd one first
            self.assertIn("int4_odd", r["int4_per_rank" if world == 2 else "int4_whole"])
            self.assertIn("int4_odd", r["int8_per_rank"])

    def test_the_update_added_on_the_devices_is_the_aggregators_theta(self):
        for world in (2, 3):
            for label in ("int4", "int8", "int4b64", "int2"):
                with self.subTest(world=world, update=label):
                    r = self.reports[world, 0]
                    self.assertTrue(r[f"apply_{label}_digest"], "the device's theta has another digest")
                    self.assertIs(r[f"apply_{label}_host_agrees"], True)

    def test_a_resume_keeps_the_same_layout_and_resets_another_one(self):
        self.assertTrue(all(self.reports[2, r]["same_layout_kept"] for r in range(2)))
        self.assertFalse(any("reset" in m for m in self.reports[2, 0]["said_w2"]), self.reports[2, 0]["said_w2"])
        said = self.reports[3, 0]["said_w3"]
        self.assertTrue(any("error feedback reset (nothing owed from now on): the residual was kept over 2 ranks, "
                            "this job has 3" in m for m in said), said)
        self.assertEqual([self.reports[3, r]["other_world_kept"] for r in range(3)], [[]] * 3)
        self.assertIn("kept per rank by a job with --encode-on device", self.reports[3, 0]["said_host"])
        self.assertEqual(self.reports[3, 0]["after_host"], [])


if __name__ == "__main__":
    unittest.main()
