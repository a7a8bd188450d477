"""The memory plan of a serve config (contracts/memory_plan.py), made where the gateway starts, before anything loads:
`edge serve` refuses a model that cannot fit and carries the plan's decisions to its processes; `edge check-model
--memory` prints the same plan.

The gateway imports no torch (300 MiB it would hold for nothing), so the device, the compute dtype and the GPU's
memory are read here as the engine will resolve them (decode_gpu/runner/device.py): CUDA when torch is a CUDA build
and nvidia-smi sees a GPU; bfloat16 on CUDA and on CPUs with native bfloat16.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import logging
import os
import shutil
import subprocess
from pathlib import Path

import psutil

from contracts.memory_plan import GIB, Machine, MemoryPlan, MemoryRefused, PlanConfig, plan_memory
from contracts.model_sizes import cpu_flags, model_sizes
from contracts.options import AUTO, FLOAT_WEIGHT_DTYPES
from edge.config import worker_kv_type

log = logging.getLogger("edge.check_model.memory")
_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})  # decode_gpu/runner/device.py's: native bfloat16 dot products
_SMI_TIMEOUT_S = 10.0


class NoDeviceMemory(ValueError):
    """device = "cuda", but the GPU's memory cannot be read: the plan cannot be made."""


def gpu_memory_bytes() -> int:
    """The first visible GPU's total memory, as nvidia-smi reports it; 0 when torch is a CPU build or no GPU is
    seen (the engine then decodes on the CPU)."""
    try:
        if importlib.metadata.version("torch").endswith("+cpu"):
            return 0
    except importlib.metadata.PackageNotFoundError:
        return 0
    smi = shutil.which("nvidia-smi")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
    if smi is None or visible in ("", "-1"):
        return 0
    try:
        done = subprocess.run([smi, "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", visible],
                              capture_output=True, text=True, timeout=_SMI_TIMEOUT_S, check=True)
        return int(done.stdout.split()[0]) * 2**20  # MiB
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return 0


def cpu_has_bfloat16(cpuinfo: Path = Path("/proc/cpuinfo")) -> bool:
    try:
        text = cpuinfo.read_text()
    except OSError:
        return False
    flags = next((line.partition(":")[2].split() for line in text.splitlines() if line.startswith("flags")), [])
    return bool(_BF16_FLAGS & set(flags))


def machine(device: str, gpu_bytes: int | None = None) -> Machine:
    """This box as the plan sees it: `device` (auto, cpu, cuda) resolved, its RAM, the GPU's memory on CUDA."""
    gpu = gpu_memory_bytes() if gpu_bytes is None and device != "cpu" else (gpu_bytes or 0)
    if device == "cuda" and not gpu:
        raise NoDeviceMemory("device = \"cuda\", but no GPU's memory could be read (nvidia-smi) for the memory plan")
    resolved = "cuda" if device == "cuda" or (device == AUTO and gpu) else "cpu"
    return Machine(resolved, psutil.virtual_memory().total, gpu if resolved == "cuda" else 0, cpu_flags())


def plan_config(config, box: Machine, kv_type: str) -> PlanConfig:
    """The plan's settings from a ServeConfig (edge.config), auto values resolved as the processes resolve them."""
    if config.weight_dtype in FLOAT_WEIGHT_DTYPES:
        dtype = config.weight_dtype
    elif config.dtype != AUTO:
        dtype = config.dtype
    else:
        dtype = "bfloat16" if box.device == "cuda" or cpu_has_bfloat16() else "float32"
    return PlanConfig(memory_budget=config.memory_budget, weight_dtype=config.weight_dtype, dtype=dtype,
                      prefill_weights=config.prefill_weights, kv_type=kv_type, kv_storage=config.kv_storage,
                      kv_cache_tokens=config.kv_cache_tokens or 0, prefill_workers=config.prefill_workers,
                      n_ctx=config.n_ctx, n_batch=config.n_batch, prefix_cache_tokens=config.prefix_cache_tokens,
                      max_num_seqs=config.max_num_seqs, max_model_len=config.max_model_len,
                      swap_space_gib=config.swap_space_gib, kv_return_bytes=config.kv_return_bytes)


def serve_plan(config, model_path: str, box: Machine) -> MemoryPlan:
    """The plan of `edge serve` with `config` on `box` (MemoryRefused when the model cannot fit)."""
    kv_type = worker_kv_type(config, config.engine_address or "unix:")
    return plan_memory(model_sizes(model_path), box, plan_config(config, box, kv_type))


def planned_config(config, plan: MemoryPlan, box: Machine):
    """`config` with the plan's decisions, which the launcher copies into the process configs: the workers that fit,
    the swap space within the plan, the weight_dtype told and the weight sets allowed, the copies auto may measure,
    and the pool: its tokens on the CPU; on CUDA the engine sizes it from what it measures free, within the device's
    budget (gpu_memory_utilization no larger than the budget's share of the device)."""
    changes = {"prefill_workers": plan.prefill_workers, "weight_dtype": plan.weight_dtype,
               "weight_second_set": plan.second_set, "weight_float_set": plan.float_set,
               "weight_repack": plan.repack, "prefix_cache_tokens": plan.prefix_cache_tokens,
               "swap_space_gib": min(config.swap_space_gib, plan.swap_bytes / GIB)}
    if box.device == "cpu":
        changes["kv_cache_tokens"] = plan.kv_cache_tokens
    elif config.memory_budget:
        changes["gpu_memory_utilization"] = min(config.gpu_memory_utilization,
                                                plan.budgets["device"] / box.device_bytes)
    if config.prefill_weights == AUTO:
        changes["prefill_copy_kinds"] = plan.prefill_copy_kinds
    return dataclasses.replace(config, **changes)


def memory_plan(path: str, memory_budget: int, device: str) -> dict:
    """`edge check-model --memory`: the plan of `edge serve` with default settings and this budget (0: the box's
    default) on this box, as a dict (the JSON report's "memory_plan"); {"refused": why} where the start would be
    refused."""
    from edge.config import ServeConfig
    config = ServeConfig(memory_budget=memory_budget, device=device)
    try:
        plan = serve_plan(config, path, machine(device))
    except (MemoryRefused, NoDeviceMemory) as err:
        return {"refused": str(err)}
    return {**dataclasses.asdict(plan), "describe": plan.describe()}


def print_plan(report: dict) -> None:
    if report.get("refused"):
        print(f"\nmemory plan: would be refused at start: {report['refused']}")
        return
    print("\nmemory plan of edge serve with default settings (docs/sizes.md, \"The plan\")")
    print("\n".join("  " + line if line else "" for line in report["describe"].splitlines()))
