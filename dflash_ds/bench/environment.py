"""What a bench ran on: device, library versions, compile caches (recorded in every report)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import socket
import tempfile

import torch


def _version(dist_name: str) -> str | None:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cache_entries(path: str | None) -> int | None:
    if not path or not os.path.isdir(path):
        return 0 if path else None
    return sum(len(files) for _, _, files in os.walk(path))


def environment(device: torch.device, cache_at_start: dict) -> dict:
    env = {"device": str(device), "device_name": platform.processor() or platform.machine(),
           "hostname": socket.gethostname(), "python": platform.python_version(),
           "torch": torch.__version__, "transformers": _version("transformers"), "deepspeed": _version("deepspeed"),
           "triton": _version("triton"), "flash_linear_attention": _version("flash-linear-attention"),
           "fla_core": _version("fla-core"), "fla_importable": importlib.util.find_spec("fla") is not None,
           "causal_conv1d_importable": importlib.util.find_spec("causal_conv1d") is not None,
           "compile_cache": cache_at_start}
    if device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
        env["gpu_memory_gib"] = torch.cuda.get_device_properties(device).total_memory / 1024 ** 3
    else:
        env["cpu_threads"] = torch.get_num_threads()
    return env


def compile_cache_state(cold: bool) -> dict:
    """Point inductor/triton at fresh directories for --cold-cache; report what the caches hold."""
    if cold:
        root = tempfile.mkdtemp(prefix="dflash_bench_cold_")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, "inductor")
        os.environ["TRITON_CACHE_DIR"] = os.path.join(root, "triton")
    inductor = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if inductor is None:
        try:
            from torch._inductor.runtime.cache_dir_utils import default_cache_dir

            inductor = default_cache_dir()
        except Exception:
            inductor = None
    triton = os.environ.get("TRITON_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".triton", "cache"))
    return {"cold": cold, "inductor_dir": inductor, "inductor_entries_at_start": _cache_entries(inductor),
            "triton_dir": triton, "triton_entries_at_start": _cache_entries(triton)}
