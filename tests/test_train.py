"""tests/test_train.py - train.py: config precedence, rank/rendezvous from the environment,
and real runs through the entrypoint (torchrun, 2 CPU ranks, gloo).

Also a federated site's process groups: this file's `groups-worker` mode runs train.py's own
stages of a 2-rank FSDP2 site (settle_config, open_run_dir, build_model, make_outer, an
inner step, the held-out eval, the carrier's per-tensor gather and scatter, a sharded
checkpoint) and counts the groups torch.distributed holds: the default one only.

The runs are the expensive part (~10-30 s each on 2 cores): FSDP2 on qwen3-tiny with
the loss falling, then resumed on ONE rank from the 2-rank sharded checkpoint; DDP
ResNet-18 on a generated CIFAR fixture end to end; DiLoCo k=2 with the trailing
partial phase flushed before the last eval.
"""
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import unittest

import torch

import data
import dist_env
import models
import tokenize_corpus as tc
import testhooks
import train
import train_config
from testbed import harness
from testbed.harness import listening_url

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)
    return path


class ConfigTest(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()

    def tearDown(self):
        self.tmp.cleanup()

    def yaml(self, text):
        return _write(os.path.join(self.tmp.name, "c.yaml"), text)

    def test_yaml_supplies_defaults_and_flags_override(self):
        p = self.yaml("model: qwen3-tiny\nlr: 3e-4\nbatch-size: 4\nsharded_checkpoint: true\n"
                      "diloco_outer_lr: 1\n")
        cfg = train.parse_config(["--config", p])
        self.assertEqual((cfg.model, cfg.batch_size, cfg.sharded_checkpoint), ("qwen3-tiny", 4, True))
        self.assertIsInstance(cfg.lr, float)          # YAML 1.1 reads 3e-4 as a string
        self.assertEqual(cfg.lr, 3e-4)
        self.assertEqual(cfg.diloco_outer_lr, 1.0)
        cfg = train.parse_config(["--config", p, "--lr", "0.01", "--batch-size", "2", "--model", "resnet18"])
        self.assertEqual((cfg.lr, cfg.batch_size, cfg.model), (0.01, 2, "resnet18"))
        self.assertEqual(train.parse_config([]).model, "resnet18")

    def test_unknown_key_is_named(self):
        p = self.yaml("model: resnet18\nlearning_rate: 0.1\n")
        with self.assertRaises(train.ConfigError) as e:
            train.parse_config(["--config", p])
        self.assertIn("'learning_rate'", str(e.exception))
        self.assertIn(p, str(e.exception))

    def test_bad_values_name_the_flag(self):
        for text, flag in (("parallel: zero3\n", "--parallel"), ("batch_size: many\n", "--batch-size"),
                           ("activation_checkpointing: yes please\n", "--activation-checkpointing"),
                           ("model: gpt2\n", "--model")):
            with self.subTest(text=text), self.assertRaises(train.ConfigError) as e:
                train.parse_config(["--config", self.yaml(text)])
            self.assertIn(flag, str(e.exception))
        with self.assertRaisesRegex(train.ConfigError, "no such file"):
            train.parse_config(["--config", os.path.join(self.tmp.name, "absent.yaml")])

    def test_validation_names_the_fix(self):
        cfg = train.Config(model="qwen3-tiny", data="x/manifest.json", parallel="fsdp", dtype="fp16")
        with self.assertRaisesRegex(train.ConfigError, "GradScaler.*--dtype bf16"):
            cfg.resolve("cuda").validate()
        train.Config(model="resnet18", parallel="ddp", dtype="fp16").resolve("cuda").validate()
        with self.assertRaisesRegex(train.ConfigError, "--data .*manifest.json"):
            train.Config(model="qwen3-tiny", data="data/cifar").resolve("cpu").validate()
        with self.assertRaisesRegex(ValueError, "--diloco-outer-lr"):
            train.Config(diloco_replicas=2, diloco_outer_lr=0).resolve("cpu").validate()
        with self.assertRaisesRegex(train.ConfigError, "--activation-checkpointing"):
            train.Config(model="resnet18", activation_checkpointing=True).resolve("cpu").validate()

    def test_outer_step_flags_are_refused_with_federation_only_when_given(self):
        fed = ["--model", "qwen3-tiny", "--data", "x/manifest.json", "--federation", "http://127.0.0.1:1",
               "--darl-url", "http://127.0.0.1:2", "--site", "lumi"]
        cfg = train.parse_config(fed).resolve("cpu")
        cfg.validate()                                 # the defaults alone are not a given value
        self.assertEqual((cfg.diloco_outer_lr, cfg.diloco_outer_momentum), (None, None))
        for extra, flag in ((["--diloco-outer-lr", "0.5"], "--diloco-outer-lr 0.5"),
                            (["--diloco-outer-momentum", "0.8"], "--diloco-outer-momentum 0.8"),
                            (["--diloco-outer-optimizer", "sgd"], "--diloco-outer-optimizer sgd"),
                            (["--config", self.yaml("diloco_outer_lr: 1.0\n")], "--diloco-outer-lr 1.0")):
            with self.subTest(extra=extra), self.assertRaises(train.ConfigError) as e:
                train.parse_config(fed + extra).resolve("cpu").validate()
            self.assertIn(flag, str(e.exception))
            self.assertIn("fedmom_server.py --outer-lr and --outer-momentum", str(e.exception))
        with self.assertRaises(train.ConfigError) as e:              # where theta would live: nothing to place
            train.parse_config(fed + ["--diloco-outer-device", "cpu"]).resolve("cpu").validate()
        self.assertIn("--diloco-outer-device cpu with --federation", str(e.exception))
        # a federated run's written config.yaml reads back and passes (the fields stay unset) ...
        path = os.path.join(self.tmp.name, "config.yaml")
        train.write_config_yaml(path, cfg, {"git": "abc", "world_size": 1})
        train.parse_config(["--config", path]).resolve("cpu").validate()
        for f in sorted(os.listdir(os.path.join(ROOT, "configs"))):       # ... and so do the shipped ones
            if f.startswith("qwen3"):
                train.parse_config(["--config", os.path.join(ROOT, "configs", f)] + fed).resolve("cpu").validate()
        # inside one allocation the same flags are DiLoCo's, and the defaults are filled in
        local = train.parse_config(["--diloco-replicas", "2", "--diloco-outer-lr", "0.5"]).resolve("cpu")
        local.validate()
        self.assertEqual((local.diloco_outer_optimizer, local.diloco_outer_lr, local.diloco_outer_momentum),
                         ("nesterov", 0.5, 0.9))

    def test_model_dependent_defaults(self):
        c = train.Config(model="resnet18").resolve("cpu")
        self.assertEqual((c.dtype, c.batch_size, c.lr, c.weight_decay, c.grad_clip),
                         ("fp32", 128, 0.1, 5e-4, 0.0))
        q = train.Config(model="qwen3-0.6B").resolve("rocm")
        self.assertEqual((q.dtype, q.lr, q.min_lr, q.weight_decay, q.grad_clip, q.data),
                         ("bf16", 3e-4, 3e-4 / 10, 0.1, 1.0, "data/tokens/manifest.json"))
        self.assertEqual(train.Config(model="resnet18", dtype="fp32").resolve("cuda").dtype, "fp32")

    def test_written_config_reads_back_and_shipped_configs_parse(self):
        cfg = train.parse_config(["--model", "qwen3-tiny", "--lr", "0.002", "--diloco-replicas", "2"])
        path = os.path.join(self.tmp.name, "config.yaml")
        train.write_config_yaml(path, cfg, {"git": "abc", "world_size": 2})
        self.assertEqual(train.parse_config(["--config", path]), dataclasses.replace(cfg, config=path))
        shipped = sorted(f for f in os.listdir(os.path.join(ROOT, "configs")) if f.endswith(".yaml"))
        self.assertIn("cifar10_resnet18.yaml", shipped)
        for f in shipped:
            train.parse_config(["--config", os.path.join(ROOT, "configs", f)])

    def test_every_field_is_one_flag_with_the_fields_default_and_help(self):
        """The flags are derived from Config: one per field, its default the field's, its
        --help the field's text ending in the default it prints."""
        env = {k: os.environ.pop(k) for k in ("PWW_TOKEN_FILE", "PWW_CA_FILE") if k in os.environ}
        self.addCleanup(os.environ.update, env)
        parser = train_config.build_parser()
        actions = {a.dest: a for a in parser._actions if a.dest != "help"}
        fields = dataclasses.fields(train_config.Config)
        self.assertEqual(sorted(actions), sorted(f.name for f in fields))
        text = parser.format_help()
        for f in fields:
            with self.subTest(field=f.name):
                flag = "--" + f.name.replace("_", "-")
                self.assertEqual(actions[f.name].option_strings[0], flag)
                self.assertEqual(parser.get_default(f.name), f.default)
                self.assertTrue(f.metadata["help"], f"{flag} has no help")
                self.assertTrue(actions[f.name].help.endswith(f"(default {train_config.shown_default(f)})"
                                                              .replace("%", "%%")), actions[f.name].help)
                self.assertIn(flag, text)
                if f.metadata["shown"] is None:        # printed from the value: it reads back as the default
                    printed = train_config.shown_default(f)
                    if isinstance(f.default, bool) or f.default is None:
                        self.assertEqual(printed, {True: "on", False: "off", None: "none"}[f.default])
                    else:
                        self.assertEqual(type(f.default)(printed), f.default)
        self.assertEqual(train_config.parse_config([]), train_config.Config())
        os.environ["PWW_TOKEN_FILE"] = "/site/token"          # the one kind of default read at parse time
        self.addCleanup(os.environ.pop, "PWW_TOKEN_FILE")
        self.assertEqual(train_config.build_parser().get_default("token_file"), "/site/token")

    def test_a_flag_the_run_would_not_read_is_refused_naming_it_and_the_fix(self):
        local = ["--model", "qwen3-tiny", "--data", "x/manifest.json"]
        fed = local + ["--federation", "http://127.0.0.1:1", "--darl-url", "http://127.0.0.1:2", "--site", "lumi"]
        cifar = ["--model", "resnet18"]
        export = ["--export-init", os.path.join(self.tmp.name, "init.safetensors")] + local
        refused = [
            (local + ["--darl-url", "http://c:1"], "--darl-url http://c:1 without --federation"),
            (local + ["--token-file", "/t"], "--token-file /t without --federation"),
            (local + ["--wire", "int4"], "--wire int4 without --federation"),
            (local + ["--no-error-feedback"], "--no-error-feedback without --federation"),
            (local + ["--overlap-fold", "end"], "--overlap-fold end without --federation"),
            (local + ["--throttle-ms", "5"], "--throttle-ms 5 without --federation"),
            (local + ["--diloco-inner-steps", "50"], "--diloco-inner-steps 50 without --diloco-replicas > 1"),
            (local + ["--diloco-outer-lr", "0.5"], "--diloco-outer-lr 0.5 without --diloco-replicas > 1"),
            (local + ["--diloco-outer-device", "cpu"], "--diloco-outer-device cpu without --diloco-replicas > 1"),
            (fed + ["--ckpt-every", "10"], "--ckpt-every 10 with --federation: a site checkpoints"),
            (fed + ["--wire-block", "64"], "--wire-block 64 with --wire f32"),
            (fed + ["--wire", "topk", "--wire-block", "64"], "--wire-block 64 with --wire topk"),
            (fed + ["--wire", "int4", "--wire-topk-k", "8"], "--wire-topk-k 8 with --wire int4"),
            (fed + ["--error-feedback"], "--error-feedback with --wire f32: f32 drops nothing"),
            (fed + ["--wire-feedback-decay", "0.95"], "--wire-feedback-decay 0.95 with --wire f32"),
            (fed + ["--wire", "topk", "--no-error-feedback", "--wire-feedback-decay", "0.95"],
             "--wire-feedback-decay 0.95 with --wire topk: without error feedback"),
            (fed + ["--wire", "int2", "--wire-topk-bits", "2"], "--wire-topk-bits 2 with --wire int2"),
            (fed + ["--overlap-fold", "end"], "--overlap-fold end without --overlap"),
            (fed + ["--overlap-fold", "eager"], "--overlap-fold eager without --overlap"),
            (local + ["--epochs", "3"], "--epochs 3 with --model qwen3-tiny"),
            (cifar + ["--seq-len", "64"], "--seq-len 64 with --model resnet18"),
            (cifar + ["--eval-windows", "8"], "--eval-windows 8 with --model resnet18"),
            (cifar + ["--steps", "5", "--epochs", "2"], "--epochs 2 with --steps 5"),
            (local + ["--parallel", "fsdp", "--fsdp-defer-grad-sync"], "--fsdp-defer-grad-sync with --grad-accum 1"),
            (export + ["--steps", "3"], "--steps 3 with --export-init"),
            (export + ["--device", "cpu"], "--device cpu with --export-init"),
        ]
        for argv, words in refused:
            with self.subTest(argv=argv), self.assertRaises(train.ConfigError) as e:
                train_config.parse_config(argv)
            self.assertIn(words, str(e.exception))
            self.assertRegex(str(e.exception), r"drop (it|one of them)|use --steps")       # and the fix
        # the same flags where the run reads them
        for argv in (fed + ["--wire", "int4", "--wire-block", "64", "--no-error-feedback", "--throttle-ms", "5"],
                     fed + ["--wire", "topk", "--wire-topk-k", "8", "--overlap", "--overlap-fold", "end"],
                     fed + ["--wire", "topk", "--wire-topk-bits", "2", "--wire-feedback-decay", "0.95"],
                     fed + ["--wire", "int2", "--wire-block", "64", "--wire-feedback-decay", "0.9"],
                     fed + ["--wire", "int4", "--overlap", "--overlap-fold", "eager"],
                     fed + ["--diloco-inner-steps", "4", "--token-file", "/t", "--register-wait-s", "5"],
                     local + ["--diloco-replicas", "2", "--diloco-inner-steps", "50", "--diloco-outer-lr", "0.5"],
                     local + ["--steps", "5", "--ckpt-every", "5", "--eval-windows", "8", "--seq-len", "16"],
                     local + ["--parallel", "fsdp", "--grad-accum", "2", "--fsdp-defer-grad-sync"],
                     cifar + ["--epochs", "2"], cifar + ["--steps", "0", "--epochs", "2"]):
            with self.subTest(argv=argv):
                train_config.parse_config(argv).resolve("cpu").validate()
        train_config.parse_config(export + ["--seed", "3"])
        # a --config key is a default shared by modes, not refused: the shipped 0.6B config's
        # ckpt_every on a site, DiLoCo's H and a wire key in a single-allocation run
        self.assertEqual(train_config.parse_config(["--config", "configs/qwen3_0.6B.yaml"] + fed).ckpt_every, 500)
        p = self.yaml("diloco_inner_steps: 7\nwire_block: 64\n")
        self.assertEqual(train_config.parse_config(["--config", p] + local).diloco_inner_steps, 7)

    def test_schedule_warms_up_then_decays_to_the_floor(self):
        f = train.lr_lambda(total=100, warmup=10, floor=0.1)
        warm = [f(s) for s in range(10)]
        self.assertEqual(warm, sorted(warm))
        self.assertAlmostEqual(f(9), 1.0)
        self.assertAlmostEqual(f(10), 1.0)
        decay = [f(s) for s in range(10, 101)]
        self.assertEqual(decay, sorted(decay, reverse=True))
        self.assertAlmostEqual(f(100), 0.1)


class DistEnvTest(unittest.TestCase):
    def test_nodelist(self):
        self.assertEqual(dist_env.expand_nodelist("nid[005000-005002,005010],gcn7"),
                         ["nid005000", "nid005001", "nid005002", "nid005010", "gcn7"])
        self.assertEqual(dist_env.expand_nodelist("gcn1,gcn2"), ["gcn1", "gcn2"])
        self.assertEqual(dist_env.expand_nodelist("tcn12"), ["tcn12"])

    def test_ranks_from_torchrun_or_srun(self):
        self.assertEqual(dist_env._rank_env({}), (0, 0, 1))
        slurm = {"SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "8"}
        self.assertEqual(dist_env._rank_env(slurm), (5, 1, 8))
        both = dict(slurm, RANK="2", LOCAL_RANK="2", WORLD_SIZE="4")
        self.assertEqual(dist_env._rank_env(both), (2, 2, 4), "torchrun's variables win")

    def test_rendezvous_from_the_job(self):
        env = {"SLURM_JOB_NODELIST": "gcn[12-13]", "SLURM_JOB_ID": "123456"}
        dist_env._rendezvous_env(env, world_size=8)
        self.assertEqual(env["MASTER_ADDR"], "gcn12")
        port = int(env["MASTER_PORT"])
        self.assertEqual(port, 20000 + 123456 % 9000)
        other = {"SLURM_JOB_NODELIST": "gcn12", "SLURM_JOB_ID": "123457"}
        dist_env._rendezvous_env(other, world_size=4)
        self.assertNotEqual(int(other["MASTER_PORT"]), port, "two jobs on one node, two ports")
        kept = {"MASTER_ADDR": "h", "MASTER_PORT": "1234", "SLURM_JOB_ID": "1"}
        dist_env._rendezvous_env(kept, world_size=2)
        self.assertEqual((kept["MASTER_ADDR"], kept["MASTER_PORT"]), ("h", "1234"))
        with self.assertRaisesRegex(RuntimeError, "MASTER_PORT"):
            dist_env._rendezvous_env({"MASTER_ADDR": "h"}, world_size=2)

    @unittest.skipIf(torch.cuda.is_available(), "a GPU is visible")
    def test_eager_pg_init_switch(self):
        self.assertTrue(dist_env.eager_pg_init({}))                      # the default: device_id
        self.assertTrue(dist_env.eager_pg_init({"PWW_EAGER_PG_INIT": "1"}))
        self.assertFalse(dist_env.eager_pg_init({"PWW_EAGER_PG_INIT": "0"}))
        with self.assertRaisesRegex(dist_env.ConfigError, "PWW_EAGER_PG_INIT='yes': use 1 .* or 0"):
            dist_env.eager_pg_init({"PWW_EAGER_PG_INIT": "yes"})

    def test_device_dispatch_on_a_cpu_build(self):
        self.assertEqual(dist_env.detect_accel("auto"), "cpu")
        self.assertEqual(dist_env.detect_accel("cpu"), "cpu")
        for dev in ("cuda", "rocm"):
            with self.assertRaisesRegex(RuntimeError, "--device cpu"):
                dist_env.detect_accel(dev)


def _groups(dist):
    """{group name: ranks} of every process group this process holds (the default one too)."""
    from torch.distributed import distributed_c10d as c10d
    return {c10d._world.pg_names[pg]: dist.get_process_group_ranks(pg) for pg in c10d._world.pg_map}


def groups_worker(manifest, out_dir):
    """Under torchrun, 2 ranks: a federated FSDP2 site up to its first delta, without the
    central services (nothing here calls them); rank 0 writes the groups it found."""
    import torch.distributed as dist
    import checkpoint
    import diloco
    import fedphase
    cfg = train.parse_config(["--model", "qwen3-tiny", "--data", manifest, "--parallel", "fsdp",
                              "--federation", "http://127.0.0.1:9", "--darl-url", "http://127.0.0.1:9",
                              "--site", "groups", "--batch-size", "2", "--eval-windows", "4",
                              "--sharded-checkpoint", "--runs-dir", os.path.join(out_dir, "runs"),
                              "--run-name", "groups"])
    d = dist_env.init_distributed("cpu")
    run = train.open_run_dir(cfg, d, train.settle_config(cfg, d))
    layout = train.build_model(run)
    carrier = fedphase.FedMomCarrier(None, out_dir, "F32")          # site None: no round trip is made
    run.outer = train.make_outer(run, layout, carrier)
    names = [n for n, _ in run.model.named_parameters()]
    params = [p for _, p in run.model.named_parameters()]
    carrier.write_delta(names, params, [p.to_local().detach().clone() for p in params])   # full_tensor()
    if d.rank == 0:
        os.replace(carrier.delta_path, carrier.theta_path)
    dist.barrier()
    carrier.read_theta(names, params, [torch.empty_like(p.to_local()) for p in params])   # distribute_tensor()
    fedphase.on_rank0(lambda: None)
    t = torch.from_numpy(run.windows.batch([d.rank * 2, d.rank * 2 + 1]))
    train.forward_loss(run.model, cfg, (t[:, :-1], t[:, 1:])).backward()
    run.opt.step()
    run.log_eval(1)
    run.save(1)
    federated = _groups(dist)
    # the same count sees the groups DiLoCo's layout makes inside one allocation (k=2: 2 x 1)
    diloco.ReplicaLayout.build(d.world_size, d.rank, 2)
    in_allocation = _groups(dist)
    if d.rank == 0:
        with open(os.path.join(out_dir, "groups.json"), "w") as f:
            json.dump({"federated": federated, "in_allocation": in_allocation, "layout": layout,
                       "checkpoint": checkpoint.latest(run.run_dir)}, f)
    run.log.close()
    dist.barrier()
    dist.destroy_process_group()


def _env():
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def _run(args, ranks):
    """train.py under torchrun (ranks > 1) or as one plain process; returns stdout+stderr."""
    if ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
               "--standalone", "train.py"]
    else:
        cmd = [sys.executable, "train.py"]
    p = subprocess.run(cmd + ["--device", "cpu"] + args, cwd=ROOT, env=_env(), capture_output=True,
                       text=True, timeout=900)
    out = p.stdout + p.stderr
    if p.returncode != 0:
        raise AssertionError(f"train.py exited {p.returncode}:\n{out[-4000:]}")
    return out


def _rows(run_dir, split=None):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    return [r for r in rows if split is None or r["split"] == split]


class TrainRunTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.runs = os.path.join(cls.tmp.name, "runs")
        tok = os.path.join(cls.tmp.name, "tok")
        tc.tokenize(tc.TokenizeConfig(inputs=[], out=tok, seq_len=32, max_files=20,
                                      heldout_windows=16, progress=False))
        cls.manifest = os.path.join(tok, "manifest.json")
        cls.cifar = data.write_fake_cifar(os.path.join(cls.tmp.name, "cifar"), n_train=64, n_test=24, seed=1)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def llm_args(self, name, *extra):
        return ["--model", "qwen3-tiny", "--data", self.manifest, "--batch-size", "8", "--lr", "3e-3",
                "--eval-windows", "16", "--runs-dir", self.runs, "--run-name", name, *extra]

    def test_fsdp_qwen3_tiny_loss_falls_then_resumes_on_one_rank(self):
        tb = os.path.join(self.tmp.name, "tb")
        _run(self.llm_args("fsdp", "--parallel", "fsdp", "--steps", "24", "--log-every", "4",
                           "--eval-every", "12", "--ckpt-every", "12", "--sharded-checkpoint",
                           "--tensorboard", tb), ranks=2)
        run = os.path.join(self.runs, "fsdp")
        trains = _rows(run, "train")
        losses = [r["loss"] for r in trains]
        self.assertEqual(len(losses), 6)
        self.assertLess(losses[-1], losses[0] - 1.0, f"loss did not fall: {losses}")
        per_step = 8 * 2 * 32                                   # batch x ranks x seq_len
        self.assertEqual([r["tokens_total"] for r in trains], [per_step * r["step"] for r in trains])
        self.assertEqual(len({r["incarnation"] for r in _rows(run)}), 1)
        evals = _rows(run, "eval")
        self.assertEqual([r["step"] for r in evals], [0, 12, 24])      # the first held-out loss: before training
        self.assertTrue(evals[0]["first"])
        self.assertLess(evals[2]["loss"], evals[1]["loss"])
        self.assertLess(evals[1]["loss"], evals[0]["loss"])
        self.assertEqual(evals[0]["windows"], 16)
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
        acc = EventAccumulator(tb)
        acc.Reload()
        tags = set(acc.Tags()["scalars"])
        for tag in ("train/loss", "train/lr", "train/tokens_per_s", "train/peak_mem_gib", "eval/loss",
                    "train/loss_by_tokens", "train/tokens_total"):
            self.assertIn(tag, tags)
        self.assertEqual([e.step for e in acc.Scalars("train/loss")], [r["step"] for r in trains])
        self.assertEqual([e.step for e in acc.Scalars("train/loss_by_tokens")], [r["tokens_total"] for r in trains])
        self.assertAlmostEqual(acc.Scalars("train/loss")[-1].value, losses[-1], places=4)
        with open(os.path.join(run, "config.yaml")) as f:
            import yaml
            written = yaml.safe_load(f)
        self.assertEqual(written["provenance"]["world_size"], 2)
        self.assertEqual(len(written["provenance"]["devices"]), 2)
        self.assertTrue(written["provenance"].get("git") or written["provenance"].get("sha256"))
        self.assertEqual((written["seq_len"], written["warmup_steps"]), (32, 1))
        self.assertTrue(os.path.isdir(os.path.join(run, "checkpoints", "step_000000024")))

        # the same run continued by one plain process (world size 2 -> 1, sharded format)
        out = _run(self.llm_args("fsdp", "--parallel", "fsdp", "--steps", "28", "--log-every", "4",
                                 "--resume", "auto", "--sharded-checkpoint"), ranks=1)
        self.assertIn("resumed at step 24", out)
        after = _rows(run, "train")[len(losses):]
        self.assertEqual([r["step"] for r in after], [28])
        self.assertEqual(after[0]["tokens_total"], per_step * 24 + 8 * 1 * 32 * 4)   # kept across the resume
        self.assertNotEqual(after[0]["incarnation"], trains[0]["incarnation"])
        self.assertLess(after[0]["loss"], losses[0] - 1.0, "resumed weights, not a fresh model")

    def test_ddp_resnet18_cifar_end_to_end(self):
        _run(["--model", "resnet18", "--data", self.cifar, "--batch-size", "8", "--epochs", "2",
              "--log-every", "2", "--runs-dir", self.runs, "--run-name", "cifar"], ranks=2)
        run = os.path.join(self.runs, "cifar")
        evals = _rows(run, "eval")
        self.assertEqual([r["epoch"] for r in evals], [1.0, 2.0])     # one eval row per epoch
        self.assertTrue(all(r["images"] == 24 and 0 <= r["acc"] <= 1 for r in evals))
        trains = _rows(run, "train")
        self.assertEqual([r["step"] for r in trains], [2, 4, 6, 8])   # 64 / (2 ranks x 8) per epoch
        self.assertTrue(all(r["img_per_s"] > 0 and r["mfu"] is None for r in trains))
        self.assertLess(trains[-1]["loss"], trains[0]["loss"])
        self.assertTrue(os.path.isfile(os.path.join(run, "checkpoints", "step_000000008.pt")))
        with open(os.path.join(run, "train.log")) as f:
            self.assertIn("resnet18: 11,173,962 parameters", f.read())

    def test_diloco_two_replicas_flush_before_last_eval(self):
        _run(self.llm_args("diloco", "--parallel", "ddp", "--steps", "12", "--log-every", "6",
                           "--diloco-replicas", "2", "--diloco-inner-steps", "5"), ranks=2)
        rows = _rows(os.path.join(self.runs, "diloco"))
        outer = [r for r in rows if r["split"] == "diloco"]
        self.assertEqual([(r["outer_step"], r["step"], r["phase_steps"]) for r in outer],
                         [(1, 5, 5), (2, 10, 5), (3, 12, 2)])
        self.assertTrue(all(0 < r["agreement"] <= 1 + 1e-9 for r in outer))
        self.assertEqual(rows[-1]["split"], "eval")
        self.assertEqual(rows[-2]["split"], "diloco", "the trailing phase is flushed before the eval")


    def test_diloco_phases_measured_in_time_end_on_the_same_step_on_every_rank(self):
        # --diloco-phase-s inside one allocation: 2 replicas of 1 rank; rank 0's clock runs 1000x fast,
        # so it judges every step to overrun the 0.3 s and ends each phase after one step; rank 1's
        # clock says otherwise (by itself it would train on, and the outer all-reduce would hang)
        env = {**_env(), testhooks.PHASE_CLOCK_RATE_ENV: "0:1000"}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", "train.py",
               "--device", "cpu", *self.llm_args("timed", "--parallel", "ddp", "--steps", "12", "--log-every", "6",
                                                  "--diloco-replicas", "2", "--diloco-phase-s", "0.3")]
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        self.assertEqual(p.returncode, 0, (p.stdout + p.stderr)[-4000:])
        outer = [r for r in _rows(os.path.join(self.runs, "timed")) if r["split"] == "diloco"]
        self.assertEqual([(r["outer_step"], r["phase_steps"], r.get("ended_by")) for r in outer],
                         [(i, 1, "clock") for i in range(1, 13)])      # never H's default 100 steps


