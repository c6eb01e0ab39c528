"""The plan of one host's workers (worker/launch/launcher.py runs it): which devices a --gpus value names, and
what each worker is given: its device, consumer name, metrics port, planner processes and threads, as DQ_*
variables."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any

from ..config import Settings

PLANNERS_MAX = 8  # planner processes per GPU worker when sized from the cores


class LaunchError(ValueError):
    """A --gpus that this host cannot satisfy (no GPU, a number past the last one, ports past 65535)."""


@dataclass(frozen=True)
class Device:
    """One worker of a host: its number, its --device and its CUDA_VISIBLE_DEVICES."""

    index: int  # the worker's number: its consumer name's suffix, its port's offset
    device: str  # the worker's --device
    visible: str  # its CUDA_VISIBLE_DEVICES ("": none)


def devices(spec: str, environ: dict[str, str] | None = None) -> list[Device]:
    """The workers of a --gpus value: ``cpu:N``; ``all``; or GPU numbers as this process sees them (positions
    in its CUDA_VISIBLE_DEVICES when that is set)."""
    environ = os.environ if environ is None else environ
    spec = spec.replace(" ", "")
    if spec.startswith("cpu:"):
        return [Device(i, "cpu", "") for i in range(int(spec[4:]))]
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    names = [v.strip() for v in visible.split(",") if v.strip()] if visible is not None else None
    count = len(names) if names is not None else _cuda_count()
    picks = list(range(count)) if spec == "all" else [int(n) for n in spec.split(",")]
    if not picks:
        raise LaunchError(f"--gpus {spec}: no GPU is visible here (cpu:N runs CPU workers)")
    if max(picks) >= count:
        raise LaunchError(f"--gpus {spec}: GPU {max(picks)} is not there ({count} visible)")
    return [Device(i, "cuda:0", names[gpu] if names is not None else str(gpu)) for i, gpu in enumerate(picks)]


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count()


def host_cores() -> int:
    """The cores this process may run on (a cpuset or taskset narrows them)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def planner_processes(configured: int, workers: int, cores: int, gpu: bool) -> int:
    """Per worker: ``--planner-processes`` when set; for GPU workers at 0 (the default) the host's cores
    shared out, less one each for the worker's own process (the GPU loop and the Redis loop), 1 to
    ``PLANNERS_MAX``. CPU workers keep threads at 0: their model needs the cores."""
    if configured or not gpu:
        return configured
    return max(1, min(PLANNERS_MAX, cores // workers - 1))


def environment(settings: Settings, where: Device, consumer: str, port: int, workers: int, cores: int,
                environ: dict[str, str]) -> dict[str, str]:
    """A worker's variables: the launcher's settings, every one (a worker reads no flags), then its own."""
    env = dict(environ)
    env.update({Settings.env_name(f.name): _text(getattr(settings, f.name)) for f in fields(Settings)})
    planners = planner_processes(settings.planner_processes, workers, cores, where.device != "cpu")
    env.update(DQ_GPUS="", DQ_DEVICE=where.device, DQ_CONSUMER=consumer, DQ_METRICS_PORT=str(port),
               DQ_PLANNER_PROCESSES=str(planners), CUDA_VISIBLE_DEVICES=where.visible)
    env.setdefault("OMP_NUM_THREADS", str(max(1, cores // workers)))  # torch's CPU threads, shared out too
    return env


def _text(value: Any) -> str:
    if value is None:  # a switch left unset (--deterministic): each worker decides on its own card
        return "auto"
    return ("true" if value else "false") if isinstance(value, bool) else str(value)
