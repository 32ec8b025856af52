"""Activation without touching the launch script: the .pth hook, the opt-out, explicit enable().

The launch script below is a user's: its own tiny model and data, the stock Trainer, a YAML.
It never imports mindmon.
"""
import os
import re
import subprocess
import sys
import textwrap

import yaml

LAUNCH = textwrap.dedent('''
    import sys
    import numpy as np
    import mindspore as ms
    import mindspore.dataset as ds
    from mindspore import nn, ops, Parameter, Tensor
    ms.set_context(mode=ms.PYNATIVE_MODE, device_target="CPU", pynative_synchronize=True)
    {prelude}
    from mindformers.pynative.trainer import Trainer
    from types import SimpleNamespace

    class TinyLM(nn.Cell):
        def __init__(self):
            super().__init__()
            self.embed = Parameter(Tensor(np.random.default_rng(0).normal(0, 0.1, (16, 8)).astype(np.float32)), name="embed")
            self.head = nn.Dense(8, 16)
        def construct(self, input_ids, labels):
            logits = self.head(ops.gather(self.embed, input_ids.reshape(-1), 0))
            one_hot = ops.one_hot(labels.reshape(-1), 16, Tensor(1.0, ms.float32), Tensor(0.0, ms.float32))
            return (-(ops.log_softmax(logits, -1) * one_hot).sum(-1).mean(),)
        def get_gpt_transformer_config(self):
            return SimpleNamespace(seq_length=4, hidden_size=8, num_layers=1, num_attention_heads=1,
                num_query_groups=1, kv_channels=8, ffn_hidden_size=8, vocab_size=16, num_moe_experts=None,
                moe_router_topk=1, moe_ffn_hidden_size=8, moe_layer_freq=1, moe_shared_expert_intermediate_size=None,
                mtp_num_layers=None, multi_latent_attention=False, hidden_act="gelu", q_lora_rank=None,
                kv_lora_rank=None, qk_head_dim=8, qk_pos_emb_head_dim=0, v_head_dim=8)

    data = (np.arange(2 * 8 * 5).reshape(-1, 5) % 16).astype(np.int32)
    dataset = ds.NumpySlicesDataset((data[:, :-1], data[:, 1:]), column_names=["input_ids", "labels"],
                                    shuffle=False).batch(4, drop_remainder=True)
    Trainer(config=sys.argv[1], model=TinyLM(), train_dataset=dataset).train()
    print("mindmon loaded:", "mindmon" in sys.modules)
''')

STOCK_COMPATIBLE = {  # keys MindFormers 1.9.0 itself accepts (bools), so the opt-out run trains too
    "training": {"steps": 2, "local_batch_size": 2, "global_batch_size": 4},
    "model": {"model_type": "tiny", "architectures": "TinyLM"},
    "optimizer": {"type": "AdamW"},
    "lr_scheduler": {"type": "ConstantWarmUpLR", "learning_rate": 0.01, "warmup_steps": 0},
    "train_dataset": {"dataloader": {"type": "MindDataset"}},
    "checkpoint": {"enable_save": False},
    "monitor": {"train_state": {"local_loss": True, "device_loss": True}},
}


def _run(tmp_path, prelude="", env_extra=None, config=STOCK_COMPATIBLE):
    script = tmp_path / "launch.py"
    script.write_text(LAUNCH.format(prelude=prelude))
    yaml_path = tmp_path / "train.yaml"
    yaml_path.write_text(yaml.safe_dump(config))
    env = {k: v for k, v in os.environ.items() if k not in ("MINDMON_AUTOLOAD", "LOG_MF_PATH")}
    env["LOG_MF_PATH"] = str(tmp_path / "log")
    env.update(env_extra or {})
    result = subprocess.run([sys.executable, str(script), str(yaml_path)], capture_output=True, text=True,
                            env=env, cwd=tmp_path, timeout=300)
    log_file = tmp_path / "log" / "rank_0" / "info.log"
    log = log_file.read_text() if log_file.exists() else ""
    return result, log


def test_pth_hook_does_not_import_frameworks_at_startup():
    code = "import sys; print('mindmon' in sys.modules, 'mindspore' in sys.modules, 'mindformers' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env={k: v for k, v in os.environ.items() if k != "MINDMON_AUTOLOAD"})
    assert result.stdout.split() == ["True", "False", "False"]


def test_autoload_attaches_and_monitors(tmp_path):
    result, log = _run(tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert log.count("mindmon: attached to the MindFormers 1.9.0 PyNative Trainer") == 1
    assert len(re.findall(r'\{ "micro_step": [01], "local_loss": [\d.]+ \}', log)) == 2 * 2
    assert len(re.findall(r'\{ "step": [12], "device_loss": [\d.]+ \}', log)) == 2
    # the documented default output dir, relative to the working directory
    assert (tmp_path / "output" / "monitor" / "rank_0" / "metrics.jsonl").exists()


def test_opt_out_prints_nothing(tmp_path):
    result, log = _run(tmp_path, env_extra={"MINDMON_AUTOLOAD": "0"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert "mindmon loaded: False" in result.stdout
    assert "step:[    2/    2]" in log  # the stock run trained
    assert "mindmon" not in log and '"micro_step"' not in log
    assert not (tmp_path / "output" / "monitor").exists()


def test_opt_out_leaves_the_documented_yaml_to_the_stock_trainer(tmp_path):
    config = dict(STOCK_COMPATIBLE, monitor={"train_state": {"local_norm": ["embed"]}})
    result, _ = _run(tmp_path, env_extra={"MINDMON_AUTOLOAD": "0"}, config=config)
    assert result.returncode != 0 and "local_norm" in result.stderr


def test_explicit_enable_is_idempotent(tmp_path):
    prelude = "import mindmon.integrations.mindformers as mm; mm.enable(); mm.enable()"
    result, log = _run(tmp_path, prelude=prelude, env_extra={"MINDMON_AUTOLOAD": "0"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert log.count("mindmon: attached") == 1
    assert len(re.findall(r'\{ "step": [12], "device_loss": [\d.]+ \}', log)) == 2


def test_unsupported_version_is_a_clear_error():
    code = textwrap.dedent('''
        import mindformers
        mindformers.__version__ = "3.0.0"
        import mindmon.integrations.mindformers as mm
        try:
            mm.enable()
        except mm.IntegrationError as error:
            print("ERROR:", error)
    ''')
    env = dict(os.environ, MINDMON_AUTOLOAD="0")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert "ERROR: MindFormers 3.0.0 is not supported" in result.stdout
    assert "MINDMON_AUTOLOAD=0" in result.stdout
