"""The dense peak FLOP/s of a device for a dtype, from a table with a source for every figure, or from
`peak_tflops` in the configuration (docs/flops.md, "Peaks").

Only figures a vendor publishes are in the table, dense (without 2:4 sparsity: the H100 datasheet
prints only the sparse Tensor Core figures and gives the dense ones as half of them). A device or dtype
that is not in it has no peak, and so no MFU: never a guessed one.
"""
import logging
import re
from dataclasses import dataclass
from typing import Dict, Optional, Tuple

_V100 = "NVIDIA V100 Tensor Core GPU datasheet (https://www.nvidia.com/en-us/data-center/v100/)"
_A100 = "NVIDIA A100 Tensor Core GPU datasheet (https://www.nvidia.com/en-us/data-center/a100/)"
_H100 = "NVIDIA H100 Tensor Core GPU datasheet (https://www.nvidia.com/en-us/data-center/h100/)"
_L40S = "NVIDIA L40S GPU datasheet (https://www.nvidia.com/en-us/data-center/l40s/)"
_ASCEND_910 = ("Huawei, Ascend 910 launch, 23 Aug 2019 "
               "(https://www.huawei.com/en/news/2019/8/huawei-ascend-910-most-powerful-ai-processor)")
_A800 = "NVIDIA A800 40GB Active datasheet (https://www.nvidia.com/en-us/design-visualization/a800/)"
# Devices mindmon recognises by name but for which no vendor datasheet giving the device's own dense figure
# was found: their rows have no figures (no MFU without monitor.speed.peak_tflops), and say why.
_NO_DATASHEET = "no vendor datasheet with a per-device dense figure was found"
_ASCEND_910B = f"{_NO_DATASHEET}: Huawei's product pages give Atlas servers' and cards' figures, not the SoCs'"
_ASCEND_910C = (f"{_NO_DATASHEET}: Huawei gives the Atlas A3 systems' totals, and MindSpore sees each of a 910C's "
                f"two dies as one device")
_NVIDIA_CHINA = f"{_NO_DATASHEET} on nvidia.com for this China-market part"


@dataclass(frozen=True)
class Device:
    """One row of the table: `names` matches the device name MindSpore reports (upper case); `tflops` the
    dense figure per dtype, empty for a device recognised without a citable figure; `source` where the
    figures come from, or why there are none."""

    label: str
    names: str
    tflops: Dict[str, float]
    source: str


# In match order: the more specific names first (an H100 PCIe also matches "H100").
DEVICES: Tuple[Device, ...] = (
    Device("NVIDIA V100 SXM2", r"V100-SXM", {"float16": 125.0, "float32": 15.7}, _V100),
    Device("NVIDIA V100 PCIe", r"V100-PCIE", {"float16": 112.0, "float32": 14.0}, _V100),
    Device("NVIDIA A100", r"\bA100\b", {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5}, _A100),
    Device("NVIDIA H100 PCIe", r"\bH100 PCIE\b", {"bfloat16": 756.5, "float16": 756.5, "float32": 51.0}, _H100),
    Device("NVIDIA H100 NVL", r"\bH100 NVL\b", {"bfloat16": 835.5, "float16": 835.5, "float32": 60.0}, _H100),
    Device("NVIDIA H100 SXM", r"\bH100\b", {"bfloat16": 989.5, "float16": 989.5, "float32": 67.0}, _H100),
    Device("NVIDIA L40S", r"\bL40S\b", {"bfloat16": 362.05, "float16": 362.05, "float32": 91.6}, _L40S),
    Device("Ascend 910 (910A)", r"^ASCEND910A$", {"float16": 256.0}, _ASCEND_910),
    # The SoC names as CANN spells them (its soc_version values, the form get_device_name gives on Ascend):
    # Ascend910B1..B4 (and B2C, B4-1); a 910C die is Ascend910_93xx (9391, 9392, 9381, 9382, 9372, 9362).
    Device("Ascend 910B", r"^ASCEND910B[1-4]", {}, _ASCEND_910B),
    Device("Ascend 910C (one die)", r"^ASCEND910_93\d\d$", {}, _ASCEND_910C),
    # The CUDA device names (cudaDeviceProp.name) lose their "NVIDIA " prefix in find_device.
    Device("NVIDIA A800 40GB Active", r"\bA800 40GB ACTIVE\b", {"bfloat16": 312.0, "float16": 312.0, "float32": 19.5},
           _A800),
    Device("NVIDIA A800 (SXM4, PCIe)", r"\bA800\b", {}, _NVIDIA_CHINA),
    Device("NVIDIA H800", r"\bH800\b", {}, _NVIDIA_CHINA),
    Device("NVIDIA H20", r"\bH20\b", {}, _NVIDIA_CHINA),
)


