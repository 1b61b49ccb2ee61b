"""tensorio: the safetensors layout both ways, bfloat16 bits against torch, and damaged files."""
import json
import os
import pathlib
import struct
import subprocess
import sys
import unittest

import numpy as np
import safetensors.numpy
import safetensors.torch
import torch

import fixtures
import tensorio

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sample_arrays(rng):
    """One array per dtype, including a scalar and an empty tensor."""
    return {
        "embed.weight": rng.standard_normal((7, 5)).astype(np.float32),
        "half": rng.standard_normal((3, 4)).astype(np.float16),
        "bf": tensorio.f32_to_bf16(rng.standard_normal((2, 3, 4)).astype(np.float32)),
        "double": rng.standard_normal(6),
        "steps": np.array(12345678901, dtype=np.int64),
        "i32": rng.integers(-2**31, 2**31, size=9, dtype=np.int32),
        "i16": rng.integers(-2**15, 2**15, size=4, dtype=np.int16),
        "i8": rng.integers(-128, 128, size=(2, 2), dtype=np.int8),
        "u8": rng.integers(0, 256, size=11, dtype=np.uint8),
        "mask": rng.random(5) > 0.5,
        "empty": np.zeros((0, 3), dtype=np.float32),
    }


DTYPE_OF = {"embed.weight": "F32", "half": "F16", "bf": "BF16", "double": "F64", "steps": "I64",
            "i32": "I32", "i16": "I16", "i8": "I8", "u8": "U8", "mask": "BOOL", "empty": "F32"}


class TensorFileTest(fixtures.TmpDirTest):
    def write_all(self, path, arrays, dtypes=DTYPE_OF, metadata=None):
        super().write_all(path, arrays, dtypes, metadata)


