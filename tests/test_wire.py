"""wire: the compressed delta formats against safetensors (layout) and naive per-element
references (values), their error bounds, bit packing on odd sizes, and hostile files."""
import json
import math
import os
import subprocess
import sys
import time
import tracemalloc
import unittest

import numpy as np
import safetensors
import shutil
import safetensors.torch
import torch

import fedmom_merge
import fedmom_round
import fedmom_state
import tensorio
import wire
from fixtures import TmpDirTest, hard_values

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sample(rng):
    """Odd sizes on purpose: short last blocks and chunks, odd element counts, a scalar, empties."""
    return {
        "layers.0.w": rng.standard_normal((7, 301)).astype(np.float32),
        "layers.0.b": (rng.standard_normal(5) * 1e-6).astype(np.float32),
        "odd": rng.standard_normal((3, 3, 3)).astype(np.float32),
        "wide": (rng.standard_normal((2, 9001)) * np.float32(3e3)).astype(np.float32),
        "scalar": np.array(-2.5, np.float32),
        "empty": np.zeros((0, 4), np.float32),
        "zeros": np.zeros((3, 129), np.float32),
    }


CODECS = [wire.Codec(f) for f in wire.FORMATS] + [
    wire.Codec("int8", block=64), wire.Codec("int4", block=256), wire.Codec("int2", block=64),
    wire.Codec("topk", topk_chunk=100, topk_k=7, topk_bits=8), wire.Codec("topk", topk_chunk=4096, topk_k=4096),
    wire.Codec("topk", topk_chunk=100, topk_k=7, topk_bits=2)]


