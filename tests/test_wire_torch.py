"""wire_torch: the site's torch codec against wire.py's numpy one, bit for bit on the CPU
(bench/gpu_check.sh runs the same comparison on a GPU): the parts' bytes, the decoded
values, the update applied to theta, the file written from torch parts, and dim-0 shards."""
import os
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
          wire.Codec("int8", block=256)]


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
        for codec in (wire.Codec("int4"), wire.Codec("int8", block=64)):
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
        codec = wire.Codec("int4")
        with wire.WireWriter(self.p("numpy"), specs, codec) as w:
            for n, a in arrays.items():
                w.write(n, a)
        with wire.WireWriter(self.p("torch"), specs, codec) as w:
            for n, a in arrays.items():
                w.write_parts(n, wire_torch.to_numpy(wire_torch.encode(codec, torch.from_numpy(a.copy()))[0]))
        with open(self.p("numpy"), "rb") as f, open(self.p("torch"), "rb") as g:
            self.assertEqual(f.read(), g.read())

    def test_dim0_shards_encode_to_their_part_of_the_whole(self):
        rng = np.random.default_rng(53)
        for codec, shape, cuts in ((wire.Codec("int4"), (64, 1024), (16, 40)), (wire.Codec("int8"), (33, 301), (5, 6)),
                                   (wire.Codec("int4"), (34, 301), (10, 24))):
            x = torch.from_numpy(hard_values(rng, shape))
            whole, _ = wire_torch.encode(codec, x)
            shards = [x[a:b] for a, b in zip((0,) + cuts, cuts + (shape[0],))]
            self.assertTrue(all(wire_torch.shard_ok(codec, tuple(s.shape), shape) for s in shards))
            parts = [wire_torch.encode(codec, s)[0] for s in shards]
            for k in whole:
                with self.subTest(codec=codec.fmt, shape=shape, part=k):
                    self.assertTrue(torch.equal(torch.cat([p[k].reshape(-1) for p in parts]), whole[k].reshape(-1)))
        self.assertFalse(wire_torch.shard_ok(wire.Codec("int4"), (3, 301), (34, 301)))     # odd values

    def test_formats_it_does_not_encode_say_where_they_go(self):
        with self.assertRaisesRegex(ValueError, "topk goes through wire.py"):
            wire_torch.encode(wire.Codec("topk"), torch.zeros(4))


if __name__ == "__main__":
    unittest.main()
