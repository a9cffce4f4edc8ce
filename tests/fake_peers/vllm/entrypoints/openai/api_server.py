"""A stand-in for vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`), so
that `bench.py --serve --compare vllm` can be tested where vLLM is not installed: the
routes the benchmark uses, streaming the fake model's tokens (`vllm.next_token`) as
vLLM streams them, one chunk per token, the usage last, then `[DONE]`. Its prefix cache is
a set of the prompts it has answered: a prompt seen before counts as cached in the usage
(vLLM's `--enable-prompt-tokens-details`)."""

import argparse
import json
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from vllm import check_thread_binding, next_token


class Handler(BaseHTTPRequestHandler):
    model = ""
    answered: set[tuple[int, ...]] = set()  # the prompts this process has seen

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send(b"")
        elif self.path == "/v1/models":
            self._send(json.dumps({"data": [{"id": self.model}]}).encode())
        else:
            self.send_error(404)

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["stream"] and body["ignore_eos"] and body["temperature"] == 0.0
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        tokens = list(body["prompt"])
        for _ in range(body["max_tokens"]):
            tokens.append(next_token(tokens))
            self._event({"choices": [{"index": 0, "text": f" {tokens[-1]}"}]})
        prompt = tuple(body["prompt"])
        cached = len(prompt) if prompt in self.answered else 0
        self.answered.add(prompt)
        usage = {"prompt_tokens": len(prompt), "completion_tokens": body["max_tokens"],
                 "prompt_tokens_details": {"cached_tokens": cached}}
        self._event({"choices": [], "usage": usage})
        self.wfile.write(b"data: [DONE]\n\n")

    def _event(self, chunk: dict) -> None:
        self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model")
    parser.add_argument("--port", type=int)
    parser.add_argument("--host", default="127.0.0.1")
    options, _ = parser.parse_known_args()  # dtype, context, batch size: nothing to set
    check_thread_binding()
    Handler.model = options.model
    ThreadingHTTPServer((options.host, options.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