def naive_block_decode(codec, q, scale_bits, shape):
    """Per element: value = q[row, col] * scale[row, col // block], float32."""
    rows, cols = wire.rows_cols(shape)
    q = np.asarray(q).reshape(rows, cols)
    scale = tensorio.bf16_to_f32(scale_bits)
    out = np.zeros((rows, cols), np.float32)
    for r in range(rows):
        for c in range(cols):
            out[r, c] = np.float32(int(q[r, c])) * scale[r, c // codec.block]
    return out.reshape(shape)


def naive_int2_scale(x):
    """int2's scale of one block (or topk chunk's kept values), as wire.py's docstring says it:
    the largest magnitude / 3, rounded up to a bfloat16."""
    mag = [abs(float(v)) for v in np.asarray(x, np.float32).reshape(-1)]
    if not mag:
        return 0.0
    return float(tensorio.bf16_to_f32(wire.bf16_up(np.float32([max(mag)]) / np.float32(3)))[0])


def naive_bits(packed, nbits, count):
    """Unpack bit by bit from a string of the bytes' bits, least significant first."""
    s = "".join(format(int(b), "08b")[::-1] for b in packed)
    return [int(s[i * nbits:(i + 1) * nbits][::-1], 2) for i in range(count)]


class Tmp(TmpDirTest):
    def write(self, path, arrays, codec, metadata=None):
        sent = {}
        with wire.WireWriter(path, [(n, a.shape) for n, a in arrays.items()], codec, metadata) as w:
            for n, a in arrays.items():
                sent[n] = w.write(n, a)
        return sent


class BitsTest(unittest.TestCase):
    def test_pack_unpack_against_a_bit_string_for_every_width_and_odd_counts(self):
        rng = np.random.default_rng(0)
        for nbits in range(1, 17):
            for count in (0, 1, 3, 7, 13, 64, 101):
                codes = rng.integers(0, 1 << nbits, size=count, dtype=np.uint32)
                packed = wire.pack_bits(codes, nbits)
                self.assertEqual(packed.dtype, np.uint8)
                self.assertEqual(packed.size, wire.packed_bytes(count, nbits), (nbits, count))
                self.assertEqual(naive_bits(packed, nbits, count), codes.tolist(), (nbits, count))
                self.assertEqual(wire.unpack_bits(packed, nbits, count).tolist(), codes.tolist())
                self.assertTrue(wire.padding_is_zero(packed, nbits, count))

    def test_bf16_up_never_rounds_a_scale_down(self):
        x = np.abs(np.random.default_rng(1).standard_normal(10000).astype(np.float32)) * np.float32(1e-3)
        up = tensorio.bf16_to_f32(wire.bf16_up(x))
        self.assertTrue(np.all(up >= x))
        self.assertTrue(np.all(up <= x * np.float32(1 + 2 ** -7)))
        self.assertEqual(wire.bf16_up(np.float32([0.0, 1.0])).tolist(), [0, 0x3F80])


class RoundTripTest(Tmp):
    def test_what_the_writer_returns_is_what_the_reader_decodes_bit_for_bit(self):
        arrays = sample(np.random.default_rng(2))
        for codec in CODECS:
            with self.subTest(codec=codec):
                sent = self.write(self.p("d"), arrays, codec, {"base_round": "4"})
                with wire.WireReader(self.p("d")) as r:
                    self.assertEqual(r.names, list(arrays))
                    self.assertEqual(r.shapes, {n: a.shape for n, a in arrays.items()})
                    self.assertEqual(r.r.metadata["base_round"], "4")
                    for n, a in arrays.items():
                        got = r.read(n)
                        self.assertEqual((got.dtype, got.shape), (np.float32, a.shape), n)
                        self.assertEqual(got.tobytes(), sent[n].tobytes(), n)

    def test_error_bounds_per_format(self):
        arrays = sample(np.random.default_rng(3))
        for codec in CODECS:
            sent = self.write(self.p("d"), arrays, codec)
            for n, x in arrays.items():
                with self.subTest(codec=codec, tensor=n):
                    err = np.abs(sent[n] - x)
                    if codec.fmt == "f32":
                        self.assertEqual(err.max(initial=0), 0)
                    elif codec.fmt == "bf16":
                        self.assertTrue(np.all(err <= np.abs(x) * 2 ** -8))
                    elif codec.fmt == "int2":
                        self.assert_int2_nearest(codec, x, sent[n])
                    elif codec.fmt in wire.LEVELS:
                        self.assert_block_bound(codec, x, err)
                    elif codec.topk_bits == 2:
                        self.assert_topk2_nearest(codec, x, sent[n])
                    else:
                        self.assert_topk_bound(codec, x, sent[n])

    def assert_block_bound(self, codec, x, err):
        """|x - decoded| <= half a step of its block (step = absmax/L, bf16 rounding up included)."""
        rows, cols = wire.rows_cols(x.shape)
        levels = wire.LEVELS[codec.fmt]
        x2, e2 = x.reshape(rows, cols), err.reshape(rows, cols)
        for b in range(0, cols, codec.block):
            amax = np.abs(x2[:, b:b + codec.block]).max(axis=1)
            step = amax / levels * (1 + 2 ** -7)
            self.assertTrue(np.all(e2[:, b:b + codec.block].max(axis=1) <= step / 2 * (1 + 1e-6)))

    def assert_int2_nearest(self, codec, x, got):
        """Per element: the decoded value is the level of {-3, -1, 1, 3} x s nearest to x (a tie
        goes up), s the block's scale by the rule said in wire.py, computed here naively."""
        rows, cols = wire.rows_cols(x.shape)
        x2, g2 = x.reshape(rows, cols), got.reshape(rows, cols)
        for b in range(0, cols, codec.block):
            for r in range(rows):
                self.assert_nearest_level(x2[r, b:b + codec.block], g2[r, b:b + codec.block],
                                          naive_int2_scale(x2[r, b:b + codec.block]))

    def assert_topk2_nearest(self, codec, x, got):
        """topk with 2-bit values: the kept values of a chunk at their nearest level of the int2
        grid, whose scale is the largest kept magnitude / 3."""
        flat, g = x.reshape(-1), got.reshape(-1)
        for lo in range(0, flat.size, codec.topk_chunk):
            xc, gc = flat[lo:lo + codec.topk_chunk], g[lo:lo + codec.topk_chunk]
            kept = np.argsort(-np.abs(xc), kind="stable")[:min(codec.topk_k, xc.size)]
            if np.unique(np.abs(xc)).size == xc.size:         # no ties: the kept set is the one above
                self.assert_nearest_level(xc[kept], gc[kept], naive_int2_scale(xc[kept]))
            self.assertLessEqual(np.count_nonzero(gc), kept.size)

    def assert_nearest_level(self, x, got, s):
        for xv, gv in zip(x.tolist(), got.tolist()):
            if s == 0:
                self.assertEqual(gv, 0)
                continue
            dist = [(abs(xv - q * s), -q) for q in (-3, -1, 1, 3)]
            q = -min(dist)[1]
            self.assertEqual(gv, np.float32(np.float32(q) * np.float32(s)), (xv, s))

    def assert_topk_bound(self, codec, x, got):
        """Per chunk: min(k, len) values kept, each within half a step; every dropped value is
        no larger in magnitude than the smallest kept one."""
        flat, g = x.reshape(-1), got.reshape(-1)
        levels = (1 << (codec.topk_bits - 1)) - 1
        for lo in range(0, flat.size, codec.topk_chunk):
            xc, gc = flat[lo:lo + codec.topk_chunk], g[lo:lo + codec.topk_chunk]
            k = min(codec.topk_k, xc.size)
            order = np.argsort(-np.abs(xc), kind="stable")
            kept, dropped = order[:k], order[k:]
            step = np.abs(xc).max() / levels * (1 + 2 ** -7)
            self.assertTrue(np.all(np.abs(gc[kept] - xc[kept]) <= step / 2 * (1 + 1e-6)))
            if dropped.size:
                self.assertTrue(np.all(np.abs(xc[dropped]) <= np.abs(xc[kept]).min()))
            self.assertLessEqual(np.count_nonzero(gc), k)

    def test_block_formats_agree_with_the_naive_per_element_reference(self):
        arrays = sample(np.random.default_rng(4))
        for codec in (wire.Codec("int8", block=64), wire.Codec("int4", block=128)):
            self.write(self.p("d"), {n: a for n, a in arrays.items() if n != "wide"}, codec)
            raw = safetensors.torch.load_file(self.p("d"))
            for n, a in arrays.items():
                if n == "wide":
                    continue
                codes = raw[n].numpy()
                sbits = raw[n + wire.SCALE].view(torch.int16).numpy().view(np.uint16)
                q = codes if codec.fmt == "int8" else \
                    np.array(naive_bits(codes, 4, a.size), np.int64) - 8
                with wire.WireReader(self.p("d")) as r:
                    np.testing.assert_array_equal(r.read(n), naive_block_decode(codec, q, sbits, a.shape),
                                                  err_msg=f"{codec.fmt} {n}")

    def test_int2_odd_levels_beat_a_grid_with_a_zero_level(self):
        # {-3, -1, 1, 3} x absmax/3 against {-1, 0, 1} x absmax (the symmetric grid of int4's
        # rule with L = 1): on normal values the zero level takes most of a block
        x = np.random.default_rng(7).standard_normal((256, 1024)).astype(np.float32)
        _, sent = wire.Codec("int2").encode(x)
        err = float(np.linalg.norm(x - sent) / np.linalg.norm(x))
        xb = x.reshape(-1, 128)
        s = tensorio.bf16_to_f32(wire.bf16_up(np.abs(xb).max(axis=1)))[:, None]
        ternary = np.clip(np.rint(xb / s), -1, 1) * s
        self.assertLess(err, float(np.linalg.norm(xb - ternary) / np.linalg.norm(xb)) - 0.1)

    def test_topk_agrees_with_a_naive_decode(self):
        x = np.random.default_rng(5).standard_normal(1003).astype(np.float32)
        codec = wire.Codec("topk", topk_chunk=100, topk_k=9, topk_bits=4)
        self.write(self.p("d"), {"t": x}, codec)
        raw = safetensors.torch.load_file(self.p("d"))
        nch, m = codec.chunks(x.size)
        self.assertEqual((nch, m), (11, 10 * 9 + 3))
        codes = naive_bits(raw["t"].numpy(), 4, m)
        pos = naive_bits(raw["t#idx"].numpy(), codec.index_bits, m)
        scale = tensorio.bf16_to_f32(raw["t#scale"].view(torch.int16).numpy().view(np.uint16))
        want, i = np.zeros(x.size, np.float32), 0
        for ch in range(nch):
            for _ in range(min(9, x.size - ch * 100)):
                want[ch * 100 + pos[i]] = np.float32(codes[i] - 8) * scale[ch]
                i += 1
        with wire.WireReader(self.p("d")) as r:
            np.testing.assert_array_equal(r.read("t"), want)

    def test_bytes_per_value_of_each_format(self):
        x = {"w": np.random.default_rng(6).standard_normal((256, 4096)).astype(np.float32)}
        n = x["w"].size
        sizes = {}
        for codec in [wire.Codec(f) for f in wire.FORMATS]:
            self.write(self.p(codec.fmt), x, codec)
            with wire.WireReader(self.p(codec.fmt)) as r:
                sizes[codec.fmt] = r.nbytes("w") / n
        self.assertEqual(sizes["f32"], 4)
        self.assertEqual(sizes["bf16"], 2)
        self.assertAlmostEqual(sizes["int8"], 1 + 2 / 128)
        self.assertAlmostEqual(sizes["int4"], 0.5 + 2 / 128)
        self.assertAlmostEqual(sizes["int2"], 0.25 + 2 / 128)
        self.assertAlmostEqual(sizes["topk"], 64 / 4096 * (12 + 4) / 8 + 2 / 4096)

    def test_plain_files_are_read_as_float32(self):
        a = np.random.default_rng(7).standard_normal((3, 5)).astype(np.float32)
        for dtype in ("F32", "F16", "BF16"):
            with tensorio.TensorWriter(self.p("p"), [("a", dtype, a.shape)]) as w:
                w.write("a", a)
            with wire.WireReader(self.p("p")) as r, tensorio.TensorReader(self.p("p")) as t:
                self.assertIsNone(r.codec)
                np.testing.assert_array_equal(r.read("a"), t.read("a", as_float32=True).astype(np.float32))
            self.assertFalse(wire.is_wire(self.p("p")))

    def test_decode_file_streams_to_plain_f32_with_the_metadata(self):
        arrays = sample(np.random.default_rng(8))
        sent = self.write(self.p("d"), arrays, wire.Codec("int4"), {"base_round": "2"})
        self.assertTrue(wire.is_wire(self.p("d")))
        self.assertEqual(wire.decode_file(self.p("d"), self.p("f32")).fmt, "int4")
        with tensorio.TensorReader(self.p("f32")) as r:
            self.assertEqual(r.metadata["base_round"], "2")
            self.assertEqual(r.metadata["wire_decoded_from"], "int4")
            self.assertFalse(any(k.startswith("wire_") and k != "wire_decoded_from" for k in r.metadata))
            for n, a in arrays.items():
                self.assertEqual(r.specs[n], ("F32", a.shape))
                self.assertEqual(r.read(n).tobytes(), sent[n].tobytes())

    def test_decode_file_checks_names_and_shapes_before_decoding(self):
        codec = wire.Codec("topk", topk_chunk=65536, topk_k=1)
        x = np.zeros(1 << 20, np.float32)
        self.write(self.p("d"), {"w": x}, codec)
        with self.assertRaises(wire.WireError) as cm:
            wire.decode_file(self.p("d"), self.p("out"), specs={"w": (1 << 19,)})
        self.assertIn("'w' has shape [1048576], theta_global has [524288]", str(cm.exception))
        with self.assertRaises(wire.WireError) as cm:
            wire.decode_file(self.p("d"), self.p("out"), specs={"v": (1 << 20,)})
        self.assertIn("missing ['v'], unexpected ['w']", str(cm.exception))
        self.assertFalse(os.path.exists(self.p("out")))
        wire.decode_file(self.p("d"), self.p("out"), specs={"w": (1 << 20,)})

    def test_decoding_memory_follows_the_largest_tensor_not_the_file(self):
        rng = np.random.default_rng(9)
        arrays = {f"t{i}": rng.standard_normal((256, 1024)).astype(np.float32) for i in range(16)}
        for codec in (wire.Codec("int4"), wire.Codec("topk")):
            self.write(self.p("d"), arrays, codec)
            tracemalloc.start()
            try:
                wire.decode_file(self.p("d"), self.p("out"), fsync=False)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
            one, model = 256 * 1024 * 4, 16 * 256 * 1024 * 4
            self.assertLess(peak, 6 * one, f"{codec.fmt}: peak {peak} bytes, one tensor {one}, all {model}")


class FastPathTest(Tmp):
    """The int8/int4 kernels (chunks, threads, reused buffers) against the plain numpy
    reference (Codec.encode/decode(reference=True)), and the streaming file loops against
    a naive loop: bit for bit, on shapes that cross chunk and thread-task boundaries."""
    SHAPES = [(2100, 1024), (4099, 257), (3, 2, 301), (1, 1 << 20), (9001,), (), (0, 4), (4, 0), (5, 1)]

    def test_encode_and_decode_match_the_reference_bit_for_bit_on_any_threads(self):
        rng = np.random.default_rng(40)
        for codec in (wire.Codec("int4"), wire.Codec("int8"), wire.Codec("int4", block=65),
                      wire.Codec("int8", block=256), wire.Codec("int2"), wire.Codec("int2", block=65)):
            for shape in self.SHAPES:
                x = hard_values(rng, shape)
                want, want_sent = codec.encode(x, reference=True)
                for threads in (1, 3):
                    with self.subTest(codec=codec.fmt, block=codec.block, shape=shape, threads=threads):
                        got, sent = codec.encode(x, threads=threads)
                        self.assertEqual(sorted(got), sorted(want))
                        for part in want:
                            self.assertEqual((got[part].dtype, got[part].shape), (want[part].dtype, want[part].shape))
                            self.assertEqual(got[part].tobytes(), want[part].tobytes(), part)
                        self.assertEqual(sent.tobytes(), want_sent.tobytes())
                        out = np.full(x.size + 3, np.nan, np.float32)       # a reused buffer, larger
                        dec = codec.decode(got, shape, threads=threads, out=out)
                        self.assertEqual(dec.shape, shape)
                        self.assertEqual(dec.tobytes(), want_sent.tobytes())
                        self.assertEqual(codec.decode(got, shape, reference=True).tobytes(), want_sent.tobytes())

    def test_the_fast_decode_refuses_what_the_reference_refuses(self):
        rng = np.random.default_rng(41)
        x = rng.standard_normal((2100, 1024)).astype(np.float32)
        for codec, spoil, words in (
                (wire.Codec("int4"), lambda p: p[""].__setitem__(900000, 0x80), "code 0"),
                (wire.Codec("int8"), lambda p: p[""].__setitem__((2000, 7), -128), "-128"),
                (wire.Codec("int4"), lambda p: p["#scale"].__setitem__((7, 1), 0x7FC0), "scale")):
            parts, _ = codec.encode(x)
            parts = {k: a.copy() for k, a in parts.items()}
            spoil(parts)
            for kw in ({"threads": 3}, {"reference": True}):
                with self.subTest(codec=codec.fmt, words=words, **kw), self.assertRaisesRegex(wire.WireError, words):
                    codec.decode(parts, x.shape, **kw)

    def naive_apply(self, theta_path, update_path):
        """The reference: read, decode (plain numpy), add_update, Digest, one tensor at a time."""
        d, out, sents = wire.Digest(), {}, {}
        with tensorio.TensorReader(theta_path) as prev, wire.WireReader(update_path) as upd:
            for n in prev.names:
                parts = {p[len(n):]: upd.r.read(p) for p, _, _ in upd.codec.parts(n, upd.shapes[n])}
                sent = upd.codec.decode(parts, upd.shapes[n], reference=True)
                out[n], sents[n] = wire.add_update(prev.read(n).reshape(sent.shape), sent), sent
                d.add(n, out[n])
        return d.hexdigest(), out, sents

    def test_apply_update_decode_file_and_theta_digest_match_a_naive_loop(self):
        rng = np.random.default_rng(42)
        theta = {f"t{i}": rng.standard_normal(s).astype(np.float32) for i, s in enumerate(self.SHAPES)}
        specs = [(n, a.shape) for n, a in theta.items()]
        with tensorio.TensorWriter(self.p("theta"), [(n, "F32", s) for n, s in specs]) as w:
            for n, a in theta.items():
                w.write(n, a)
        for codec in (wire.Codec("int4"), wire.Codec("int8", block=64), wire.Codec("int2", block=96)):
            upd = {n: hard_values(rng, a.shape) * np.float32(1e-3) for n, a in theta.items()}
            self.write(self.p("upd"), upd, codec)
            want_digest, want, sents = self.naive_apply(self.p("theta"), self.p("upd"))
            for threads in (1, 3):
                with self.subTest(codec=codec.fmt, threads=threads):
                    got = wire.apply_update(self.p("theta"), self.p("upd"), self.p("out"), want_digest,
                                            fsync=False, threads=threads)
                    self.assertEqual(got, want_digest)
                    self.assertEqual(wire.theta_digest(self.p("out"), threads=threads), want_digest)
                    wire.decode_file(self.p("upd"), self.p("dec"), fsync=False, threads=threads)
                    with tensorio.TensorReader(self.p("out")) as r, tensorio.TensorReader(self.p("dec")) as dr:
                        for n, a in want.items():
                            self.assertEqual(r.read(n).tobytes(), a.tobytes(), n)
                            self.assertEqual(dr.read(n).tobytes(), sents[n].tobytes(), n)

    def test_a_forked_child_encodes_on_threads_of_its_own(self):
        # the parent's pool threads do not exist in a fork: reusing its pool would wait forever
        codec, x = wire.Codec("int4"), np.random.default_rng(43).standard_normal((2100, 1024)).astype(np.float32)
        want = codec.encode(x, threads=2)[1].tobytes()
        pid = os.fork()
        if pid == 0:
            try:
                os._exit(0 if codec.encode(x, threads=2)[1].tobytes() == want else 1)
            finally:
                os._exit(2)
        for _ in range(1200):                        # a hang fails after two minutes, not never
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.1)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            self.fail("the forked child's encode hung")
        self.assertEqual(os.waitstatus_to_exitcode(status), 0)

    def test_threads_are_validated(self):
        for bad in (0, -1, 1.5, True):
            with self.subTest(bad=bad), self.assertRaisesRegex(ValueError, "--threads"):
                wire.Codec("int4").encode(np.ones(4, np.float32), threads=bad)


