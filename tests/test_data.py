"""tests/test_data.py - data.py and tokenize_corpus.py on real files (CPU, no process groups).

CIFAR: the fixture writer produces the standard python-pickle layout and the reader
gets back exactly what was written; the device-side crop + flip is a real crop.
Token windows: the manifest digest is stable across runs and paths, and changes
with the tokenizer and with seq_len; windows read back are the corpus' bytes.
"""
import gzip
import hashlib
import io
import json
import os
import pathlib
import pickle
import tempfile
import unittest

import numpy as np
import torch

import data
import tokenize_corpus as tc


def _tokenize(out, inputs, **kw):
    kw.setdefault("progress", False)
    kw.setdefault("heldout_windows", 4)
    return tc.tokenize(tc.TokenizeConfig(inputs=inputs, out=out, **kw))


class CifarTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.root = data.write_fake_cifar(os.path.join(cls.tmp.name, "cifar"), n_train=103, n_test=17, seed=3)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_standard_layout_and_roundtrip(self):
        names = sorted(os.listdir(self.root))
        self.assertEqual(names, ["batches.meta", "data_batch_1", "data_batch_2", "data_batch_3",
                                 "data_batch_4", "data_batch_5", "test_batch"])
        with open(os.path.join(self.root, "data_batch_2"), "rb") as f:
            raw = pickle.load(f, encoding="bytes")      # what any CIFAR consumer would do
        self.assertEqual(raw[b"data"].dtype, np.uint8)
        self.assertEqual(raw[b"data"].shape[1], 3072)
        tx, ty, vx, vy = data.load_cifar10(self.root)
        self.assertEqual(tx.shape, (103, 3, 32, 32))
        self.assertEqual(vx.shape, (17, 3, 32, 32))
        self.assertEqual((ty.dtype, len(ty), len(vy)), (np.int64, 103, 17))
        self.assertTrue(((ty >= 0) & (ty < 10)).all())
        # batch 2 starts after batch 1's rows; channel-major rows reshape to N x 3 x 32 x 32
        n1 = len(pickle.loads(pathlib.Path(self.root, "data_batch_1").read_bytes(), encoding="bytes")[b"labels"])
        np.testing.assert_array_equal(tx[n1], raw[b"data"][0].reshape(3, 32, 32))
        self.assertEqual(int(ty[n1]), raw[b"labels"][0])

    def test_reader_refuses_code_in_a_pickle(self):
        evil = os.path.join(self.tmp.name, "evil")
        os.makedirs(evil, exist_ok=True)
        for name in data.CIFAR_TRAIN_FILES + [data.CIFAR_TEST_FILE]:
            with open(os.path.join(evil, name), "wb") as f:
                pickle.dump({b"data": os.getcwd, b"labels": []}, f, protocol=2)
        with self.assertRaisesRegex(pickle.UnpicklingError, "refusing"):
            data.load_cifar10(evil)

    def test_missing_directory_names_the_flag(self):
        with self.assertRaisesRegex(FileNotFoundError, "--data"):
            data.load_cifar10(os.path.join(self.tmp.name, "nowhere"))

    def test_augment_is_a_crop_of_the_padded_image(self):
        tx, *_ = data.load_cifar10(self.root)
        x = torch.from_numpy(tx[:6])
        g = torch.Generator().manual_seed(0)
        out = data.cifar_augment(x, g)
        plain = data.cifar_augment(x, train=False)
        self.assertEqual(out.shape, (6, 3, 32, 32))
        padded = torch.nn.functional.pad(plain, (4, 4, 4, 4), value=0.0)
        # zero padding in [0,1] space is -mean/std after normalisation
        mean = torch.tensor(data.CIFAR_MEAN).view(3, 1, 1)
        std = torch.tensor(data.CIFAR_STD).view(3, 1, 1)
        for n in range(6):
            pad_n = padded[n].clone()
            border = torch.ones(32 + 8, 32 + 8, dtype=torch.bool)
            border[4:36, 4:36] = False
            pad_n[:, border] = (-mean / std).expand(3, 40, 40)[:, border]
            found = any(torch.allclose(out[n], c, atol=1e-5)
                        for oy in range(9) for ox in range(9)
                        for c in (pad_n[:, oy:oy + 32, ox:ox + 32], pad_n[:, oy:oy + 32, ox:ox + 32].flip(-1)))
            self.assertTrue(found, f"image {n} is not a crop/flip of its padded source")
        again = data.cifar_augment(x, torch.Generator().manual_seed(0))
        self.assertTrue(torch.equal(out, again), "same generator seed, same augmentation")


