"""hf_export: the global model loaded by Hugging Face transformers gives our model's logits.

The reference is transformers' own Qwen3ForCausalLM (test-only dependency), loaded
offline from the exported directory. The weights are qwen3-tiny from a fixed seed with
every tensor perturbed (norm weights start at 1, so a swapped q_norm/k_norm or
attention_norm/ffn_norm would otherwise export unnoticed), saved as train.py
--export-init saves them and turned into theta-0 by the aggregator's own code.
"""
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import unittest

import numpy as np
import safetensors
import torch
from torchtitan.models.qwen3 import Qwen3Model
from transformers import AutoModelForCausalLM, AutoTokenizer

import hf_export
import models
import outer_state
import tensorio
import tokenize_corpus as tc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TEXT = "\n".join(f"def f{i}(x):\n    return x * {i}  # héllo wörld €" for i in range(400))


def _cli(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "hf_export.py"), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)


def _model(args, seed):
    """The Qwen3 model of torchtitan args `args` (models.build_model builds it the same way),
    from `seed`, with every parameter moved off its init value."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = Qwen3Model(args)
    models.materialize(model, torch.device("cpu"))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def _tiny(vocab_size, seed):
    return _model(models.qwen3_args("qwen3-tiny", vocab_size, 32), seed)


def _save_theta(model, d):
    """As train.py --export-init writes the initial model, then the aggregator's theta-0."""
    named = list(model.named_parameters())
    init, theta = os.path.join(d, "init.safetensors"), os.path.join(d, "theta-0.safetensors")
    tensorio.save_torch(((n, p.detach().float()) for n, p in named), init,
                        metadata={"model": "qwen3-tiny", "seed": "0"},
                        specs=[(n, "F32", tuple(p.shape)) for n, p in named])
    outer_state.init_theta(init, theta, fsync=False)
    return theta


def _batch(vocab):
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, vocab, (3, 32), generator=g)


def _hf(out_dir):
    return AutoModelForCausalLM.from_pretrained(out_dir, local_files_only=True, dtype=torch.float32).eval()


class ExportTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        src = os.path.join(cls.tmp.name, "src")
        os.makedirs(src)
        with open(os.path.join(src, "a.txt"), "w") as f:
            f.write(TEXT)
        cls.manifest = os.path.join(cls.tmp.name, "bytes", "manifest.json")
        cls.m = tc.tokenize(tc.TokenizeConfig(inputs=[src], out=os.path.dirname(cls.manifest),
                                              seq_len=32, heldout_windows=4, progress=False))
        cls.model = _tiny(cls.m["vocab_size"], seed=0)
        cls.theta = _save_theta(cls.model, cls.tmp.name)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def out(self, name):
        return os.path.join(self.tmp.name, name)

    def test_transformers_logits_equal_ours(self):
        r = _cli(self.theta, self.out("hf"), "--model", "qwen3-tiny", "--data", self.manifest)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("the built-in byte tokenizer", r.stdout)
        self.assertEqual(sorted(os.listdir(self.out("hf"))),
                         ["config.json", "generation_config.json", "model.safetensors",
                          "tokenizer.json", "tokenizer_config.json"])
        hf = _hf(self.out("hf"))
        self.assertEqual(hf.config.vocab_size, 320)                     # 258 tokens padded to 64
        self.assertIs(hf.lm_head.weight, hf.model.embed_tokens.weight)  # tied, as ours
        self.assertEqual(hf.generation_config.eos_token_id, tc.ByteTokenizer.eos_id)
        with safetensors.safe_open(os.path.join(self.out("hf"), "model.safetensors"), "pt") as f:
            self.assertEqual(f.metadata()["format"], "pt")              # transformers 4.x insists
            self.assertNotIn("lm_head.weight", f.keys())                # a tied weight is stored once
        x = _batch(320)
        with torch.no_grad():
            ours, theirs = self.model(x), hf(input_ids=x).logits
        err = (ours - theirs).abs().max().item()
        self.assertLessEqual(err, 1e-5, f"max |logit difference| {err:.3g} on {tuple(x.shape)}")
        self.assertGreater(ours.std().item(), 0.1, "a model whose logits are flat checks nothing")
        tok = AutoTokenizer.from_pretrained(self.out("hf"), local_files_only=True)
        text = "def f(x):\n\treturn 'héllo' + \"€\""
        self.assertEqual(tok(text)["input_ids"], [int(i) for i in tc.ByteTokenizer().encode(text)])
        self.assertEqual(tok.decode(tok(text)["input_ids"]), text)
        self.assertEqual((tok.eos_token_id, tok.pad_token_id), (256, 257))

    def test_untied_head_in_bf16(self):
        """The untied flavors (8B and up) carry lm_head.weight; --dtype bf16 rounds as torch does."""
        args = dataclasses.replace(models.qwen3_args("qwen3-tiny", 258, 32), enable_weight_tying=False)
        model = _model(args, seed=5)
        d = self.out("untied")
        os.makedirs(d)
        theta = _save_theta(model, d)
        cfg = hf_export.ExportConfig(theta, os.path.join(d, "hf"), "qwen3-tiny", dtype="bf16")
        line = hf_export.export(cfg, model_args=args, progress=False)
        self.assertIn("no tokenizer", line)
        hf = _hf(cfg.out)
        self.assertFalse(hf.config.tie_word_embeddings)
        out_w = model.output.weight.detach()
        self.assertTrue(torch.equal(hf.lm_head.weight, out_w.to(torch.bfloat16).float()))
        self.assertFalse(torch.equal(hf.lm_head.weight, hf.model.embed_tokens.weight))
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(p.to(torch.bfloat16).float())
            x = _batch(320)
            err = (model(x) - hf(input_ids=x).logits).abs().max().item()
        self.assertLessEqual(err, 1e-5, f"max |logit difference| {err:.3g}")

    def test_debugmodel_whose_head_dim_is_not_dim_over_heads(self):
        """torchtitan's debugmodel: 16 heads of 128 over dim 256, 8 layers (qwen3-tiny's 4 x 16
        = 64 would not notice a config that derived head_dim from hidden_size)."""
        model = _model(models.qwen3_args("qwen3-debugmodel", 258, 32), seed=3)
        d = self.out("debug")
        os.makedirs(d)
        cfg = hf_export.ExportConfig(_save_theta(model, d), os.path.join(d, "hf"), "qwen3-debugmodel")
        hf_export.export(cfg, progress=False)
        hf = _hf(cfg.out)
        self.assertEqual((hf.config.head_dim, hf.config.hidden_size, hf.config.num_hidden_layers), (128, 256, 8))
        x = _batch(320)
        with torch.no_grad():
            err = (model(x) - hf(input_ids=x).logits).abs().max().item()
        self.assertLessEqual(err, 1e-5, f"max |logit difference| {err:.3g}")

    def test_wrong_model_is_one_line_error(self):
        r = _cli(self.theta, self.out("wrong"), "--model", "qwen3-debugmodel", "--data", self.manifest)
        self.assertNotEqual(r.returncode, 0)
        lines = r.stderr.strip().splitlines()
        self.assertEqual(len(lines), 1, r.stderr)
        self.assertIn("--model qwen3-debugmodel does not match", lines[0])
        self.assertIn("it fits --model qwen3-tiny", lines[0])
        self.assertEqual([f for f in os.listdir(self.tmp.name) if f.startswith("wrong")], [])

    def test_bad_inputs_name_the_fix(self):
        def error(*args):
            with self.assertRaises(SystemExit) as e:
                hf_export.main(list(args))
            return str(e.exception.code)
        self.assertIn("hf_export.py writes Qwen3", error(self.theta, self.out("x"), "--model", "resnet18"))
        self.assertIn("--tokenizer needs --data", error(self.theta, self.out("x"), "--model", "qwen3-tiny",
                                                        "--tokenizer", self.manifest))
        self.assertIn("drop --tokenizer", error(self.theta, self.out("x"), "--model", "qwen3-tiny",
                                                "--data", self.manifest, "--tokenizer", self.manifest))
        os.makedirs(self.out("full"))
        open(os.path.join(self.out("full"), "keep"), "w").close()
        self.assertIn("already exists", error(self.theta, self.out("full"), "--model", "qwen3-tiny"))
        self.assertEqual(os.listdir(self.out("full")), ["keep"])
        resnet = self.out("resnet.safetensors")
        tensorio.save_torch({"conv1.weight": torch.zeros(4, 3, 3, 3)}, resnet)
        self.assertIn("no 'tok_embeddings.weight'", error(resnet, self.out("x"), "--model", "qwen3-tiny"))
        self.assertFalse(os.path.exists(self.out("x")))


