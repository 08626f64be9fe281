import json, sys, time, urllib.request
url = sys.argv[1]
def req(body):
    r = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    t = time.time()
    with urllib.request.urlopen(r, timeout=300) as f:
        d = json.load(f)
    return time.time() - t, d["usage"]["completion_tokens"], d["choices"][0]["finish_reason"]
base = {"messages": [{"role": "user", "content": "Write something."}], "max_tokens": 256, "temperature": 0,
        "ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}}
arms = {
    "free": {},
    "regex": {"guided_regex": "[a-z ]{1,2000}"},
    "json": {"response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}},
}
req({**base, "max_tokens": 8})
for name, extra in arms.items():
    rates = []
    for _ in range(5):
        s, n, fin = req({**base, **extra})
        rates.append(n / s)
    rates.sort()
    print(f"{name}: median {rates[2]:.1f} tok/s (min {rates[0]:.1f}, max {rates[-1]:.1f}), {n} tokens, finish {fin}")
