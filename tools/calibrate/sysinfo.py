"""What a profile says about the machine it was measured on."""

from __future__ import annotations

import platform
from pathlib import Path

import torch


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def gpu() -> dict[str, str] | None:
    """{"name", "uuid"} of the current CUDA device, or None without one."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    uuid = str(getattr(props, "uuid", "") or "")
    return {"name": props.name, "uuid": uuid if uuid.startswith("GPU-") or not uuid else f"GPU-{uuid}"}