class RoundTripTest(TensorFileTest):
    def test_every_dtype_round_trips_with_metadata_and_file_order(self):
        arrays = sample_arrays(np.random.default_rng(0))
        self.write_all(self.p("a.safetensors"), arrays, metadata={"round": "4", "producer": "test"})
        with tensorio.TensorReader(self.p("a.safetensors")) as r:
            self.assertEqual(r.names, list(arrays))
            self.assertEqual(r.metadata, {"round": "4", "producer": "test", "format": "pww-tensors/1"})
            for n, a in arrays.items():
                got = r.read(n)
                self.assertEqual(r.specs[n], (DTYPE_OF[n], a.shape))
                self.assertEqual(got.shape, a.shape)
                self.assertEqual(got.tobytes(), a.tobytes(), n)
                self.assertEqual(r.nbytes(n), a.nbytes)
            np.testing.assert_array_equal(r.read("bf", as_float32=True), tensorio.bf16_to_f32(arrays["bf"]))
        self.assert_no_leftovers(keep=["a.safetensors"])

    def test_header_is_padded_to_eight_and_data_is_contiguous_in_header_order(self):
        arrays = sample_arrays(np.random.default_rng(1))
        self.write_all(self.p("a"), arrays)
        with open(self.p("a"), "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
            data = f.read()
        self.assertEqual(n % 8, 0)
        self.assertEqual(list(header)[0], "__metadata__")
        pos = 0
        for name, a in arrays.items():
            begin, end = header[name]["data_offsets"]
            self.assertEqual(begin, pos)
            self.assertEqual(data[begin:end], a.tobytes())
            pos = end
        self.assertEqual(pos, len(data))

    def test_safetensors_package_reads_our_files(self):
        arrays = sample_arrays(np.random.default_rng(2))
        self.write_all(self.p("ours"), arrays, metadata={"round": "9"})
        plain = {n: a for n, a in arrays.items() if n != "bf"}
        got = safetensors.torch.load_file(self.p("ours"))
        for n, a in plain.items():
            np.testing.assert_array_equal(got[n].numpy(), a, err_msg=n)
        self.assertEqual(got["bf"].dtype, torch.bfloat16)
        self.assertEqual(got["bf"].view(torch.int16).numpy().view(np.uint16).tobytes(), arrays["bf"].tobytes())
        with safetensors.safe_open(self.p("ours"), "np") as f:
            self.assertEqual(f.metadata(), {"round": "9", "format": "pww-tensors/1", "producer": "tensorio"})

    def test_we_read_files_written_by_the_safetensors_package(self):
        rng = np.random.default_rng(3)
        state = {"b": torch.randn(4, 3, dtype=torch.bfloat16), "a": torch.randn(5),
                 "h": torch.randn(2, 2).half(), "n": torch.arange(6, dtype=torch.int64).reshape(2, 3),
                 "u": torch.tensor([1, 2, 255], dtype=torch.uint8), "z": torch.tensor([True, False])}
        safetensors.torch.save_file(state, self.p("theirs"), metadata={"source": "hf"})
        with tensorio.TensorReader(self.p("theirs")) as r:
            self.assertEqual(sorted(r.names), sorted(state))
            self.assertEqual(r.metadata, {"source": "hf"})
            for n, t in state.items():
                got = tensorio._numpy_to_torch(r.read(n), r.specs[n][0], "cpu")
                self.assertTrue(torch.equal(got, t), n)
        arrays = {"x": rng.standard_normal((3, 3)).astype(np.float32), "i": np.arange(4, dtype=np.int32)}
        safetensors.numpy.save_file(arrays, self.p("np"))
        with tensorio.TensorReader(self.p("np")) as r:
            for n, a in arrays.items():
                np.testing.assert_array_equal(r.read(n), a)

    def test_float_inputs_are_converted_in_slices(self):
        old = tensorio.CONVERT_CHUNK
        tensorio.CONVERT_CHUNK = 1000          # three slices for 2,500 values
        self.addCleanup(setattr, tensorio, "CONVERT_CHUNK", old)
        x = np.random.default_rng(4).standard_normal(2500).astype(np.float32)
        specs = [("bf", "BF16", (50, 50)), ("h", "F16", (2500,)), ("f", "F32", (2500,))]
        writes = {}
        with tensorio.TensorWriter(self.p("c"), specs) as w:
            w._f = _RecordingFile(w._f)                 # the header is written: record the data writes
            for name, a in (("bf", x.reshape(50, 50)), ("h", x.astype(np.float64)), ("f", x)):
                w._f.sizes = []
                w.write(name, a)
                writes[name] = w._f.sizes
        # a narrowing write goes out 1,000 converted values at a time; an unconverted one at once
        self.assertEqual(writes, {"bf": [2000, 2000, 1000], "h": [2000, 2000, 1000], "f": [10000]})
        with tensorio.TensorReader(self.p("c")) as r:
            np.testing.assert_array_equal(r.read("bf").reshape(-1), tensorio.f32_to_bf16(x))
            np.testing.assert_array_equal(r.read("h"), x.astype(np.float16))
            np.testing.assert_array_equal(r.read("f"), x)


class _RecordingFile:
    """A file object that records the byte count of each write() and passes everything on."""

    def __init__(self, f):
        self.f, self.sizes = f, []

    def write(self, data):
        self.sizes.append(memoryview(data).nbytes)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)


class BFloat16Test(unittest.TestCase):
    def test_rounding_matches_torch_bit_for_bit(self):
        rng = np.random.default_rng(5)
        bits = rng.integers(0, 2**32, size=200_000, dtype=np.uint64).astype(np.uint32)
        specials = np.array([0x00000000, 0x80000000, 0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F807FFF,
                             0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x00000001, 0x00008000, 0x00018000,
                             0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x7F800001], dtype=np.uint32)
        x = np.concatenate([bits, specials]).view(np.float32)
        ours = tensorio.f32_to_bf16(x)
        theirs = torch.from_numpy(x.copy()).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
        nan = np.isnan(x)
        self.assertTrue(nan.any())
        np.testing.assert_array_equal(ours[~nan], theirs[~nan])
        self.assertTrue(np.isnan(tensorio.bf16_to_f32(ours[nan])).all())
        self.assertEqual(list(tensorio.bf16_to_f32(tensorio.f32_to_bf16(
            np.array([np.inf, -np.inf], np.float32)))), [np.inf, -np.inf])

    def test_widening_matches_torch(self):
        u = np.arange(0, 2**16, dtype=np.uint32).astype(np.uint16)
        ours = tensorio.bf16_to_f32(u)
        theirs = torch.from_numpy(u.view(np.int16).copy()).view(torch.bfloat16).float().numpy()
        self.assertEqual(ours.dtype, np.float32)
        np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32))


