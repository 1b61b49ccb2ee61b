"""tests/test_gpu_path.py - the parts of the GPU path that a CPU can check.

What runs the same on a CPU as on a GPU is tested here with real gloo process groups
(spawned processes, one FileStore each): torch.compile per block (eager and compiled
agree, no parameter renamed; a ResNet's stages under DDP too, BatchNorm statistics
included; under FSDP refused at start), FSDP2 gradient accumulation with and without deferred
reduce-scatter (the same update), the fp32 BatchNorm policy of a bf16 ResNet under FSDP,
fused AdamW on sharded parameters. In this process: the attention kernel plan and what
the profiler says ran, the fp64-accumulated DiLoCo norm against numpy, the MFU peak
table's exact device names, and the flags' validation. What only a GPU can show (pinned
copies overlapping, fused kernels' speed, the kernel a ROCm build picks) is
bench/gpu_check.sh's job.
Run: .venv/bin/python tests/run.py test_gpu_path
"""
import json
import os
import shutil
import sys
import tempfile
import unittest

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.attention import SDPBackend

import diloco
import metrics
import models
import train
import train_step

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def spawn(fn, world, tmp, *args):
    """fn(rank, world, tmp, *args) on `world` processes in one gloo group (loopback only)."""
    mp.start_processes(_entry, args=(fn, world, tmp) + args, nprocs=world, join=True, start_method="spawn")


def _entry(rank, fn, world, tmp, *args):
    sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store-{fn.__name__}", rank=rank,
                            world_size=world)
    try:
        fn(rank, world, tmp, *args)
    finally:
        dist.destroy_process_group()


def _dump(tmp, name, rank, obj):
    with open(os.path.join(tmp, f"{name}-{rank}.json"), "w") as f:
        json.dump(obj, f)


def _load(tmp, name, rank=0):
    with open(os.path.join(tmp, f"{name}-{rank}.json")) as f:
        return json.load(f)


def _lm_loss(model, batch):
    return F.cross_entropy(model(batch[:, :-1]).flatten(0, 1).float(), batch[:, 1:].flatten())


# ---------------------------------------------------------------- workers (spawned)

def compile_worker(rank, world, tmp):
    """qwen3-tiny under FSDP2: eager vs compiled per block (+ activation checkpointing)."""
    batch = torch.randint(0, 258, (2, 33), generator=torch.Generator().manual_seed(1))
    out = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = models.parallelize(models.build_model("qwen3-tiny", 258, 32), "fsdp", torch.device("cpu"),
                                   activation_checkpointing=True, compile=compiled)
        loss = _lm_loss(model, batch)
        loss.backward()
        out[str(compiled)] = {"loss": loss.item(), "names": [n for n, _ in model.named_parameters()],
                         "grads": [p.grad.full_tensor().flatten()[:64].tolist() for p in model.parameters()],
                         "forward": type(model.layers["0"].forward).__name__}
    _dump(tmp, "compile", rank, out)


def resnet_compile_worker(rank, world, tmp):
    """ResNet-18 as --parallel ddp builds it (one rank: the module itself), eager vs compiled
    per stage: loss, gradients and the BatchNorm statistics the compiled stages update."""
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(4, 3, 32, 32, generator=gen), torch.randint(0, 10, (4,), generator=gen)
    out = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        model = models.parallelize(models.build_model("resnet18"), "ddp", torch.device("cpu"), compile=compiled)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        stage_bn = next(m for m in model.stages()[-1].modules() if isinstance(m, torch.nn.BatchNorm2d))
        out[str(compiled)] = {"loss": loss.item(), "names": [n for n, _ in model.named_parameters()],
                              "grads": [p.grad.flatten()[:16].tolist() for p in model.parameters()],
                              "stats": stage_bn.running_mean[:16].tolist(),
                              "forward": type(model.stages()[0].forward).__name__}
    _dump(tmp, "resnet_compile", rank, out)