class LayoutTest(Tmp):
    def test_safetensors_opens_every_format_and_sees_the_declared_parts(self):
        arrays = sample(np.random.default_rng(10))
        for codec in CODECS:
            with self.subTest(codec=codec):
                self.write(self.p("d"), arrays, codec)
                with safetensors.safe_open(self.p("d"), "pt") as f:
                    meta, keys = f.metadata(), set(f.keys())
                    want = {p: (d, s) for n, a in arrays.items() for p, d, s in codec.parts(n, a.shape)}
                    self.assertEqual(keys, set(want))
                    for p, (d, s) in want.items():
                        t = f.get_tensor(p)
                        self.assertEqual(tuple(t.shape), s, p)
                        self.assertEqual(t.dtype, {"F32": torch.float32, "BF16": torch.bfloat16,
                                                   "I8": torch.int8, "U8": torch.uint8}[d], p)
                if codec.fmt in ("f32", "bf16"):
                    self.assertNotIn("wire", meta)
                    continue
                self.assertEqual((meta["wire"], meta["wire_format"]), (wire.WIRE, codec.fmt))
                self.assertEqual(json.loads(meta["wire_shapes"]), {n: list(a.shape) for n, a in arrays.items()})
                self.assertIn("NAME#scale", meta["wire_parts"])

    def test_int8_codes_keep_the_tensor_shape(self):
        x = np.full((4, 300), 127 / 128, np.float32)       # scale 1/128 exactly: codes 127
        self.write(self.p("d"), {"w": x}, wire.Codec("int8", block=128))
        raw = safetensors.torch.load_file(self.p("d"))
        self.assertEqual(tuple(raw["w"].shape), (4, 300))
        self.assertEqual(tuple(raw["w#scale"].shape), (4, 3))
        self.assertTrue(torch.equal(raw["w"], torch.full((4, 300), 127, dtype=torch.int8)))
        self.assertTrue(torch.equal(raw["w#scale"].float(), torch.full((4, 3), 1 / 128)))