class ShardTest(unittest.TestCase):
    def test_rank_slices_are_disjoint_whole_and_equal(self):
        order = data.epoch_order(1003, epoch=2, seed=7)
        self.assertEqual(sorted(order.tolist()), list(range(1003)))
        self.assertTrue(np.array_equal(order, data.epoch_order(1003, 2, 7)))
        self.assertFalse(np.array_equal(order, data.epoch_order(1003, 3, 7)))
        shards = [data.shard_for_rank(order, r, 3, 8) for r in range(3)]
        counts = {len(s) for s in shards}
        self.assertEqual(counts, {1003 // (3 * 8)})
        flat = [int(i) for s in shards for b in s for i in b]
        self.assertEqual(len(flat), len(set(flat)))
        self.assertTrue(all(len(b) == 8 for s in shards for b in s))


class TokenizeTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.src = os.path.join(cls.tmp.name, "src")
        os.makedirs(cls.src)
        rng = np.random.default_rng(0)
        words = ["alpha", "beta", "gamma", "delta", "lumi", "snellius", "rank", "tensor", "ü", "€"]
        cls.docs = [" ".join(rng.choice(words, size=int(rng.integers(20, 200)))) for _ in range(120)]
        with open(os.path.join(cls.src, "a.txt"), "w") as f:
            f.write(cls.docs[0])
        with gzip.open(os.path.join(cls.src, "b.json.gz"), "wt") as f:
            for doc in cls.docs[1:]:
                f.write(json.dumps({"text": doc, "url": "x"}) + "\n")
        from tokenizers import Tokenizer, models as tm, pre_tokenizers, trainers
        tok = Tokenizer(tm.BPE(unk_token="[UNK]"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel()
        tok.train_from_iterator(cls.docs, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "[UNK]"]))
        cls.tokjson = os.path.join(cls.tmp.name, "tokenizer.json")
        tok.save(cls.tokjson)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def out(self, name):
        return os.path.join(self.tmp.name, name)

    def test_digest_stable_and_sensitive(self):
        a = _tokenize(self.out("a"), [self.src], seq_len=32)
        b = _tokenize(self.out("elsewhere/b"), [self.src], seq_len=32, shard_windows=7)
        self.assertEqual(a["num_windows"], b["num_windows"])
        self.assertNotEqual(len(a["shards"]), len(b["shards"]))
        c = _tokenize(self.out("c"), [self.src], seq_len=32)
        self.assertEqual(a["digest"], c["digest"], "same corpus, tokenizer, seq_len -> same digest")
        s = _tokenize(self.out("s"), [self.src], seq_len=48)
        self.assertNotEqual(a["digest"], s["digest"], "seq_len must change the digest")
        h = _tokenize(self.out("h"), [self.src], seq_len=32, tokenizer=self.tokjson)
        self.assertNotEqual(a["digest"], h["digest"], "the tokenizer must change the digest")
        self.assertEqual(h["tokenizer_sha256"], hashlib.sha256(pathlib.Path(self.tokjson).read_bytes()).hexdigest())
        with open(os.path.join(self.out("a"), "manifest.json")) as f:
            self.assertEqual(json.load(f)["digest"], a["digest"])
        for m, d in ((a, "a"), (h, "h")):
            for sh in m["shards"]:
                got = hashlib.sha256(pathlib.Path(self.out(d), sh["file"]).read_bytes()).hexdigest()
                self.assertEqual(got, sh["sha256"])

    def test_windows_read_back_the_corpus(self):
        m = _tokenize(self.out("r"), [self.src], seq_len=16, shard_windows=5)
        w = data.TokenWindows(os.path.join(self.out("r"), "manifest.json"))
        self.assertEqual((w.num_windows, w.seq_len, w.vocab_size), (m["num_windows"], 16, 258))
        self.assertEqual(w.train_windows, m["num_windows"] - 4)
        self.assertEqual(list(w.heldout_indices()), list(range(w.train_windows, w.num_windows)))
        stream = np.concatenate([w.batch([i])[0] for i in range(w.num_windows)])
        expect = []
        for doc in self.docs:
            expect += list(doc.encode("utf-8")) + [tc.ByteTokenizer.eos_id]
        n = len(stream)
        self.assertEqual(stream.tolist(), expect[:n])
        self.assertLess(len(expect) - n, 17, "only the tail shorter than one window is dropped")
        self.assertEqual(m["tokens_dropped_tail"], len(expect) - n)
        b = w.batch([3, 0, 7])
        self.assertEqual((b.shape, b.dtype), ((3, 17), np.int64))
        self.assertTrue(np.array_equal(b[1], stream[:17]))

    def test_hf_tokenizer_windows_decode(self):
        _tokenize(self.out("t"), [self.src], seq_len=24, tokenizer=self.tokjson)
        w = data.TokenWindows(os.path.join(self.out("t"), "manifest.json"))
        tok = tc.HFTokenizer(self.tokjson)
        self.assertEqual(w.vocab_size, tok.vocab_size)
        ids = tok.encode(self.docs[0]).tolist() + [tok.eos_id] + tok.encode(self.docs[1]).tolist()
        self.assertEqual(np.concatenate([w.window(0), w.window(1)]).tolist(), ids[:50])
        self.assertEqual(tok.eos_id, tok.tok.token_to_id("<|endoftext|>"))

    def test_default_corpus_is_the_stdlib_and_caps_apply(self):
        files = tc.stdlib_sources()
        self.assertGreater(len(files), 100)
        self.assertTrue(all(f.endswith(".py") for f in files))
        m = _tokenize(self.out("std"), [], seq_len=64, max_files=3, max_bytes=50_000)
        self.assertEqual(m["files"], 3)
        self.assertGreater(m["num_windows"], 4)

    def test_too_little_text_names_the_flags(self):
        with self.assertRaisesRegex(ValueError, "--heldout-windows"):
            _tokenize(self.out("small"), [os.path.join(self.src, "a.txt")], seq_len=4096)

    def test_reader_refuses_another_format(self):
        d = self.out("bad")
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "manifest.json"), "w") as f:
            json.dump({"format": "something/9"}, f)
        with self.assertRaisesRegex(ValueError, "tokenize_corpus.py"):
            data.TokenWindows(os.path.join(d, "manifest.json"))


if __name__ == "__main__":
    unittest.main()