class WriterRefusesTest(TensorFileTest):
    SPECS = [("a", "F32", (2, 3)), ("b", "I32", (4,))]

    def test_wrong_order_size_dtype_and_count(self):
        w = tensorio.TensorWriter(self.p("w"), self.SPECS)
        self.addCleanup(w.abort)
        with self.assertRaisesRegex(ValueError, "expected 'a' next"):
            w.write("b", np.zeros(4, np.int32))
        with self.assertRaisesRegex(ValueError, r"shape \(3, 2\)"):
            w.write("a", np.zeros((3, 2), np.float32))
        with self.assertRaisesRegex(ValueError, "shape"):
            w.write("a", np.zeros(7, np.float32))
        w.write("a", np.zeros(6, np.float32))                      # flat with the right size is fine
        with self.assertRaisesRegex(ValueError, "int64.*I32"):
            w.write("b", np.zeros(4, np.int64))
        with self.assertRaisesRegex(ValueError, "float32.*I32"):
            w.write("b", np.zeros(4, np.float32))
        w.write("b", np.zeros(4, np.int32))
        with self.assertRaisesRegex(ValueError, "one too many"):
            w.write("c", np.zeros(1, np.int32))

    def test_bad_specs_and_metadata(self):
        cases = [([("a", "F17", (1,))], None, "unknown dtype"), ([("a", "F32", (-1,))], None, "shape"),
                 ([("a", "F32", (1,)), ("a", "F32", (1,))], None, "duplicate"),
                 ([("__metadata__", "F32", (1,))], None, "name"), ([("a", "F32", (1,))], {"round": 3}, "strings")]
        for specs, meta, msg in cases:
            with self.assertRaisesRegex(ValueError, msg):
                tensorio.TensorWriter(self.p("w"), specs, meta)
        self.assert_no_leftovers()

    def test_an_unfinished_write_leaves_the_old_file_untouched(self):
        old = {"a": np.ones((2, 3), np.float32), "b": np.arange(4, dtype=np.int32)}
        self.write_all(self.p("f"), old, {"a": "F32", "b": "I32"})
        before = pathlib.Path(self.p("f")).read_bytes()
        with self.assertRaisesRegex(RuntimeError, "crash"):
            with tensorio.TensorWriter(self.p("f"), self.SPECS) as w:
                w.write("a", np.zeros((2, 3), np.float32))
                raise RuntimeError("crash")
        w = tensorio.TensorWriter(self.p("f"), self.SPECS)
        w.write("a", np.zeros((2, 3), np.float32))
        with self.assertRaisesRegex(ValueError, r"1 of 2 tensors; missing \['b'\]"):
            w.close()
        self.assertEqual(pathlib.Path(self.p("f")).read_bytes(), before)
        self.assert_no_leftovers(keep=["f"])