class HostileTest(Tmp):
    """Files that must be refused, each with a clear WireError naming the tensor."""

    def forge(self, codec, shapes, parts, meta_extra=None, shapes_meta=None):
        """A wire file written part by part with whatever we like in it."""
        meta = {**codec.metadata(), "wire_shapes": json.dumps(shapes_meta or shapes), **(meta_extra or {})}
        specs = [(n, {np.dtype("i1"): "I8", np.dtype("u1"): "U8", np.dtype("<u2"): "BF16",
                      np.dtype("<f4"): "F32"}[a.dtype], a.shape) for n, a in parts.items()]
        with tensorio.TensorWriter(self.p("bad"), specs, meta) as w:
            for n, a in parts.items():
                w.write(n, a)
        return self.p("bad")

    def good_parts(self, codec, x):
        parts, _ = codec.encode(x)
        return {"w" + s: a for s, a in parts.items()}

    def assert_refused(self, path, *words):
        with self.assertRaises(wire.WireError) as cm:
            with wire.WireReader(path) as r:
                for n in r.names:
                    r.read(n)
        for w in words:
            self.assertIn(w, str(cm.exception))
        return str(cm.exception)

    def test_bad_scales(self):
        x = np.random.default_rng(11).standard_normal((2, 200)).astype(np.float32)
        for codec in (wire.Codec("int8"), wire.Codec("int4"), wire.Codec("topk", topk_chunk=64, topk_k=8)):
            for bad, what in ((0x7FC0, "NaN"), (0x7F80, "Inf"), (0xBF80, "negative")):
                with self.subTest(codec=codec.fmt, scale=what):
                    parts = self.good_parts(codec, x)
                    parts["w#scale"] = parts["w#scale"].copy()
                    parts["w#scale"].reshape(-1)[0] = bad
                    self.assert_refused(self.forge(codec, {"w": [2, 200]}, parts), "'w'", "scale")

    def test_wrong_sizes_missing_and_extra_parts(self):
        codec = wire.Codec("int4")
        x = np.random.default_rng(12).standard_normal((3, 7)).astype(np.float32)
        parts = self.good_parts(codec, x)
        short = dict(parts, w=parts["w"][:-1])
        self.assert_refused(self.forge(codec, {"w": [3, 7]}, short), "'w'", "wrong size", "U8[11]")
        self.assert_refused(self.forge(codec, {"w": [3, 7]}, {"w": parts["w"]}), "w#scale")
        self.assert_refused(self.forge(codec, {"w": [3, 7]}, dict(parts, extra=parts["w"])), "extra")
        self.assert_refused(self.forge(codec, {"w": [3, 7]}, parts, shapes_meta={"w": [3, 8]}), "'w'")

    def test_codes_outside_the_symmetric_range(self):
        x = np.random.default_rng(13).standard_normal((2, 64)).astype(np.float32)
        codec = wire.Codec("int8", block=64)
        parts = self.good_parts(codec, x)
        parts["w"] = parts["w"].copy()
        parts["w"][1, 5] = -128
        self.assert_refused(self.forge(codec, {"w": [2, 64]}, parts), "'w'", "-128")
        codec = wire.Codec("int4", block=64)
        parts = self.good_parts(codec, x)
        parts["w"] = parts["w"].copy()
        parts["w"][3] &= np.uint8(0xF0)
        self.assert_refused(self.forge(codec, {"w": [2, 64]}, parts), "'w'", "code 0")

    def test_nonzero_padding_bits(self):
        x = np.random.default_rng(14).standard_normal(7).astype(np.float32)    # odd: a padding nibble
        codec = wire.Codec("int4", block=64)
        parts = self.good_parts(codec, x)
        parts["w"] = parts["w"].copy()
        parts["w"][-1] |= np.uint8(0x90)
        self.assert_refused(self.forge(codec, {"w": [7]}, parts), "'w'", "padding")
        codec = wire.Codec("int2", block=64)                                  # 7 values: 2 padding bits
        parts = self.good_parts(codec, x)
        parts["w"] = parts["w"].copy()
        parts["w"][-1] |= np.uint8(0x40)
        self.assert_refused(self.forge(codec, {"w": [7]}, parts), "'w'", "padding")

    def test_topk_positions_outside_the_chunk_repeated_or_unsorted(self):
        codec = wire.Codec("topk", topk_chunk=100, topk_k=4)
        x = np.random.default_rng(15).standard_normal(150).astype(np.float32)     # chunks of 100 and 50
        good = self.good_parts(codec, x)
        pos = wire.unpack_bits(good["w#idx"], codec.index_bits, 8).astype(np.int64)
        for what, change in (("outside", lambda p: p.__setitem__(7, 60)),       # the 50-long chunk
                             ("repeated", lambda p: p.__setitem__(1, p[0])),
                             ("unsorted", lambda p: p.__setitem__(slice(0, 2), p[1::-1]))):
            with self.subTest(what):
                p = pos.copy()
                change(p)
                parts = dict(good, **{"w#idx": wire.pack_bits(p, codec.index_bits)})
                self.assert_refused(self.forge(codec, {"w": [150]}, parts), "'w'", "position")

    def test_bad_metadata(self):
        codec = wire.Codec("int8")
        parts = self.good_parts(codec, np.ones((2, 3), np.float32))
        self.assert_refused(self.forge(codec, {"w": [2, 3]}, parts, {"wire_format": "int3"}), "int3")
        self.assert_refused(self.forge(codec, {"w": [2, 3]}, parts, {"wire": "pww-wire/9"}), "update")
        self.assert_refused(self.forge(codec, {"w": [2, 3]}, parts, {"wire_block": "512"}), "--wire-block")
        self.assert_refused(self.forge(codec, {"w": [2, 3]}, parts, {"wire_shapes": "[1"}), "wire_shapes")
        with tensorio.TensorWriter(self.p("ints"), [("w", "I32", (2,))]) as w:
            w.write("w", np.zeros(2, np.int32))
        self.assert_refused(self.p("ints"), "'w'", "float")
        with open(self.p("junk"), "wb") as f:
            f.write(b"\x00" * 3)
        self.assert_refused(self.p("junk"), "junk")

    def test_decode_file_leaves_nothing_behind_a_refusal(self):
        codec = wire.Codec("int8")
        parts = self.good_parts(codec, np.ones((2, 3), np.float32))
        parts["w#scale"] = np.full_like(parts["w#scale"], 0x7FC0)
        bad = self.forge(codec, {"w": [2, 3]}, parts)
        with self.assertRaises(wire.WireError):
            wire.decode_file(bad, self.p("out"))
        self.assertEqual(sorted(os.listdir(self.dir)), ["bad"])

    def test_overflowing_products_decode_to_inf_for_the_finiteness_check(self):
        """A finite scale times a code may still overflow float32: decoding does not hide it
        (the aggregator's finiteness check runs on the decoded values and refuses it)."""
        codec = wire.Codec("int8", block=64)
        parts = self.good_parts(codec, np.ones((1, 64), np.float32))
        parts["w#scale"] = np.full_like(parts["w#scale"], 0x7F7F)       # the largest finite bf16
        with wire.WireReader(self.forge(codec, {"w": [1, 64]}, parts)) as r:
            self.assertFalse(np.isfinite(r.read("w")).all())


