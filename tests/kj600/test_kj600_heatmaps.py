"""kj600's recipe with ur_distribution: the update/ratio heat maps as TensorBoard images, read back with
TensorBoard's reader (needs tensorboardX: not in the MindSpore 2.7 environment)."""
import glob
import json

import numpy as np

from tests.support.msprobe_reference import K, NAMES, STEPS, make_model, make_optimizer, train_steps


def test_kj600_heat_maps_in_tensorboard(tmp_path, monkeypatch):
    """kj600's recipe with ur_distribution: one heat-map image per parameter, vector and step after the
    first, read back with TensorBoard's reader; the last image is the drawing of every step's counts, each
    column adding up to the parameter's size (the counts themselves: test_tensor_stats_optimizer_diagnostics.py)."""
    from io import BytesIO

    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from mindmon.kj600.module_hook import TrainerMon as Kj600TrainerMon
    from mindmon.sinks.heatmap import draw

    monkeypatch.setenv("KJ600_OUTPUT_DIR", str(tmp_path / "kj600"))
    path = tmp_path / "kj600_config.json"
    path.write_text(json.dumps({"targets": {}, "ur_distribution": True, "ops": ["norm"]}))
    model = make_model()
    model.set_train(True)
    optimizer = make_optimizer("Adam", model.trainable_params())
    monitor = Kj600TrainerMon(str(path), params_have_main_grad=False)
    Kj600TrainerMon.set_wrapped_optimizer(optimizer)
    monitor.hook_modules(model, K)
    train_steps(model, optimizer)
    monitor.close()
    (events,) = glob.glob(str(tmp_path / "kj600" / "*-rank0-*"))
    accumulator = EventAccumulator(events, size_guidance={"images": 0})
    accumulator.Reload()
    tags = accumulator.Tags()
    # msprobe's spelling: the heat map under the bare tag name, the ops as `<tag name>_<op>`
    expected = {f"0:{name}/rank0/{kind}" for kind in ("adam_update", "adam_ratio") for name in NAMES}
    assert set(tags["images"]) == expected
    assert not any("histogram" in tag for tag in tags["scalars"])   # counts are images, not 33 curves
    assert set(tags["scalars"]) == {f"{tag}_norm" for tag in expected}
    for tag in expected:
        images = accumulator.Images(tag)
        assert [image.step for image in images] == list(range(1, STEPS))   # 0-based steps; none at the first
        picture = np.asarray(Image.open(BytesIO(images[-1].encoded_image_string)).convert("RGB"))
        assert picture.shape == (images[-1].height, images[-1].width, 3) and picture.std() > 0
    # The last image is the drawing of the counts of every step so far (drawing is deterministic).
    sink = monitor.sink
    counts = np.array(sink.heatmaps.columns[("adam_update_histogram", "fc1.weight")], dtype=np.float64).T
    assert counts.shape == (33, STEPS - 1) and (counts.sum(axis=0) == 32).all()   # fc1.weight: 8 x 4
    last = accumulator.Images("0:fc1.weight/rank0/adam_update")[-1]
    drawn = draw(counts, list(range(1, STEPS)), "fc1.weight: adam_update_histogram")
    assert np.array_equal(np.asarray(Image.open(BytesIO(last.encoded_image_string)).convert("RGB")), drawn)


def kj600_scalars(tmp_path, monkeypatch, config, order):
    """kj600's recipe in `order` ("hook_first": its README's, "optimizer_first", "no_optimizer"); the
    TensorBoard scalars {tag: {step: value}} and the log."""
    import logging

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from mindmon.kj600.module_hook import TrainerMon as Kj600TrainerMon

    monkeypatch.setenv("KJ600_OUTPUT_DIR", str(tmp_path / order))
    path = tmp_path / f"{order}.json"
    path.write_text(json.dumps(config))
    model = make_model()
    model.set_train(True)
    optimizer = make_optimizer("AdamWeightDecay", model.trainable_params())
    monitor = Kj600TrainerMon(str(path), params_have_main_grad=False)
    logger = logging.getLogger("mindmon")
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        if order == "optimizer_first":
            Kj600TrainerMon.set_wrapped_optimizer(optimizer)
        monitor.hook_modules(model, K)
        if order == "hook_first":
            Kj600TrainerMon.set_wrapped_optimizer(optimizer)
        train_steps(model, optimizer)
        monitor.close()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    (events,) = glob.glob(str(tmp_path / order / "*-rank0-*"))
    accumulator = EventAccumulator(events)
    accumulator.Reload()
    return {tag: {e.step: e.value for e in accumulator.Scalars(tag)} for tag in accumulator.Tags()["scalars"]}, lines


def test_kj600_recipe_in_either_order_and_gradients_without_an_optimizer(tmp_path, monkeypatch):
    """hook_modules then set_wrapped_optimizer (kj600's README) gives what the reverse order gives, every value
    numpy's; with no optimizer at all, wg_distribution hooks the model's parameters and a step is K forwards."""
    from tests.support.msprobe_reference import reference_run, statistic

    config = {"targets": {"fc1": {"input": "tensor", "output": "tensor"}}, "xy_distribution": True,
              "wg_distribution": True, "mv_distribution": True, "ops": ["norm", "max"]}
    first, log_first = kj600_scalars(tmp_path, monkeypatch, config, "hook_first")
    second, _ = kj600_scalars(tmp_path, monkeypatch, config, "optimizer_first")
    assert first == second
    reference = reference_run()
    assert not any("fc2" in tag for tag in first)   # targets select fc1's parameters and cell only
    for kind, point in (("grad_unreduced", "acc_grad"), ("grad_reduced", "post_grad"), ("exp_avg", "exp_avg"),
                        ("exp_avg_sq", "exp_avg_sq")):
        for name in ("fc1.weight", "fc1.bias"):
            for op in ("norm", "max"):
                points = first[f"0:{name}/rank0/{point}_{op}"]
                assert sorted(points) == list(range(STEPS)), (kind, name)
                for step, value in points.items():
                    want = statistic(reference[(kind, step, None, name)], op)
                    assert abs(value - want) <= 1e-5 * abs(want) + 1e-7, (kind, name, op, step, value, want)
    assert "> fc1 is monitored successfully" in log_first and "> 1 out of 3 modules are monitored." in log_first
    assert any("mv_distribution wait for TrainerMon.set_wrapped_optimizer" in line for line in log_first)
    alone, _ = kj600_scalars(tmp_path, monkeypatch, {"wg_distribution": True, "ops": ["norm"]}, "no_optimizer")
    assert set(alone) == {f"0:{name}/rank0/acc_grad_norm" for name in NAMES}
    for tag, points in alone.items():
        name = tag.split("/")[0][2:]
        assert sorted(points) == list(range(STEPS))
        for step, value in points.items():
            want = statistic(reference[("grad_unreduced", step, None, name)], "norm")
            assert abs(value - want) <= 1e-5 * want, (tag, step, value, want)