class DamagedFileTest(TensorFileTest):
    def setUp(self):
        super().setUp()
        self.arrays = {"a": np.arange(10, dtype=np.float32), "b": np.arange(6, dtype=np.int64)}
        self.write_all(self.p("good"), self.arrays, {"a": "F32", "b": "I64"})
        self.raw = pathlib.Path(self.p("good")).read_bytes()
        (n,) = struct.unpack("<Q", self.raw[:8])
        self.header = json.loads(self.raw[8:8 + n])
        self.data = self.raw[8 + n:]

    def forge(self, header=None, data=None, raw_header=None):
        hb = raw_header if raw_header is not None else json.dumps(header or self.header).encode()
        path = self.p("bad")
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(hb)) + hb + (self.data if data is None else data))
        return path

    def assert_rejected(self, path, msg):
        with self.assertRaises(tensorio.FormatError) as cm:
            tensorio.TensorReader(path)
        self.assertIn(path, str(cm.exception))
        self.assertRegex(str(cm.exception), msg)

    def entry(self, name, **kw):
        h = json.loads(json.dumps(self.header))
        h[name].update(kw)
        return h

    def test_truncation_anywhere_is_rejected(self):
        for cut in (0, 5, 8, 20, len(self.raw) - len(self.data) + 3, len(self.raw) - 1):
            with open(self.p("cut"), "wb") as f:
                f.write(self.raw[:cut])
            self.assert_rejected(self.p("cut"), "bytes|runs past|truncated")

    def test_garbled_headers_are_rejected_with_the_reason(self):
        with open(self.p("huge"), "wb") as f:
            f.write(struct.pack("<Q", 2**40) + b"{}")
        self.assert_rejected(self.p("huge"), "absurd")
        self.assert_rejected(self.forge(raw_header=b'{"a": {"dtype": "F32",'), "not valid JSON")
        self.assert_rejected(self.forge(raw_header=b"\xff\xfe{}"), "not valid JSON")
        self.assert_rejected(self.forge(raw_header=b"[1, 2]"), "not a JSON object")
        self.assert_rejected(self.forge(self.entry("b", data_offsets=[30, 78])), "overlaps")
        self.assert_rejected(self.forge(self.entry("b", data_offsets=[48, 96])), "truncated")
        self.assert_rejected(self.forge(self.entry("b", data_offsets=[40, 80])), "hold 40 bytes")
        self.assert_rejected(self.forge(self.entry("b", data_offsets=[60, 40])), "bad data_offsets")
        self.assert_rejected(self.forge(self.entry("b", dtype="Q8")), "unknown dtype")
        self.assert_rejected(self.forge(self.entry("b", shape=[2, -3])), "bad shape")
        self.assert_rejected(self.forge(self.entry("b", shape=[2, "3"])), "bad shape")
        h = json.loads(json.dumps(self.header))
        h["__metadata__"]["format"] = "pww-tensors/2"
        self.assert_rejected(self.forge(h), "pww-tensors/2.*update")
        h["__metadata__"] = {"round": 5}
        self.assert_rejected(self.forge(h), "__metadata__")

    def test_tensors_are_read_one_at_a_time(self):
        # Cut the file inside "b" after the header was checked: "a" still reads, "b" fails alone.
        with open(self.p("live"), "wb") as f:
            f.write(self.raw)
        r = tensorio.TensorReader(self.p("live"))
        self.addCleanup(r.close)
        os.truncate(self.p("live"), len(self.raw) - 8)
        np.testing.assert_array_equal(r.read("a"), self.arrays["a"])
        with self.assertRaisesRegex(tensorio.FormatError, "ends early"):
            r.read("b")
        with self.assertRaisesRegex(KeyError, "no tensor 'c'"):
            r.read("c")

    def test_read_into_a_reused_buffer(self):
        buf = np.full(32, -1.0, dtype=np.float32)
        with tensorio.TensorReader(self.p("good")) as r:
            got = r.read("a", out=buf)
            np.testing.assert_array_equal(got, self.arrays["a"])
            self.assertTrue(np.shares_memory(got, buf))
            self.assertEqual(buf[10], -1.0)                         # only the front is written
            with self.assertRaisesRegex(ValueError, "out= for 'b'"):
                r.read("b", out=buf)
            with self.assertRaisesRegex(ValueError, "at least 10"):
                r.read("a", out=np.zeros(9, np.float32))

    def test_cli_prints_the_header_and_fails_with_one_line(self):
        ok = subprocess.run([sys.executable, os.path.join(ROOT, "tensorio.py"), self.p("good"), "--check"],
                            capture_output=True, text=True, timeout=60)
        self.assertEqual(ok.returncode, 0, ok.stderr)
        self.assertIn("a  F32[10]  40 bytes", ok.stdout)
        self.assertIn("format = pww-tensors/1", ok.stdout)
        bad = subprocess.run([sys.executable, os.path.join(ROOT, "tensorio.py"),
                              self.forge(raw_header=b"{nope")], capture_output=True, text=True, timeout=60)
        self.assertEqual(bad.returncode, 1)
        self.assertEqual(len(bad.stderr.strip().splitlines()), 1)
        self.assertIn("not valid JSON", bad.stderr)