class AggregatorTest(Tmp):
    """fedmom_state accepts compressed deltas: decoded one tensor at a time at acceptance,
    checked (names, shapes, finiteness), spooled compressed and merged as the decoded values."""
    SHAPES = {"embed": (300, 1000), "layer.w": (64, 48), "layer.b": (48,), "norm": (7,)}

    def setUp(self):
        super().setUp()
        rng = np.random.default_rng(20)
        self.theta0 = {k: rng.standard_normal(s).astype(np.float32) for k, s in self.SHAPES.items()}
        init = self.p("init.safetensors")
        with tensorio.TensorWriter(init, [(k, "F32", s) for k, s in self.SHAPES.items()]) as w:
            for k, a in self.theta0.items():
                w.write(k, a)
        cfg = fedmom_state.ServerConfig(self.p("st"), init=init, outer_lr=1.0, outer_momentum=0.0)
        self.st = fedmom_state.FedMomState(cfg.validate(), clock=lambda: 1000.0)
        self.rng = rng

    def send(self, cluster, path, tokens=10):
        st = self.st
        m = st.check_delta_meta({"cluster": cluster, "incarnation": f"{cluster}-inc", "tokens": tokens,
                                 "base_round": st.round})
        part = st.spool.part()
        shutil.copyfile(path, part)
        return st.accept_delta(m, part)

    def spool(self):
        return sorted(os.listdir(self.st.spool.dir))

    def test_compressed_deltas_merge_as_their_decoded_values(self):
        sent = {}
        for c, codec in (("lumi", wire.Codec("int4", block=64)), ("snellius", wire.Codec("topk"))):
            self.st.join(c, f"{c}-inc")
            d = {k: (0.01 * self.rng.standard_normal(s)).astype(np.float32) for k, s in self.SHAPES.items()}
            sent[c] = self.write(self.p(c), d, codec, {"base_round": "0"})
            self.assertTrue(self.send(c, self.p(c))["accepted"])
        spooled = [f for f in self.spool() if f.endswith(".safetensors")]
        self.assertEqual(len(spooled), 2)
        self.assertFalse([f for f in self.spool() if f.startswith(".part")])
        for f in spooled:                               # the spool holds the compressed files as they came
            self.assertTrue(wire.is_wire(os.path.join(self.st.spool.dir, f)))
        self.assertEqual(sorted(os.path.getsize(os.path.join(self.st.spool.dir, f)) for f in spooled),
                         sorted(os.path.getsize(self.p(c)) for c in ("lumi", "snellius")))
        rec = self.st.tick()
        self.assertEqual(rec["round"], 1)
        with tensorio.TensorReader(os.path.join(self.st.dir, self.st.theta_file)) as r:
            for k in self.SHAPES:
                want = self.theta0[k] + (sent["lumi"][k] * np.float32(0.5) + sent["snellius"][k] * np.float32(0.5))
                np.testing.assert_allclose(r.read(k), want, rtol=0, atol=1e-6, err_msg=k)
        self.assertEqual(len(self.spool()), 4, "kept, logged: a restart replays round 1 from them")
        self.assertEqual(self.st.checkpoint(force=True), 1)
        self.assertEqual(self.spool(), [], "a checkpoint of round 1 covers them")

    def test_hostile_compressed_deltas_are_refused_and_nothing_is_stored(self):
        self.st.join("lumi", "lumi-inc")
        before = sorted(os.listdir(self.st.dir)), self.spool()
        codec = wire.Codec("int8", block=64)
        d = {k: np.ones(s, np.float32) for k, s in self.SHAPES.items()}
        self.write(self.p("good"), d, codec)
        cases = []
        with tensorio.TensorReader(self.p("good")) as r:
            raw = {n: r.read(n) for n in r.names}
            meta = dict(r.metadata)
            specs = [(n, r.specs[n][0], r.specs[n][1]) for n in r.names]

        def forge(name, change, meta_change=None):
            parts = {n: a.copy() for n, a in raw.items()}
            change(parts)
            with tensorio.TensorWriter(self.p(name), specs, {**meta, **(meta_change or {})}) as w:
                for n, _, _ in specs:
                    w.write(n, parts[n])
            return self.p(name)

        cases.append(("nan scale", forge("nan", lambda p: p["layer.w#scale"].fill(0x7FC0)), 400, "scale"))
        cases.append(("overflow", forge("inf", lambda p: p["layer.w#scale"].fill(0x7F7F)), 422, "NaN or Inf"))
        shapes = json.loads(meta["wire_shapes"])
        shapes["norm"] = [8]
        cases.append(("wrong shape", forge("shape", lambda p: None, {"wire_shapes": json.dumps(shapes)}),
                      400, "'norm'"))
        for what, path, status, words in cases:
            with self.subTest(what), self.assertRaises(fedmom_round.Refused) as cm:
                self.send("lumi", path)
            self.assertEqual(cm.exception.status, status, cm.exception.reason)
            self.assertIn(words, cm.exception.reason)
            self.assertNotIn(self.st.spool.dir, cm.exception.reason)
        self.assertEqual((sorted(os.listdir(self.st.dir)), self.spool()), before)
        self.assertIsNone(self.st.tick())