class FederationCorpusTest(unittest.TestCase):
    def test_a_corpus_with_no_training_windows_stops_before_any_call(self):
        with tempfile.TemporaryDirectory() as tmp:
            tok = os.path.join(tmp, "tok")
            m = tc.tokenize(tc.TokenizeConfig(inputs=[], out=tok, seq_len=32, max_files=2, max_bytes=4000,
                                              heldout_windows=8, progress=False))
            manifest = os.path.join(tok, "manifest.json")
            with open(manifest) as f:
                meta = json.load(f)
            meta["heldout_windows"] = m["num_windows"]          # every window held out
            with open(manifest, "w") as f:
                json.dump(meta, f)
            self.assertEqual(data.TokenWindows(manifest).train_windows, 0)
            # nothing listens on these ports: a run that got as far as a call would retry for 900 s
            p = subprocess.run([sys.executable, "train.py", "--device", "cpu", "--model", "qwen3-tiny",
                                "--data", manifest, "--federation", "http://127.0.0.1:9",
                                "--darl-url", "http://127.0.0.1:9", "--site", "lumi",
                                "--runs-dir", os.path.join(tmp, "runs")],
                               cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        errors = [line for line in p.stderr.splitlines() if line.startswith("train.py: error:")]
        self.assertEqual(len(errors), 1, p.stderr)
        self.assertIn("no training windows", errors[0])
        self.assertIn("--heldout-windows", errors[0])
        self.assertNotIn("retrying", p.stdout + p.stderr)

    def test_another_corpus_than_the_coordinators_is_a_flag_error(self):
        """fedsite.CorpusMismatch (rank 0's connect) is reported like a ConfigError: one
        line naming --data and the fix, exit 2, before any call to FedMom."""
        with tempfile.TemporaryDirectory() as tmp:
            manifests = []
            for name, files in (("ours", 2), ("theirs", 3)):
                tc.tokenize(tc.TokenizeConfig(inputs=[], out=os.path.join(tmp, name), seq_len=32, max_files=files,
                                              max_bytes=8000, heldout_windows=8, progress=False))
                manifests.append(os.path.join(tmp, name, "manifest.json"))
            darl = subprocess.Popen([sys.executable, "darl_server.py", "--manifest", manifests[1], "--port", "0",
                                     "--state-dir", os.path.join(tmp, "central")], cwd=ROOT, env=_env(),
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            try:
                url, _ = listening_url(darl)
                # nothing listens at FedMom's port: a run that got that far would retry for 900 s
                p = subprocess.run([sys.executable, "train.py", "--device", "cpu", "--model", "qwen3-tiny",
                                    "--data", manifests[0], "--federation", "http://127.0.0.1:9",
                                    "--darl-url", url, "--site", "lumi", "--eval-windows", "8",
                                    "--runs-dir", os.path.join(tmp, "runs")],
                                   cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
            finally:
                darl.kill()
                darl.wait(timeout=60)
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        errors = [line for line in p.stderr.splitlines() if line.startswith("train.py: error:")]
        self.assertEqual(len(errors), 1, p.stderr)
        self.assertIn("--data", errors[0])
        self.assertIn("same digest", errors[0])
        self.assertNotIn("Traceback", p.stderr)


class ProcessGroupTest(unittest.TestCase):
    def test_a_federated_fsdp_site_holds_only_the_default_group(self):
        """A group made with new_group() can hang its first collective on LUMI's torch 2.10 +
        ROCm 7.0 stack at >= 4 nodes (RUNBOOK.md section 2): a federated site (replicas = 1)
        must make none. FSDP2's mesh is built on the default group (DeviceMesh.from_group)."""
        with tempfile.TemporaryDirectory() as tmp:
            tok = os.path.join(tmp, "tok")
            tc.tokenize(tc.TokenizeConfig(inputs=[], out=tok, seq_len=32, max_files=2, max_bytes=8000,
                                          heldout_windows=8, progress=False))
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                   os.path.join("tests", "test_train.py"), "groups-worker", os.path.join(tok, "manifest.json"), tmp]
            p = subprocess.run(cmd, cwd=ROOT, env=harness.child_env(), capture_output=True, text=True, timeout=600)
            self.assertEqual(p.returncode, 0, (p.stdout + p.stderr)[-4000:])
            with open(os.path.join(tmp, "groups.json")) as f:
                found = json.load(f)
        self.assertIsNone(found["layout"], "replicas = 1 builds no DiLoCo layout")
        self.assertIsNotNone(found["checkpoint"], "the sharded checkpoint was written")
        self.assertEqual(list(found["federated"].values()), [[0, 1]],
                         f"a federated site holds a group beyond the default one: {found['federated']}")
        self.assertGreater(len(found["in_allocation"]), 1,
                           "the count must see the groups DiLoCo's layout makes at replicas > 1")


class FederationFlagTest(unittest.TestCase):
    def test_an_outer_step_flag_with_federation_exits_2_naming_where_it_is_set(self):
        """The aggregator owns the outer step: --diloco-outer-lr on a site would do nothing."""
        with tempfile.TemporaryDirectory() as tmp:
            # nothing listens on these ports: a run that got as far as a call would retry for 900 s
            p = subprocess.run([sys.executable, "train.py", "--device", "cpu", "--model", "qwen3-tiny",
                                "--data", os.path.join(tmp, "manifest.json"), "--federation", "http://127.0.0.1:9",
                                "--darl-url", "http://127.0.0.1:9", "--site", "lumi", "--diloco-outer-lr", "0.5",
                                "--runs-dir", os.path.join(tmp, "runs")],
                               cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
        self.assertEqual(p.returncode, 2, p.stdout + p.stderr)
        errors = [line for line in p.stderr.splitlines() if line.startswith("train.py: error:")]
        self.assertEqual(len(errors), 1, p.stderr)
        self.assertIn("--diloco-outer-lr 0.5 with --federation", errors[0])
        self.assertIn("fedmom_server.py --outer-lr", errors[0])
        self.assertNotIn("Traceback", p.stderr)


class ModelTest(unittest.TestCase):
    def test_sizes_and_flops(self):
        # torchtitan's 8B flavor with a 128k tokenizer padded to 131,328 rows (untied head)
        m = models.build_model("qwen3-8B", vocab_size=131_300, seq_len=2048)
        self.assertEqual(m.model_args.vocab_size, 131_328)
        self.assertEqual(models.count_params(m), 8_021_914_624)
        self.assertEqual(next(m.parameters()).device.type, "meta")
        tiny = models.build_model("qwen3-tiny", vocab_size=258, seq_len=32)
        self.assertEqual(tiny.model_args.vocab_size, 320)
        self.assertIs(tiny.output.weight, tiny.tok_embeddings.weight)
        n = models.count_params(tiny)
        a = tiny.model_args
        self.assertEqual(models.llm_flops_per_token(a, n),
                         6 * n + 6 * a.n_layers * a.n_heads * 2 * a.head_dim * 32)
        # ResNet-18 (CIFAR stem): 0.56 G multiply-adds per 32x32 image forward
        self.assertAlmostEqual(models.resnet_flops_per_image("resnet18") / 6 / 1e9, 0.555, places=2)


if __name__ == "__main__":
    if sys.argv[1:2] == ["groups-worker"]:
        groups_worker(*sys.argv[2:4])
    else:
        unittest.main()