class TorchBridgeTest(TensorFileTest):
    def state(self):
        g = torch.Generator().manual_seed(0)
        return {"w": torch.randn(8, 4, generator=g), "bf": torch.randn(3, 5, generator=g).bfloat16(),
                "step": torch.tensor(7), "mask": torch.tensor([True, False, True]),
                "t": torch.randn(4, 6, generator=g).t()}      # non-contiguous

    def test_state_dict_round_trip_and_dtype_conversion(self):
        sd = self.state()
        tensorio.save_torch(sd, self.p("sd"), metadata={"round": "2"})
        back = tensorio.load_torch(self.p("sd"))
        self.assertEqual(list(back), list(sd))
        for n in sd:
            self.assertEqual(back[n].dtype, sd[n].dtype, n)
            self.assertTrue(torch.equal(back[n], sd[n]), n)
        self.assertTrue(torch.equal(safetensors.torch.load_file(self.p("sd"))["t"], sd["t"]))
        tensorio.save_torch(sd, self.p("half"), dtype="BF16")
        half = tensorio.load_torch(self.p("half"), names=["w", "step"])
        self.assertEqual(list(half), ["w", "step"])
        self.assertEqual(half["w"].dtype, torch.bfloat16)
        self.assertTrue(torch.equal(half["w"], sd["w"].bfloat16()))
        self.assertEqual(half["step"].dtype, torch.int64)
        with self.assertRaisesRegex(ValueError, "dtype='I8'"):
            tensorio.save_torch(sd, self.p("x"), dtype="I8")

    def test_a_generator_with_specs_streams_and_iter_torch_reads_one_tensor_at_a_time(self):
        sd = self.state()
        g = torch.Generator().manual_seed(1)
        sd.update(big1=torch.randn(128, 256, generator=g), big2=torch.randn(128, 256, generator=g))   # 128 KiB each
        specs = [(n, "F32" if t.is_floating_point() else tensorio._torch_dtypes()[t.dtype], tuple(t.shape))
                 for n, t in sd.items()]
        sizes = [4 * t.numel() if t.is_floating_point() else t.element_size() * t.numel() for t in sd.values()]
        tmp = self.p("g") + f".tmp-{os.getpid()}"
        on_disk = []

        def gen():                   # before each tensor is handed over, how much of the file is written?
            for n, t in sd.items():
                if n == "big2":
                    on_disk.append(os.path.getsize(tmp))
                yield n, t
        tensorio.save_torch(gen(), self.p("g"), specs=specs)
        data_before_big2 = sum(sizes[:-1])
        self.assertEqual(len(on_disk), 1)
        # big1 (larger than any write buffer) is on disk before big2 is even asked for; big2 is not
        self.assertGreaterEqual(on_disk[0], 128 * 256 * 4)
        self.assertLess(on_disk[0], data_before_big2 + 8 + 4096)
        self.assertFalse(os.path.exists(tmp))
        names = [n for n, _ in tensorio.iter_torch(self.p("g"))]
        self.assertEqual(names, list(sd))
        for n, t in tensorio.iter_torch(self.p("g")):
            self.assertTrue(torch.equal(t, sd[n].float() if sd[n].is_floating_point() else sd[n]), n)
        # lazily: the first tensors come out of a file whose last one is cut off after the header was read
        it = tensorio.iter_torch(self.p("g"))
        self.assertEqual(next(it)[0], "w")
        os.truncate(self.p("g"), os.path.getsize(self.p("g")) - 8)
        got = []
        with self.assertRaisesRegex(tensorio.FormatError, "ends early"):
            for n, _ in it:
                got.append(n)
        self.assertEqual(got, list(sd)[1:-1])
        with self.assertRaisesRegex(ValueError, "more tensors"):
            tensorio.save_torch(list(sd.items()) + [("extra", torch.zeros(1))], self.p("h"), specs=specs)
        self.assertFalse(os.path.exists(self.p("h")))


if __name__ == "__main__":
    unittest.main()
