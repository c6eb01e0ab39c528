"""The plan of a host's workers (worker/launch/host.py) and the --gpus setting, without starting anything: which
devices a --gpus value names, and what each worker is given (device, consumer name, port, planner processes, every
setting)."""

import pytest

from worker.config import Settings, SettingsError
from worker.launch.host import Device, LaunchError, devices, environment, planner_processes
from worker.launch.launcher import Launcher


def test_cpu_workers_see_no_gpu_and_gpu_numbers_are_positions_in_the_visible_list():
    assert devices("cpu:3", {}) == [Device(i, "cpu", "") for i in range(3)]
    visible = {"CUDA_VISIBLE_DEVICES": "4,5,GPU-a1b2,7"}
    assert devices("all", visible) == [Device(0, "cuda:0", "4"), Device(1, "cuda:0", "5"),
                                       Device(2, "cuda:0", "GPU-a1b2"), Device(3, "cuda:0", "7")]
    assert devices("3, 1", visible) == [Device(0, "cuda:0", "7"), Device(1, "cuda:0", "5")]
    with pytest.raises(LaunchError, match="GPU 4 is not there .4 visible"):
        devices("0,4", visible)
    with pytest.raises(LaunchError, match="no GPU is visible"):
        devices("all", {"CUDA_VISIBLE_DEVICES": ""})


@pytest.mark.parametrize("value", ["gpu", "cpu:0", "cpu:", "0,0", "1,,2", "-1", "all,0", "cpu:2,0"])
def test_a_bad_gpus_value_is_refused_when_parsed(value):
    with pytest.raises(SettingsError, match=r"--gpus \(DQ_GPUS\) must be all, cpu:N"):
        Settings.from_env({"DQ_GPUS": value})


def test_gpus_takes_no_device_of_its_own():
    with pytest.raises(SettingsError, match=r"--device \(DQ_DEVICE\) must be auto with --gpus"):
        Settings(gpus="all", device="cuda:1")
    assert Settings(gpus="0, 2").gpus == "0, 2" and Settings(gpus="cpu:4").device == "auto"


def test_planner_processes_share_the_cores_out_unless_set():
    assert planner_processes(0, workers=8, cores=128, gpu=True) == 8  # 15 each would be more than a GPU needs
    assert planner_processes(0, workers=4, cores=16, gpu=True) == 3  # one core each for the worker itself
    assert planner_processes(0, workers=8, cores=8, gpu=True) == 1  # never none
    assert planner_processes(6, workers=8, cores=8, gpu=True) == 6  # set: as set
    assert planner_processes(0, workers=2, cores=64, gpu=False) == 0  # CPU workers keep threads


def test_each_worker_gets_every_setting_and_its_own_device_name_port_and_planners():
    settings = Settings(gpus="all", checkpoint="/m", redis_url="redis://:pw@r:6379/2", fp8=True, cuda_graphs=False,
                        max_wait_ms=2.5, metrics_port=9400, consumer="node7", namespace="prod")
    env = environment(settings, Device(2, "cuda:0", "5"), "node7-2", 9403, workers=4, cores=32,
                      environ={"PATH": "/bin", "DQ_SHARD": "9"})
    assert env["PATH"] == "/bin" and env["CUDA_VISIBLE_DEVICES"] == "5" and env["OMP_NUM_THREADS"] == "8"
    worker = Settings.from_env(env)  # what the worker process parses: the launcher's settings, then its own
    assert worker.gpus == "" and worker.device == "cuda:0" and worker.consumer == "node7-2"
    assert worker.metrics_port == 9403 and worker.planner_processes == 7 and worker.shard == 0  # not the stray 9
    assert (worker.checkpoint, worker.redis_url, worker.fp8, worker.cuda_graphs, worker.max_wait_ms,
            worker.namespace) == ("/m", "redis://:pw@r:6379/2", True, False, 2.5, "prod")
    assert worker.deterministic is None  # unset stays unset: each worker decides on its own card
    for given in (True, False):
        passed = environment(settings.replace(deterministic=given), Device(0, "cuda:0", "0"), "n-0", 0, workers=1,
                             cores=8, environ={})
        assert Settings.from_env(passed).deterministic is given


def test_workers_are_named_and_numbered_from_the_launcher():
    where = devices("cpu:3", {})
    launcher = Launcher(Settings(gpus="cpu:3", metrics_port=9400, consumer="h"), where, environ={}, cores=2)
    assert [(w.consumer, w.port) for w in launcher.workers] == [("h-0", 9401), ("h-1", 9402), ("h-2", 9403)]
    assert launcher.command[-3:] == ["-m", "worker", "serve"]
    unnamed = Launcher(Settings(gpus="cpu:2"), devices("cpu:2", {}), environ={}, cores=2)
    assert [w.port for w in unnamed.workers] == [0, 0]  # no endpoints asked for: none
    first, second = (w.consumer for w in unnamed.workers)
    assert first[:-2] == second[:-2] and first.endswith("-0")  # host-pid of the launcher, then the number
    with pytest.raises(LaunchError, match="pass 65535"):
        Launcher(Settings(gpus="cpu:3", metrics_port=65533), where, environ={}, cores=2)
