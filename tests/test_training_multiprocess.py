"""Two training processes (DDP over gloo on CPU, NCCL on GPUs) run the unchanged example script and leave a loadable
checkpoint."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from modeling_xpress import XPressModel

pytestmark = pytest.mark.slow  # two training processes: `pytest -m "not slow"` skips it

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    """A port nobody listens on, so a concurrent torch.distributed job on this machine cannot collide with ours."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    run = subprocess.run(launch + script, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
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
