"""Two training processes (DDP over gloo on CPU, NCCL on GPUs) run the unchanged example script and leave a loadable
checkpoint."""

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch

from modeling_xpress import XPressModel

pytestmark = pytest.mark.slow  # two training processes: `pytest -m "not slow"` skips it

ROOT = Path(__file__).resolve().parents[1]
EXIT_BARRIER_PASSED = "xPress training: every rank finished"  # printed by train_refiner.py after its final barrier
LAUNCH_TAG = "XPRESS_TEST_LAUNCH"  # set in the launch's environment, to find its processes again


def free_port() -> int:
    """A port nobody listens on, so a concurrent torch.distributed job on this machine cannot collide with ours."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launched_by(tag: str) -> list[psutil.Process]:
    """The processes whose environment carries `LAUNCH_TAG=tag`: the launcher and every worker, whatever their session
    or parent (a worker whose launcher exited is re-parented), as the environment is inherited."""
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):  # gone, a zombie, or not ours to read
            if p.environ().get(LAUNCH_TAG) == tag:
                found.append(p)
    return found


def signal_all(group: int, tag: str, signum: int) -> None:
    """`signum` to the launcher's process group and to every process launched with `tag`."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, signum)
    for p in launched_by(tag):
        with contextlib.suppress(psutil.Error):
            p.send_signal(signum)


def launch_and_wait(command: list[str], output_dir: Path, timeout: int = 240) -> subprocess.CompletedProcess:
    """Run the launcher in its own process group. If it outlives `timeout`, every process it launched is sent SIGABRT
    (PYTHONFAULTHANDLER makes each dump all its threads' Python stacks), then killed. A job that had finished its work
    (the final model written, every rank through the exit barrier) and then hung leaving the interpreter is torch's
    known teardown race (pytorch/pytorch#75097, #190489), which this package cannot fix: that outcome is reported as an
    expected failure with the stacks, anything else fails."""
    tag = f"{os.getpid()}-{output_dir.name}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONFAULTHANDLER": "1",
           LAUNCH_TAG: tag}  # fmt: skip
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # torchrun starts each worker in a session of its own, out of the launcher's group; a worker left alive keeps
        # the output pipes open and the last communicate() would wait for ever, so every launched process is signalled.
        signal_all(process.pid, tag, signal.SIGABRT)
        try:
            stdout, stderr = process.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            signal_all(process.pid, tag, signal.SIGKILL)
            stdout, stderr = process.communicate()
        finished = (output_dir / "model.safetensors").is_file() and stdout.count(EXIT_BARRIER_PASSED) == 2
        report = f"hung after {timeout} s; stdout:\n{stdout[-3000:]}\nstderr (stacks at SIGABRT):\n{stderr[-6000:]}"
        if finished:
            pytest.xfail("training, saving and the exit barrier finished, then a process hung on exit: " + report)
        pytest.fail(report)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def test_accelerate_launch_two_processes_trains_and_checkpoints(tmp_path):
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "2", "--num_machines", "1"]
    launch += ["--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port())]
    if not torch.accelerator.is_available():
        # Without GPUs a plain `--num_processes 2` starts a single process; --multi_gpu makes accelerate start
        # torchrun-style workers, which XPressTrainingArguments then joins over gloo on CPU.
        launch.append("--multi_gpu")
    script = [
        str(ROOT / "examples" / "train_refiner.py"), "--target", "tiny-random", "--output_dir", str(tmp_path),
        "--max_steps", "3", "--save_steps", "3", "--per_device_train_batch_size", "2", "--logging_steps", "1",
        "--num_draft_layers", "1", "--block_size", "8", "--refiner_rank", "16", "--report_to", "none",
        "--disable_tqdm", "true",
    ]  # fmt: skip
    run = launch_and_wait(launch + script, tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "xPress training: 2 process(es)" in run.stdout, run.stdout[-3000:]

    checkpoint = tmp_path / "checkpoint-3"
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["global_step"] == 3
    # 2 processes × 2 sequences per step over the 64 synthetic rows: the data really was split between them.
    assert state["epoch"] == 3 * 4 / 64
    assert any("tau_estimate" in entry for entry in state["log_history"])
    for folder in (checkpoint, tmp_path):
        model = XPressModel.from_pretrained(folder)
        assert model.config.block_size == 8 and model.config.refiner == "xpress"
