"""Responses written by vLLM, as users serve a target: the pipeline's responses stage hands each batch of prompt ids to
a vLLM engine in vLLM's own virtualenv (`make vllm`: .venv-vllm, which pins its own torch and transformers).

`VLLMEngine` (this process) starts `python -m modeling_xpress.pipeline.vllm_engine` with that virtualenv's Python and
talks to it over a local connection (`multiprocessing.connection`, an authentication key in the child's environment):
it sends lists of prompt token ids and receives each response's new token ids. The engine loads the target folder
once, with no tokenizer (`skip_tokenizer_init`: the ids are the pipeline's own, so both engines see identical
inputs), and decodes greedily unless asked to sample. It is a `generate_fn` of `regeneration.regenerate_responses`,
whose shards and resumption work as with `target.generate`. vLLM's log goes to a file beside the responses.

This module runs in both virtualenvs: its top level imports only the standard library; vLLM is imported in `serve`.
"""

from __future__ import annotations

import argparse
import os
import secrets
import subprocess
import threading
from multiprocessing.connection import Client, Listener
from pathlib import Path

AUTHKEY_ENV = "XPRESS_VLLM_AUTHKEY"
DEFAULT_VLLM_PYTHON = Path(".venv-vllm") / "bin" / "python"
"""vLLM's virtualenv as `make vllm` builds it, relative to the repository root."""
MEMORY_SHARE = 0.25
"""vLLM's `gpu_memory_utilization`; on a CPU the share of RAM it reserves (its default, 0.92, fails on a shared VM)."""
START_TIMEOUT_S = 900


class VLLMEngine:
    """Greedy (or sampled) generation by a vLLM engine in another virtualenv; call it with a batch of prompt id lists."""

    name = "vllm"

    def __init__(self, python: str | os.PathLike, model: str | os.PathLike, *, dtype: str, max_new_tokens: int,
                 stop_ids: list[int], max_model_len: int, do_sample: bool = False, temperature: float = 1.0,
                 seed: int = 0, log_file: str | os.PathLike | None = None):  # fmt: skip
        authkey = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
        host, port = listener.address
        command = [str(python), "-m", __name__, "--host", host, "--port", str(port), "--model", str(model),
                   "--dtype", dtype, "--max-new-tokens", str(max_new_tokens), "--max-model-len", str(max_model_len),
                   "--stop-ids", ",".join(map(str, stop_ids)), "--seed", str(seed),
                   "--temperature", str(temperature if do_sample else 0.0)]  # fmt: skip
        package_root = str(Path(__file__).resolve().parents[2])  # this checkout's modeling_xpress, not another copy
        env = {**os.environ, AUTHKEY_ENV: authkey.hex(),
               "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}  # fmt: skip
        self.log_file = Path(log_file) if log_file else None
        if self.log_file is not None:
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_file, "a") if self.log_file else subprocess.DEVNULL
        self.process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        accepted: list = []
        waiter = threading.Thread(target=lambda: accepted.append(listener.accept()), daemon=True)
        waiter.start()
        waiter.join(START_TIMEOUT_S)
        listener.close()
        if not accepted:
            self.close()
            raise RuntimeError(f"the vLLM engine ({python}) did not start{self._log_tail()}")
        self.connection = accepted[0]
        ready = self._receive()
        if ready != "ready":
            raise RuntimeError(f"the vLLM engine sent {ready!r} instead of 'ready'{self._log_tail()}")

    def _log_tail(self) -> str:
        if self.log_file is None or not self.log_file.is_file():
            return ""
        return f"; the end of its log ({self.log_file}):\n" + "\n".join(self.log_file.read_text().splitlines()[-20:])

    def _receive(self):
        try:
            return self.connection.recv()
        except (EOFError, OSError):
            code = self.process.wait()
            raise RuntimeError(f"the vLLM engine exited with code {code}{self._log_tail()}") from None

    def __call__(self, batch: list[list[int]]) -> list[list[int]]:
        self.connection.send(batch)
        return self._receive()

    def close(self) -> None:
        connection = getattr(self, "connection", None)
        if connection is not None:
            try:
                connection.send(None)
                connection.close()
            except OSError:
                pass
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def serve(args: argparse.Namespace) -> None:
    """The engine's side: load the target in vLLM, say "ready", then answer batches until told to stop."""
    connection = Client((args.host, args.port), authkey=bytes.fromhex(os.environ[AUTHKEY_ENV]))
    from vllm import LLM, SamplingParams

    llm = LLM(model=args.model, dtype=args.dtype, seed=args.seed, gpu_memory_utilization=MEMORY_SHARE,
              max_model_len=args.max_model_len, skip_tokenizer_init=True)  # fmt: skip
    stop_ids = [int(i) for i in args.stop_ids.split(",") if i]
    params = SamplingParams(temperature=args.temperature, top_k=0 if args.temperature == 0 else -1, top_p=1.0,
                            max_tokens=args.max_new_tokens, stop_token_ids=stop_ids, detokenize=False)  # fmt: skip
    connection.send("ready")
    while (batch := connection.recv()) is not None:
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in batch], params, use_tqdm=False)
        responses = []
        for output in outputs:
            completion = output.outputs[0]
            tokens = list(completion.token_ids)
            # a response ends with the token that stopped it, as `generate`'s do (the loss mask covers it)
            if completion.finish_reason == "stop" and isinstance(completion.stop_reason, int):
                if not tokens or tokens[-1] != completion.stop_reason:
                    tokens.append(completion.stop_reason)
            responses.append(tokens)
        connection.send(responses)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="the vLLM side of the pipeline's responses stage (started by it)")
    for name in ("--host", "--model", "--dtype", "--stop-ids"):
        parser.add_argument(name, required=True)
    for name in ("--port", "--max-new-tokens", "--max-model-len", "--seed"):
        parser.add_argument(name, type=int, required=True)
    parser.add_argument("--temperature", type=float, default=0.0)
    serve(parser.parse_args())