@dataclass(frozen=True)
class Peak:
    """`flops_per_second` (None: unknown) and where it comes from, written next to every MFU."""

    flops_per_second: Optional[float]
    source: str


def dtype_key(dtype) -> str:
    """'bfloat16', 'float16', 'float32', ... from a MindSpore dtype or its name ('bf16', 'fp16' too)."""
    name = str(dtype).lower().replace("mindspore.", "")
    return {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}.get(
        name, name)


def find_device(device: Optional[str]) -> Optional[Device]:
    """The table's row for a device name as MindSpore reports it (`detect_device`), or None."""
    if not device:
        return None
    name = re.sub(r"^(NVIDIA|TESLA)\s+", "", device.strip().upper())
    return next((row for row in DEVICES if re.search(row.names, name)), None)


def peak_flops(device: Optional[str], dtype, override_tflops: Optional[float] = None) -> Peak:
    """The dense peak of `device` for matmuls in `dtype`: `override_tflops` (the section's
    `peak_tflops`) when given, else the table's figure, else no peak."""
    if override_tflops is not None:
        return Peak(float(override_tflops) * 1e12, f"monitor.speed.peak_tflops: {override_tflops} TFLOP/s")
    key = dtype_key(dtype)
    row = find_device(device)
    if row is None:
        return Peak(None, f"no peak for device {device!r} in mindmon's table (docs/flops.md)")
    if not row.tflops:
        return Peak(None, f"no peak for {row.label} ({device}) in mindmon's table: {row.source} (docs/flops.md)")
    if key not in row.tflops:
        return Peak(None, f"no peak for {row.label} in {key} in mindmon's table (docs/flops.md)")
    return Peak(row.tflops[key] * 1e12, f"{row.label} {key} dense: {row.tflops[key]} TFLOP/s ({row.source})")


def detect_device() -> Optional[str]:
    """The running device's name: MindSpore's device_target, and for GPU and Ascend the name the driver
    gives (e.g. 'NVIDIA A100-SXM4-80GB', 'Ascend910B2'); None when MindSpore cannot tell."""
    import mindspore as ms

    target = ms.get_context("device_target")
    if target == "CPU":
        return "CPU"
    try:
        return ms.hal.get_device_name(ms.get_context("device_id"), target)
    except Exception:   # an uninitialised device or a MindSpore without hal: the target is all we know
        return target


class PeakFinder:
    """`peak_flops` that says once per device and dtype when there is no peak (and so no MFU).

    Example:
        finder = PeakFinder()
        peak = finder.find(detect_device(), ms.bfloat16, section.peak_tflops)
        mfu(step.useful, seconds, peak.flops_per_second)   # None on an unknown device
    """

    def __init__(self, logger: Optional[logging.Logger] = None):
        self.logger = logger or logging.getLogger("mindmon")
        self._said = set()

    def find(self, device: Optional[str], dtype, override_tflops: Optional[float] = None) -> Peak:
        """The peak, as `peak_flops`; an unknown one is logged the first time only."""
        peak = peak_flops(device, dtype, override_tflops)
        key = (device, dtype_key(dtype))
        if peak.flops_per_second is None and key not in self._said:
            self._said.add(key)
            self.logger.warning(f"mindmon: {peak.source}; no MFU is reported. Allowed: set "
                                f"monitor.speed.peak_tflops to the device's dense TFLOP/s for {key[1]}")
        return peak