def accum_worker(rank, world, tmp):
    """One optimizer step of 2 micro-batches, reduce-scatter each vs deferred: same update."""
    gen = torch.Generator().manual_seed(rank)
    micro = [torch.randint(0, 258, (2, 33), generator=gen) for _ in range(2)]
    out = {}
    for defer in (False, True):
        torch.manual_seed(0)
        model = models.parallelize(models.build_model("qwen3-tiny", 258, 32), "fsdp", torch.device("cpu"))
        cfg = train.Config(parallel="fsdp", grad_accum=2, fsdp_defer_grad_sync=defer)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        for i, b in enumerate(micro):
            with train_step.grad_sync(model, cfg, i == len(micro) - 1):
                loss = _lm_loss(model, b) / len(micro)
            loss.backward()
        opt.step()
        out[str(defer)] = [p.full_tensor().flatten()[:256].tolist() for p in model.parameters()]
    _dump(tmp, "accum", rank, out)


def bn_worker(rank, world, tmp):
    """ResNet-18 under FSDP with bf16 parameters: what dtypes BatchNorm and conv see."""
    torch.manual_seed(0)
    model = models.parallelize(models.build_model("resnet18"), "fsdp", torch.device("cpu"),
                               param_dtype=torch.bfloat16)
    seen = {}

    def record(mod, args):
        kind = "bn" if isinstance(mod, torch.nn.BatchNorm2d) else "conv"
        seen.setdefault(kind, set()).add((str(args[0].dtype), str(mod.weight.dtype)))
    for m in model.modules():
        if isinstance(m, (torch.nn.BatchNorm2d, torch.nn.Conv2d)):
            m.register_forward_pre_hook(record)
    x, y = torch.randn(4, 3, 32, 32), torch.randint(0, 10, (4,))
    loss = F.cross_entropy(model(x).float(), y)
    loss.backward()
    opt, _ = train.make_optimizer(train.Config(model="resnet18").resolve("cpu"), model, world)
    opt.step()
    _dump(tmp, "bn", rank, {k: sorted(map(list, v)) for k, v in seen.items()} | {
        "loss": loss.item(), "bn_buffers": str(model.bn1.running_mean.dtype),
        "bn_stored": str(model.bn1.weight.dtype)})


def fused_worker(rank, world, tmp):
    """make_optimizer for a GPU: fused AdamW, here stepping FSDP2's sharded (DTensor) params."""
    torch.manual_seed(0)
    model = models.parallelize(models.build_model("qwen3-tiny", 258, 32), "fsdp", torch.device("cpu"))
    cfg = train.Config(model="qwen3-tiny", data="x/manifest.json").resolve("cpu")
    opt, _ = train.make_optimizer(cfg, model, world, device_type="cuda")
    ref_model = models.parallelize(models.build_model("qwen3-tiny", 258, 32), "fsdp", torch.device("cpu"))
    with torch.no_grad():
        for p, q in zip(ref_model.parameters(), model.parameters()):
            p.copy_(q)
    ref, _ = train.make_optimizer(cfg, ref_model, world, device_type="cpu")
    batch = torch.randint(0, 258, (2, 33), generator=torch.Generator().manual_seed(3))
    for m, o in ((model, opt), (ref_model, ref)):
        _lm_loss(m, batch).backward()
        o.step()
    with torch.no_grad():
        diff = max(float((p.full_tensor() - q.full_tensor()).abs().max())
                   for p, q in zip(model.parameters(), ref_model.parameters()))
    _dump(tmp, "fused", rank, {"fused": opt.defaults["fused"], "ref_fused": ref.defaults["fused"],
                               "max_diff": diff})


# ---------------------------------------------------------------- tests

class SpawnedTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp()
        self.addCleanup(shutil.rmtree, self.tmp)

    def test_compile_per_block_matches_eager_and_keeps_every_name(self):
        spawn(compile_worker, 1, self.tmp)
        got = _load(self.tmp, "compile")
        eager, compiled = got["False"], got["True"]
        self.assertEqual(compiled["names"], eager["names"], "a checkpoint or delta would not load")
        self.assertFalse(any("_orig_mod" in n for n in compiled["names"]))
        self.assertNotEqual(compiled["forward"], eager["forward"], "the block's forward was not replaced")
        self.assertAlmostEqual(compiled["loss"], eager["loss"], places=5)
        for a, b in zip(compiled["grads"], eager["grads"]):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)

    def test_compiled_resnet_stages_match_eager_under_ddp(self):
        spawn(resnet_compile_worker, 1, self.tmp)
        got = _load(self.tmp, "resnet_compile")
        eager, compiled = got["False"], got["True"]
        self.assertEqual(compiled["names"], eager["names"])
        self.assertNotEqual(compiled["forward"], eager["forward"], "the stage's forward was not replaced")
        self.assertAlmostEqual(compiled["loss"], eager["loss"], places=4)
        np.testing.assert_allclose(compiled["stats"], eager["stats"], rtol=1e-4, atol=1e-6,
                                   err_msg="the compiled stage did not update BatchNorm's running statistics")
        for a, b in zip(compiled["grads"], eager["grads"]):
            np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)

    def test_fsdp_grad_accumulation_same_update_with_and_without_deferred_sync(self):
        spawn(accum_worker, 2, self.tmp)
        for rank in (0, 1):
            got = _load(self.tmp, "accum", rank)
            for a, b in zip(got["False"], got["True"]):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        self.assertEqual(_load(self.tmp, "accum", 0), _load(self.tmp, "accum", 1), "ranks disagree")

    def test_resnet_batchnorm_stays_fp32_under_bf16_fsdp(self):
        spawn(bn_worker, 1, self.tmp)
        got = _load(self.tmp, "bn")
        self.assertEqual(got["bn"], [["torch.bfloat16", "torch.float32"]], "BN: bf16 input, fp32 weights")
        self.assertEqual(got["conv"], [["torch.bfloat16", "torch.bfloat16"]])
        self.assertEqual((got["bn_buffers"], got["bn_stored"]), ("torch.float32", "torch.float32"))
        self.assertTrue(np.isfinite(got["loss"]))

    def test_gpu_optimizer_is_fused_and_steps_sharded_params_like_foreach(self):
        spawn(fused_worker, 1, self.tmp)
        got = _load(self.tmp, "fused")
        self.assertEqual((got["fused"], got["ref_fused"]), (True, None))
        self.assertLess(got["max_diff"], 1e-6)


class AttentionPlanTest(unittest.TestCase):
    def qkv(self, heads, kv, seq=32, hd=16):
        g = torch.Generator().manual_seed(0)
        make = lambda h: torch.randn(2, seq, h, hd, generator=g).transpose(1, 2).requires_grad_()
        return make(heads), make(kv), make(kv)

    def test_expanded_kv_gives_the_same_attention_through_an_efficient_kernel(self):
        outs, ran = {}, {}
        for expand in (False, True):
            q, k, v = self.qkv(4, 2)
            attn = models.GQAAttention()
            attn.expand_kv = expand

            def step():
                o = attn(q, k, v, scale=0.25, enable_gqa=True)
                o.sum().backward()
                outs[expand] = (o.detach(), q.grad, k.grad, v.grad)
            ran[expand] = models.sdpa_kernels_ran(step)
        self.assertEqual(ran, {False: ["flash"], True: ["flash"]})
        for a, b in zip(outs[False], outs[True]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)

    def test_plan_expands_only_where_gqa_would_fall_to_math(self):
        # the dispatcher's rule on a build whose efficient kernels reject grouped-query
        # shapes (ROCm's memory-efficient kernel; its flash kernel in older releases)
        def rocm_like(device, dtype, heads, kv, hd, seq):
            return SDPBackend.MATH if kv != heads else SDPBackend.FLASH_ATTENTION
        plan = models.attention_plan(torch.device("cpu"), torch.bfloat16, 16, 8, 128, 2048, choose=rocm_like)
        self.assertEqual(plan, (SDPBackend.FLASH_ATTENTION, True))
        self.assertEqual(models.describe_plan(*plan, 16, 8), "flash (K/V expanded 2x for GQA)")
        never = lambda *a: SDPBackend.MATH
        self.assertEqual(models.attention_plan(None, None, 16, 8, 128, 2048, choose=never), (SDPBackend.MATH, False))
        native = models.attention_plan(torch.device("cpu"), torch.float32, 16, 8, 128, 256)
        self.assertEqual(native, (SDPBackend.FLASH_ATTENTION, False), "this CPU build takes GQA natively")

    def test_configure_attention_sets_every_block(self):
        model = models.build_model("qwen3-tiny", 258, 32)
        self.assertEqual(models.configure_attention(model, torch.device("cpu"), torch.float32), "flash (GQA native)")
        mods = [m for m in model.modules() if isinstance(m, models.GQAAttention)]
        self.assertEqual(len(mods), 2)
        self.assertIsNone(models.configure_attention(models.build_model("resnet18"), torch.device("cpu"), torch.float32))


