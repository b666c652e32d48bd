"""Test-session settings. The models here are tiny: one thread is as fast as two and leaves the other core free
(for CI's second job or a background data run)."""

import torch

torch.set_num_threads(1)