class ResidualTest(Tmp):
    """error_feedback.Residual, the site's error-feedback buffer: each rule of its docstring."""
    SHAPES = [("w", (3, 70)), ("b", (5,))]

    def setUp(self):
        super().setUp()
        self.said = []
        self.rng = np.random.default_rng(30)

    def residual(self, fresh=False, decay=1.0):
        import error_feedback
        return error_feedback.Residual(self.dir, self.said.append, fresh, decay=decay)

    def send(self, res, base_round, codec=wire.Codec("int4", block=64)):
        """One delta through the buffer as FedMomCarrier.write_delta does: -> (x sent, residual left)."""
        fb = res.begin(self.SHAPES, base_round)
        xs, left = {}, {}
        with wire.WireWriter(self.p("delta"), self.SHAPES, codec) as w:
            for n, s in self.SHAPES:
                d = (0.01 * self.rng.standard_normal(s)).astype(np.float32)
                xs[n] = fb.add_owed(n, d)
                sent = w.write(n, xs[n])
                fb.keep(n, xs[n], sent)
                left[n] = xs[n] - sent
                owed = self.owed().get(n, np.zeros(s, np.float32))
                want = d + (owed if res.decay == 1 else owed * np.float32(res.decay))
                np.testing.assert_array_equal(xs[n], want)
        fb.close()
        return xs, left

    def owed(self):
        path = self.p("residual.safetensors")
        if not os.path.exists(path):
            return {}
        with tensorio.TensorReader(path) as r:
            return {n: r.read(n) for n in r.names}

    def test_merged_then_owed_then_added_to_the_next_delta(self):
        res = self.residual()
        _, left = self.send(res, 0)
        self.assertEqual(self.owed(), {})                     # in flight: nothing owed yet
        res.settle(0, 1, "")
        for n, a in left.items():
            np.testing.assert_array_equal(self.owed()[n], a)
        self.assertGreater(res.sq, 0)
        res.check(1, dict(self.SHAPES))
        self.send(res, 1)                                     # asserts x = delta + owed, per tensor
        self.assertIn("carries the residual left by the merged delta of round 0", self.said[0])

    def test_what_is_sent_over_rounds_tracks_the_deltas_to_within_the_last_residual(self):
        """The point of error feedback: sum(sent) = sum(deltas) - what is owed now, so the
        aggregator's drift from the exact sum stays bounded; without it, it accumulates."""
        for codec in (wire.Codec("int4", block=64), wire.Codec("topk", topk_chunk=70, topk_k=7)):
            with self.subTest(codec.fmt):
                for f in os.listdir(self.dir):
                    os.unlink(self.p(f))
                res, rng = self.residual(), np.random.default_rng(31)
                bias = rng.standard_normal((3, 70)).astype(np.float32)       # a direction kept every round
                total = {"d": 0, "ef": 0, "plain": 0}
                for rnd in range(30):
                    d = (0.01 * (bias + rng.standard_normal((3, 70)))).astype(np.float32)
                    fb = res.begin([("w", (3, 70))], rnd)
                    x = fb.add_owed("w", d)
                    sent = codec.encode(x)[1]
                    fb.keep("w", x, sent)
                    fb.close()
                    res.settle(rnd, rnd + 1, "")
                    total["d"] = total["d"] + d.astype(np.float64)
                    total["ef"] = total["ef"] + sent.astype(np.float64)
                    total["plain"] = total["plain"] + codec.encode(d)[1].astype(np.float64)
                owed = self.owed()["w"].astype(np.float64)
                drift_ef = np.linalg.norm(total["d"] - total["ef"])
                self.assertLess(abs(drift_ef - np.linalg.norm(owed)), 1e-4)          # exactly what is owed
                self.assertLess(np.linalg.norm(total["d"] - total["ef"] - owed), 1e-4)
                self.assertLess(drift_ef, 0.5 * np.linalg.norm(total["d"] - total["plain"]))

    def test_a_decayed_residual_is_carried_times_beta_and_kept_whole_across_a_restart(self):
        # --wire-feedback-decay 0.5 with SparseLoCo's 2-bit topk: the next delta carries
        # 0.5 x what the last one left (send() asserts it, tensor by tensor); the file keeps
        # the residual itself, so a new job (a restart) finds it and decays it once, when used
        codec = wire.Codec("topk", topk_chunk=64, topk_k=4, topk_bits=2)
        res = self.residual(decay=0.5)
        _, left = self.send(res, 0, codec)
        res.settle(0, 1, "")
        again = self.residual(decay=0.5)                 # a requeued job
        again.check(1, dict(self.SHAPES))
        for n, a in left.items():
            np.testing.assert_array_equal(self.owed()[n], a)
        self.send(again, 1, codec)                       # asserts x = delta + 0.5 x owed

    def test_a_delta_not_merged_leaves_what_was_owed_owed(self):
        res = self.residual()
        self.send(res, 0)
        res.settle(0, 1, "")
        before = self.owed()
        self.send(res, 1)
        res.settle(1, None, "stale: the server is at round 2")
        self.assertEqual({n: a.tobytes() for n, a in self.owed().items()}, {n: a.tobytes() for n, a in before.items()})
        self.assertFalse(os.path.exists(self.p("residual-next.safetensors")))

    def test_unknown_outcome_and_a_restart_mid_flight_reset_and_say_so(self):
        res = self.residual()
        self.send(res, 0)
        res.settle(0, 1, "")
        self.send(res, 1)
        res.settle(1, None, "outcome unknown: lease left to the aggregator")
        self.assertEqual(self.owed(), {})
        self.assertIn("may still be merged", self.said[-1])
        res = self.residual()
        self.send(res, 2)
        res.settle(2, 3, "")
        self.send(res, 3)                                    # then the job dies before the outcome
        res2 = self.residual()
        self.assertEqual(self.owed(), {})
        self.assertIn("may or may not have been merged", self.said[-1])
        self.assertFalse(os.path.exists(self.p("residual-next.safetensors")))
        res2.check(4, dict(self.SHAPES))

    def test_a_new_aggregator_state_other_shapes_or_a_new_run_reset(self):
        for why, act in (("new aggregator state", lambda r: r.check(3, dict(self.SHAPES))),
                         ("names or shapes", lambda r: r.check(9, {"w": (3, 70), "b": (6,)})),
                         (None, lambda r: self.residual(fresh=True))):
            with self.subTest(why):
                res = self.residual()
                self.send(res, 3)
                res.settle(3, 4, "")
                res.check(4, dict(self.SHAPES))
                self.assertTrue(self.owed())
                act(res)
                self.assertEqual(self.owed(), {})
                if why:
                    self.assertIn(why, self.said[-1])