class DiLoCoNormTest(unittest.TestCase):
    def test_sq_norm_accumulates_in_fp64_across_chunks(self):
        old = diloco.NORM_CHUNK
        self.addCleanup(setattr, diloco, "NORM_CHUNK", old)
        rng = np.random.default_rng(0)
        x = rng.standard_normal(10_007).astype(np.float32)
        ref = float(np.sum(x.astype(np.float64) ** 2))
        for chunk in (1, 1000, 4096, 1 << 22):
            diloco.NORM_CHUNK = chunk
            self.assertAlmostEqual(diloco.sq_norm(torch.from_numpy(x)), ref, delta=ref * 1e-13)
        self.assertEqual(diloco.sq_norm(torch.empty(0)), 0.0)
        # 2^24 ones plus one: an fp32 running sum stops counting at 2^24, fp64 does not
        diloco.NORM_CHUNK = 1 << 22
        big = torch.ones((1 << 24) + 1)
        self.assertEqual(diloco.sq_norm(big), float((1 << 24) + 1))


class PeakTableTest(unittest.TestCase):
    def test_form_factors_are_told_apart(self):
        cases = {"NVIDIA H100 80GB HBM3": 989e12, "NVIDIA H100 PCIe": 756e12, "NVIDIA H100 NVL": 835e12,
                 "NVIDIA H200": 989e12, "NVIDIA H200 NVL": 835e12, "NVIDIA A100-SXM4-80GB": 312e12,
                 "NVIDIA A100-PCIE-40GB": 312e12, "NVIDIA A100 80GB PCIe": 312e12,
                 "AMD Instinct MI250X": 191.5e12, "AMD Instinct MI250": 181e12,
                 "NVIDIA GH200 480GB": None, "NVIDIA H800": None, "AMD Instinct MI300X": None}
        for name, peak in cases.items():
            self.assertEqual(metrics.peak_flops_for(name), peak, name)
        self.assertEqual(metrics.peak_flops_for("AMD Instinct MI250X/MI250", 110), 191.5e12)
        self.assertEqual(metrics.peak_flops_for("AMD Instinct MI250X/MI250", 104), 181e12)
        self.assertIsNone(metrics.peak_flops_for("AMD Instinct MI250X/MI250"))


class FlagsTest(unittest.TestCase):
    def test_compile_and_deferred_sync_flags(self):
        cfg = train.parse_config(["--model", "qwen3-tiny", "--compile", "--parallel", "fsdp", "--grad-accum", "2",
                                  "--fsdp-defer-grad-sync", "--data", "x/manifest.json"])
        self.assertTrue(cfg.compile and cfg.fsdp_defer_grad_sync)
        cfg.resolve("cpu").validate()
        with self.assertRaisesRegex(train.ConfigError, "--fsdp-defer-grad-sync is for --parallel fsdp"):
            train.Config(model="resnet18", fsdp_defer_grad_sync=True).resolve("cpu").validate()

    def test_a_compiled_resnet_under_fsdp_is_refused_before_it_starts(self):
        # train.py --model resnet18 --parallel fsdp --compile died in Dynamo (bf16) or Inductor
        # (fp32) after the process group was up; now one line at start, naming the fix
        for dtype in ("bf16", "fp32"):
            cfg = train.Config(model="resnet18", parallel="fsdp", compile=True, dtype=dtype).resolve("cpu")
            with self.assertRaisesRegex(train.ConfigError, "--compile with --parallel fsdp is for the Qwen3 "
                                                           "models.*use --parallel ddp"):
                cfg.validate()
        train.Config(model="resnet18", parallel="ddp", compile=True).resolve("cpu").validate()
        train.Config(model="qwen3-tiny", data="x/manifest.json", parallel="fsdp", compile=True).resolve("cpu").validate()

    def test_cpu_staging_hands_the_array_through(self):
        arr = np.arange(12, dtype=np.int64).reshape(3, 4)
        t = train_step.HostToDevice(torch.device("cpu"))(arr)
        self.assertEqual(t.data_ptr(), torch.from_numpy(arr).data_ptr(), "no copy on the CPU")


if __name__ == "__main__":
    unittest.main()
