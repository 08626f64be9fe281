"""Sixteen concurrent streaming chats against a running `serve` with the official `openai`
package: each reassembled stream must equal the same chat answered whole (greedy), and the
server's /metrics must show more than one request running while they are in flight.

Usage: many_streams.py BASE_URL MODEL API_KEY   (BASE_URL like http://127.0.0.1:8080/v1)
Exits non-zero with a message on the first mismatch.
"""

import re
import sys
import threading
import urllib.request

import openai

N = 16


def main() -> int:
    base_url, model, api_key = sys.argv[1:4]
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=120)

    def params(k):
        question = f"Question {k}: name {k + 2} colours of the rainbow."
        return dict(
            model=model,
            messages=[{"role": "user", "content": question}],
            temperature=0,
            max_tokens=24 + k,
        )

    def text(message):
        return (getattr(message, "reasoning_content", None) or "") + "|" + (message.content or "")

    # The answers one at a time first.
    whole = [text(client.chat.completions.create(**params(k)).choices[0].message) for k in range(N)]

    streamed = [None] * N
    errors = []
    running_seen = []
    done = threading.Event()
    metrics_url = base_url.rsplit("/v1", 1)[0] + "/metrics"

    def watch():
        while not done.is_set():
            try:
                body = urllib.request.urlopen(metrics_url, timeout=10).read().decode()
                m = re.search(r"^xing4_num_requests_running (\S+)$", body, re.M)
                if m:
                    running_seen.append(float(m.group(1)))
            except Exception as e:  # noqa: BLE001 - recorded, checked below
                errors.append(f"metrics: {e}")
            done.wait(0.005)

    def stream(k):
        try:
            reasoning, content = "", ""
            for chunk in client.chat.completions.create(**params(k), stream=True):
                if chunk.choices:
                    d = chunk.choices[0].delta
                    reasoning += getattr(d, "reasoning_content", None) or ""
                    content += d.content or ""
            streamed[k] = reasoning + "|" + content
        except Exception as e:  # noqa: BLE001 - recorded, checked below
            errors.append(f"stream {k}: {e!r}")

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=stream, args=(k,)) for k in range(N)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    watcher.join()

    assert not errors, errors
    for k in range(N):
        assert streamed[k] == whole[k], f"chat {k}: streamed {streamed[k]!r} != whole {whole[k]!r}"
    peak = max(running_seen, default=0)
    assert peak > 1, f"at most {peak} request(s) running at once over {len(running_seen)} samples"
    print(f"{N} concurrent streams equal their whole answers; peak running {peak:.0f}; checks passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