class DownstreamTest(Tmp):
    """fedmom_merge.publish (the aggregator) and wire.apply_update (a site): the same theta,
    bit for bit, and the aggregator's error feedback carries what each update dropped."""

    def steps(self, rng, theta0, rounds):
        """A trajectory of merged thetas: each round's merge is prev + a random step."""
        return [{n: (rng.standard_normal(a.shape) * np.float32(0.01) * (1 + np.abs(a))).astype(np.float32)
                 for n, a in theta0.items()} for _ in range(rounds)]

    def run_rounds(self, codec, rounds=4, seed=20):
        rng = np.random.default_rng(seed)
        theta0 = sample(rng)
        self.write_all(self.p("theta-0"), theta0, {n: "F32" for n in theta0}, {"round": "0"})
        self.write_all(self.p("site"), theta0, {n: "F32" for n in theta0}, {"round": "0"})
        exact, owed, outs = {n: a.astype(np.float64) for n, a in theta0.items()}, None, []
        for r, step in enumerate(self.steps(rng, theta0, rounds)):
            prev = self.read_all(self.p(f"theta-{r}"))
            self.write_all(self.p("merged"), {n: prev[n] + step[n] for n in prev}, {n: "F32" for n in prev})
            out = fedmom_merge.publish(self.p(f"theta-{r}"), self.p("merged"), owed, codec, self.p(f"theta-{r + 1}"),
                                       self.p(f"update-{r + 1}"), self.p(f"residual-{r + 1}"),
                                       {"round": str(r + 1)}, fsync=False)
            self.assertEqual(out["base_digest"], wire.theta_digest(self.p(f"theta-{r}")))
            got = wire.apply_update(self.p("site"), self.p(f"update-{r + 1}"), self.p("site"), out["digest"],
                                    {"round": str(r + 1)}, fsync=False)
            self.assertEqual(got, out["digest"])
            server, site = self.read_all(self.p(f"theta-{r + 1}")), self.read_all(self.p("site"))
            for n in server:          # bit for bit
                self.assertTrue(np.array_equal(server[n].view(np.uint32), site[n].view(np.uint32)), (codec.fmt, r, n))
            for n in exact:
                exact[n] += step[n]
            owed = self.p(f"residual-{r + 1}")
            outs.append(out)
        return exact, server, self.read_all(owed), outs

    def bytes_of(self, path):
        with open(path, "rb") as f:
            return f.read()

    def read_all(self, path):
        with tensorio.TensorReader(path) as r:
            return {n: np.asarray(r.read(n, as_float32=True), np.float32).reshape(r.specs[n][1]).copy()
                    for n in r.names}

    def test_site_and_aggregator_hold_the_same_bits_in_every_format(self):
        for codec in CODECS:
            with self.subTest(codec=codec.fmt, block=codec.block, k=codec.topk_k):
                self.run_rounds(codec, rounds=3)

    def test_error_feedback_delays_what_an_update_drops_and_loses_nothing(self):
        # theta_R + residual_R = theta_0 + the sum of every round's step (float rounding aside):
        # what the updates rounded away is owed, not lost; without the residual the gap is the
        # residual itself, which for topk is most of each step
        for codec in (wire.Codec("int4"), wire.Codec("int2"), wire.Codec("topk"),
                      wire.Codec("topk", topk_bits=2)):
            with self.subTest(codec=codec.fmt, bits=codec.topk_bits):
                exact, theta, res, outs = self.run_rounds(codec, rounds=5)
                for n in exact:
                    scale = float(np.abs(exact[n]).max(initial=0)) + 1e-30
                    gap = np.abs(theta[n].astype(np.float64) + res[n] - exact[n]).max(initial=0)
                    self.assertLess(gap / scale, 1e-5, n)
                self.assertGreater(outs[-1]["residual_norm"], 0)

    def test_an_update_that_does_not_give_the_published_digest_changes_nothing(self):
        rng = np.random.default_rng(21)
        theta0 = sample(rng)
        self.write_all(self.p("site"), theta0, {n: "F32" for n in theta0}, {"round": "0"})
        self.write(self.p("upd"), {n: a * np.float32(0.01) for n, a in theta0.items()}, wire.Codec("int8"))
        before = self.bytes_of(self.p("site"))
        with self.assertRaisesRegex(wire.WireError, "not the theta it built"):
            wire.apply_update(self.p("site"), self.p("upd"), self.p("site"), "0" * 64, {"round": "1"}, fsync=False)
        self.assertEqual(self.bytes_of(self.p("site")), before)
        self.assert_no_leftovers(keep=("site", "upd"))


class CommandLineTest(Tmp):
    def test_describe_check_and_a_clear_error(self):
        self.write(self.p("d"), sample(np.random.default_rng(16)), wire.Codec("topk"))
        out = subprocess.run([sys.executable, "wire.py", self.p("d"), "--check"], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertIn("wire format topk", out.stdout)
        self.assertIn("layers.0.w  [7, 301]", out.stdout)
        with open(self.p("bad"), "wb") as f:
            f.write(b"junk")
        out = subprocess.run([sys.executable, "wire.py", self.p("bad")], cwd=ROOT,
                             capture_output=True, text=True, timeout=120)
        self.assertEqual(out.returncode, 1)
        self.assertIn("bad", out.stderr)
        self.assertNotIn("Traceback", out.stderr)

    def test_imports_without_torch(self):
        code = ("import sys; sys.modules['torch'] = None\n"
                "import wire, numpy as np\n"
                "print(wire.Codec('int4').encode(np.full((2, 70), 0.875, np.float32))[1].sum())\n")
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(float(out.stdout), 122.5)     # scale 0.125 exactly, codes 7


if __name__ == "__main__":
    unittest.main()
