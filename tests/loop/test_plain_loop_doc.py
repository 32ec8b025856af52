"""docs/plain-loop.md runs as written: its python blocks, in order, in a fresh process and an empty
folder. What the page promises (the log lines, the step records, the report's clipping threshold) is
checked against numpy: a float64 forward of the page's model from the same initial weights, and its
gradient by central differences."""
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.support.jsonl import read_jsonl

pytestmark = pytest.mark.ms27   # the page runs on both ends of the supported MindSpore range

PAGE = Path(__file__).resolve().parents[2] / "docs" / "plain-loop.md"
NOT_RUN = "<!-- not run"
BLOCK = re.compile(r"(?P<before>[^\n]*)\n```python\n(?P<code>.*?)```", re.S)


def page_blocks():
    """The page's python blocks, in order, without the ones marked `<!-- not run: why -->`."""
    text = PAGE.read_text(encoding="utf-8")
    return [m["code"] for m in BLOCK.finditer(text) if not m["before"].startswith(NOT_RUN)]


@pytest.fixture(scope="module")
def page_run(tmp_path_factory):
    """(folder, stderr) of the page's blocks run as one script in an empty folder."""
    folder = tmp_path_factory.mktemp("plain_loop_page")
    script = folder / "page.py"
    script.write_text("\n".join(page_blocks()), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "LOG_MF_PATH"}
    result = subprocess.run([sys.executable, str(script)], cwd=folder, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return folder, result.stderr


@pytest.fixture(scope="module")
def model_block(tmp_path_factory):
    """The page's first block (the model and the data), run in a fresh process as the user runs it (it
    sets the device, which a process that already ran MindSpore cannot): its initial weights and batch."""
    folder = tmp_path_factory.mktemp("plain_loop_model")
    dump = (f"\nnp.savez({str(folder / 'initial.npz')!r}, tokens=tokens.asnumpy(), labels=labels.asnumpy(), "
            "heads=HEADS, **{'weight_' + p.name: p.asnumpy() for p in net.trainable_params()})\n")
    (folder / "model.py").write_text(page_blocks()[0] + dump, encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k != "LOG_MF_PATH"}
    result = subprocess.run([sys.executable, "model.py"], cwd=folder, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    with np.load(folder / "initial.npz") as saved:
        return {"weights": {k[len("weight_"):]: saved[k].astype(np.float64) for k in saved.files
                            if k.startswith("weight_")},
                "tokens": saved["tokens"], "labels": saved["labels"], "heads": int(saved["heads"])}


def numpy_forward(weights, tokens, labels, heads):
    """(mean next-token loss, per-head max of the causal QK^T/sqrt(d)) of the page's TinyLM, float64."""
    embedding, qkv, head = weights["embedding"], weights["qkv"], weights["head"]
    batch, seq = tokens.shape
    hidden = embedding.shape[1]
    x = embedding[tokens]
    q, k, v = (part.reshape(batch, seq, heads, hidden // heads).transpose(0, 2, 1, 3)
               for part in np.split(x @ qkv, 3, axis=-1))
    scores = q @ k.transpose(0, 1, 3, 2) / np.sqrt(hidden // heads)
    future = np.triu(np.ones((seq, seq), bool), k=1)
    masked = np.where(future, -np.inf, scores)
    weights_ = np.exp(masked - masked.max(-1, keepdims=True))
    weights_ /= weights_.sum(-1, keepdims=True)
    x = x + (weights_ @ v).transpose(0, 2, 1, 3).reshape(batch, seq, hidden)
    logits = (x @ head).reshape(-1, head.shape[1])
    logits = logits - logits.max(-1, keepdims=True)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    loss = -log_probs[np.arange(labels.size), labels.reshape(-1)].mean()
    return loss, masked.transpose(1, 0, 2, 3).reshape(heads, -1).max(axis=1)


def step_one_reference(namespace, micro_steps):
    """Step 1 from the initial weights: the micro-batch losses, the per-head max logit over the step,
    and the gradient of mean_k(loss_k) per parameter (central differences, float64)."""
    weights, tokens, labels = namespace["weights"], namespace["tokens"], namespace["labels"]
    heads, size = namespace["heads"], len(tokens) // micro_steps
    pieces = [(tokens[i * size:(i + 1) * size], labels[i * size:(i + 1) * size]) for i in range(micro_steps)]

    def step_loss(w):
        return np.mean([numpy_forward(w, t, y, heads)[0] for t, y in pieces])

    losses, maxima = zip(*(numpy_forward(weights, t, y, heads) for t, y in pieces))
    gradients = {}
    for name, value in weights.items():
        gradient = np.zeros_like(value)
        for index in np.ndindex(value.shape):
            for sign in (1, -1):
                moved = {**weights, name: value.copy()}
                moved[name][index] += sign * 1e-6
                gradient[index] += sign * step_loss(moved) / 2e-6
        gradients[name] = gradient
    return list(losses), np.max(maxima, axis=0), gradients


def test_the_page_runs_and_its_numbers_are_numpys(page_run, model_block):
    folder, stderr = page_run
    rows = read_jsonl(folder / "output" / "monitor" / "rank_0" / "metrics.jsonl")
    losses, max_logits, gradients = step_one_reference(model_block, micro_steps=2)
    first = {(r["kind"], r["name"], r["micro_step"]): r["value"] for r in rows if r["step"] == 1}
    assert first[("local_loss", "loss", 0)] == pytest.approx(losses[0], rel=1e-5)
    assert first[("loss", "loss", None)] == pytest.approx(np.mean(losses), rel=1e-5)
    assert first[("device_loss", "loss", None)] == pytest.approx(np.mean(losses), rel=1e-5)
    # Names come from the model, in the optimizer's order, and each norm is that parameter's.
    for name, gradient in gradients.items():
        assert first[("device_norm", name, None)] == pytest.approx(np.linalg.norm(gradient), rel=1e-4)
    global_norm = np.sqrt(sum(np.sum(g ** 2) for g in gradients.values()))
    assert global_norm > 1.0   # so step 1 was clipped: the page's max_norm is 1.0
    assert first[("grad_norm", "global", None)] == pytest.approx(global_norm, rel=1e-4)
    np.testing.assert_allclose(first[("max_attention_logit", "core_attention.max_logits_val", None)], max_logits,
                               rtol=1e-5)
    # The step values of every step: the page's warm-up schedule, the samples, the clipping threshold.
    per_step = {(r["kind"], r["step"]): r["value"] for r in rows if r["micro_step"] is None}
    for step in (1, 2, 3):
        assert per_step[("learning_rate", step)] == pytest.approx(1e-2 * min(1.0, step / 2), rel=1e-12)
        assert per_step[("samples", step)] == 8 * step
        assert per_step[("max_norm", step)] == 1.0
    # The promised log lines, on stderr (logging.basicConfig), with numpy's numbers.
    lines = stderr.splitlines()
    for line in ('INFO mindmon: { "step": 1, "micro_step": 0 }', '{ "step": 3, "micro_step": 1 }', '{ "step": 3 }'):
        assert line in lines
    device_loss = next(line for line in lines if line.startswith('{ "step": 1, "device_loss": '))
    assert float(device_loss.split(": ")[-1].rstrip(" }")) == pytest.approx(np.mean(losses), abs=1e-6)
    head_line = next(line for line in lines if line.startswith(
        "step:[    1/    3] max_attention_logit/core_attention.max_logits_val: ["))
    np.testing.assert_allclose([float(v) for v in head_line.split(": [")[1].rstrip("]").split(", ")], max_logits,
                               rtol=5e-4)
    assert (folder / "output" / "report.html").stat().st_size > 10_000


def test_the_report_marks_the_pages_clipping_threshold(page_run):
    from mindmon.analysis.report import THRESHOLD_LABEL, loss_plot
    from mindmon.formats.jsonl import read_records

    folder, _ = page_run
    figure = loss_plot(read_records(str(folder / "output" / "monitor" / "rank_0" / "metrics.jsonl")), 2)
    threshold = [line for ax in figure.axes for line in ax.get_lines() if line.get_label() == THRESHOLD_LABEL]
    assert len(threshold) == 1
    assert list(threshold[0].get_xdata()) == [1, 2, 3] and list(threshold[0].get_ydata()) == [1.0, 1.0, 1.0]
