"""Ask the server `make serve` started (vLLM's OpenAI-compatible API, xPress drafting) one chat question.

    make serve                                   # in one terminal (PORT=8000 by default)
    python examples/vllm_client.py "Write a haiku about speculative decoding."

Only the standard library: any OpenAI client works the same way (base URL http://localhost:PORT/v1, model
"smollm2-xpress").
"""

import argparse
import json
import time
import urllib.error
import urllib.request


def chat(url: str, model: str, question: str, max_tokens: int, temperature: float) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": question}], "max_tokens": max_tokens,
            "temperature": temperature}  # fmt: skip
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=300) as response:
        return json.loads(response.read())


def wait_until_ready(url: str, timeout: float) -> None:
    """Poll the server's /health until it answers (model loading takes a minute or two on a CPU)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5):
                return
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no server answered at {url} within {timeout:.0f} s: is `make serve` running?")
            time.sleep(2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("question", nargs="?", default="Explain speculative decoding in two sentences.")
    parser.add_argument("--url", default="http://localhost:8000")
    parser.add_argument("--model", default="smollm2-xpress")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--wait", type=float, default=0.0, help="seconds to wait for the server to come up")
    args = parser.parse_args()
    if args.wait:
        wait_until_ready(args.url, args.wait)
    reply = chat(args.url, args.model, args.question, args.max_tokens, args.temperature)
    print(reply["choices"][0]["message"]["content"])


if __name__ == "__main__":
    main()
