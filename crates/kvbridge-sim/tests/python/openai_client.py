"""The official `openai` client against the kvbridge proxy (run by tests/openai_client.rs).

CI: `pip install openai`. Usage: openai_client.py BASE_URL MODEL PROMPT EXPECTED_CHAT EXPECTED_COMPLETION
Streams a chat completion and a completion through the proxy and checks each reads back
whole and equal to the colocated engine's answer. Exit status 0 on success.
"""
import sys

from openai import OpenAI

base, model, prompt, want_chat, want_cmpl = sys.argv[1:6]
client = OpenAI(base_url=base + "/v1", api_key="unused", timeout=20.0, max_retries=0)

stream = client.chat.completions.create(
    model=model,
    messages=[{"role": "user", "content": prompt}],
    max_tokens=6,
    stream=True,
)
got = "".join((c.choices[0].delta.content or "") for c in stream if c.choices)
if got != want_chat:
    sys.exit(f"chat: got {got!r}, want {want_chat!r}")

whole = client.chat.completions.create(
    model=model, messages=[{"role": "user", "content": prompt}], max_tokens=6
)
if whole.choices[0].message.content != want_chat:
    sys.exit(f"chat (not streamed): got {whole.choices[0].message.content!r}")

stream = client.completions.create(model=model, prompt=prompt, max_tokens=6, stream=True)
got = "".join(c.choices[0].text for c in stream if c.choices)
if got != want_cmpl:
    sys.exit(f"completion: got {got!r}, want {want_cmpl!r}")
print("ok")