class HFTokenizerTest(unittest.TestCase):
    """A corpus made with an HF tokenizer.json: the export carries that very file."""

    @classmethod
    def setUpClass(cls):
        from tokenizers import Tokenizer, models as tm, pre_tokenizers, trainers, decoders
        cls.tmp = tempfile.TemporaryDirectory()
        tokdir = os.path.join(cls.tmp.name, "tok")
        src = os.path.join(cls.tmp.name, "src")
        os.makedirs(tokdir)
        os.makedirs(src)
        with open(os.path.join(src, "a.txt"), "w") as f:
            f.write(TEXT)
        tok = Tokenizer(tm.BPE(unk_token="[UNK]"))
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(), decoders.ByteLevel()
        tok.train_from_iterator(TEXT.splitlines(), trainers.BpeTrainer(
            vocab_size=300, special_tokens=["<|endoftext|>", "[UNK]"]))
        cls.tokjson = os.path.join(tokdir, "tokenizer.json")
        tok.save(cls.tokjson)
        cls.manifest = os.path.join(cls.tmp.name, "corpus", "manifest.json")
        m = tc.tokenize(tc.TokenizeConfig(inputs=[src], out=os.path.dirname(cls.manifest), seq_len=32,
                                          tokenizer=cls.tokjson, heldout_windows=4, progress=False))
        cls.vocab = m["vocab_size"]
        cls.theta = _save_theta(_tiny(cls.vocab, seed=2), cls.tmp.name)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_tokenizer_copied_and_checked(self):
        out = os.path.join(self.tmp.name, "hf")
        line = hf_export.export(hf_export.ExportConfig(self.theta, out, "qwen3-tiny", data=self.manifest,
                                                       tokenizer=self.tokjson), progress=False)
        self.assertIn("tokenizer tokenizer.json", line)
        with open(os.path.join(out, "tokenizer.json"), "rb") as a, open(self.tokjson, "rb") as b:
            self.assertEqual(a.read(), b.read())
        with open(os.path.join(out, "config.json")) as f:
            self.assertEqual(json.load(f)["vocab_size"], models.pad_vocab(self.vocab))
        ours = tc.HFTokenizer(self.tokjson)
        theirs = AutoTokenizer.from_pretrained(out, local_files_only=True)
        text = "def f7(x):\n    return x * 7"
        self.assertEqual(theirs(text)["input_ids"], [int(i) for i in ours.encode(text)])
        self.assertEqual(theirs.eos_token_id, ours.eos_id)

    def test_missing_or_other_tokenizer_is_refused(self):
        def error(**kw):
            cfg = hf_export.ExportConfig(self.theta, os.path.join(self.tmp.name, "no"), "qwen3-tiny",
                                         data=self.manifest, **kw)
            with self.assertRaises(hf_export.ExportError) as e:
                hf_export.export(cfg, progress=False)
            return str(e.exception)
        self.assertIn("pass it as --tokenizer", error())
        other = os.path.join(self.tmp.name, "other.json")
        with open(self.tokjson) as f, open(other, "w") as g:
            g.write(f.read().replace("[UNK]", "[unk]"))
        self.assertIn("pass that file", error(tokenizer=other))
        self.assertFalse(os.path.exists(os.path.join(self.tmp.name, "no")))
        self.assertEqual([f for f in os.listdir(self.tmp.name) if ".tmp-" in f], [])


class CentralVMTest(unittest.TestCase):
    """tensorio.py stays numpy-only: run as on the central VM, with torch unimportable; the
    export there says where to run it."""

    def run_without_torch(self, *argv, script="tensorio.py"):
        code = ("import runpy, sys; sys.modules['torch'] = None; "
                f"sys.argv = [{script!r}, *{list(argv)!r}]; runpy.run_path({script!r}, run_name='__main__')")
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)

    def test_inspection_needs_no_torch(self):
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "t.safetensors")
            with tensorio.TensorWriter(path, [("w", "F32", (2,))]) as w:
                w.write("w", np.ones(2, np.float32))
            r = self.run_without_torch(path, "--check")
            self.assertEqual(r.returncode, 0, r.stderr)
            self.assertIn("w  F32[2]", r.stdout)

    def test_export_without_torch_says_where_to_run_it(self):
        r = self.run_without_torch("theta-3.safetensors", "out", "--model", "qwen3-tiny", script="hf_export.py")
        self.assertNotEqual(r.returncode, 0)
        self.assertEqual(len(r.stderr.strip().splitlines()), 1, r.stderr)
        self.assertIn("needs torch and torchtitan", r.stderr)
        self.assertIn("run it at a site", r.stderr)


if __name__ == "__main__":
    unittest.main()
